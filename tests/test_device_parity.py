"""The "cuda" path of the whole stack against the CPU: training steps, decoding, and the fused
ops through F and the launch layer.

On a GPU these compare it with the CPU; without one they run on the emulated device
(MT_EMULATE_CUDA=1, see tests/conftest.py), where CuPy is a stand-in over NumPy and the kernels
are csrc/ compiled for the CPU, so that the Python half of the GPU path (backend, F's dispatch,
kernels/launch.py, autocast and the loss scaler, the fused cross-entropy, beam search's device
arrays) is run and checked before a GPU ever sees it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import amp, backend, kernels, nn
from minitransformer.autograd import _topological_order
from minitransformer.decoding import beam_search, greedy_decode
from minitransformer.optim import Adam, WarmupInverseSqrtSchedule
from minitransformer.train import accumulated_step

pytestmark = pytest.mark.skipif(not backend.has_cuda(),
                                reason="no CUDA device (CuPy with a GPU, or MT_EMULATE_CUDA=1)")

PAD, BOS, EOS, VOCAB = 0, 2, 3, 24


def copy_batch(rng, batch, max_len):
    """The copy task of examples/copy_task.py: (src, tgt_in, tgt_out) with padding."""
    lengths = rng.integers(2, max_len + 1, batch)
    src = np.full((batch, max_len), PAD)
    tgt = np.full((batch, max_len + 2), PAD)
    for i, n in enumerate(lengths):
        seq = rng.integers(4, VOCAB, n)
        src[i, :n], tgt[i, 0], tgt[i, 1:n + 1], tgt[i, n + 1] = seq, BOS, seq, EOS
    return src, tgt[:, :-1], tgt[:, 1:]


def small_model(seed=0, d_model=64, heads=2):
    # d_k = 32, a head dim the fused attention takes. No dropout: the devices draw different
    # random streams, and the comparison is of the arithmetic.
    mt.manual_seed(seed)
    cfg = nn.TransformerConfig(vocab_size=VOCAB, d_model=d_model, d_ff=2 * d_model, h=heads,
                               num_encoder_layers=2, num_decoder_layers=2, dropout=0.0,
                               pad_id=PAD, bos_id=BOS, eos_id=EOS)
    return nn.Transformer(cfg)


def trainer(model, precision):
    """A one-batch step closure for ``model`` (Adam with the warmup schedule; the precision's
    autocast and loss scaler), and the scaler."""
    optimizer = Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    schedule = WarmupInverseSqrtSchedule(optimizer, model.config.d_model, warmup=40)  # lr ~5e-4 a step
    name = amp.PRECISIONS[precision]
    amp_dtype = None if name is None else backend.resolve_dtype(name)
    scaler = amp.scaler_for(amp_dtype)

    def step(batch):
        device = next(model.parameters()).device
        return accumulated_step(model, optimizer, schedule, [tuple(mt.tensor(a, device=device) for a in batch)], 0.1,
                                amp_dtype=amp_dtype, scaler=scaler)
    return step, scaler


# The devices compute each step from the same weights: a comparison of whole trajectories would
# mostly measure Adam, which moves a weight by about the learning rate whatever the size of its
# gradient, so that gradients of ~0 whose signs differ between the devices part at once.
# float32: the devices differ by the kernels' rounding (exp2 for exp, other summation orders),
# ~1e-6 relative. 16-bit: every op rounds at 2^-8 (bfloat16) or 2^-11 (float16), each device at
# other points (a fused kernel once, a composite op after each elementary step). This small
# model's gradients are sensitive to that: one unit of roundoff in the attention output moves
# some of them by ~1%, and the 16-bit CPU step itself is up to ~5-8% off the float32 one. So,
# as flash-attention's tests do, the 16-bit step on "cuda" is held to twice the error of the
# same 16-bit step on the CPU, both measured against the float32 step on the CPU, over all
# parameters and steps (plus one unit of roundoff).
UNIT = {"bf16": 2.0**-8, "fp16": 2.0**-11}
FP32_RTOL = 1e-4  # in norm


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_steps_on_cuda_match_the_cpu(precision):
    if precision == "bf16" and backend.bfloat16 is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    models = {"cuda": small_model().to("cuda"), "cpu": small_model(), "cpu fp32": small_model()}
    steps = {name: trainer(m, "fp32" if name == "cpu fp32" else precision) for name, m in models.items()}
    batch, losses, errors = copy_batch(np.random.default_rng(1), 6, 7), [], {"cuda": [0.0], "cpu": [0.0]}
    for _ in range(3):
        for name in ("cpu", "cpu fp32"):  # the same weights everywhere
            models[name].load_state_dict(models["cuda"].state_dict())
        results = {name: step(batch) for name, (step, _) in steps.items()}
        assert all(r.skipped is None for r in results.values()), results
        grads = {name: {k: p.grad.numpy() for k, p in m.named_parameters()} for name, m in models.items()}
        assert all(p.grad.device == "cuda" and p.grad.dtype == np.float32
                   for p in models["cuda"].parameters())
        exact = results["cpu fp32"].loss, grads["cpu fp32"]
        # Some gradients are exactly zero in exact arithmetic (a key bias shifts all scores of a
        # query alike) and hold rounding noise only: errors are relative to the larger of the
        # parameter's gradient norm and a hundredth of the whole model's.
        floor = 1e-2 * np.sqrt(sum(np.sum(g**2) for g in exact[1].values()))
        for device in ("cuda", "cpu"):
            errors[device] += [np.linalg.norm(grads[device][k] - g) / max(np.linalg.norm(g), floor)
                               for k, g in exact[1].items()]
        if precision == "fp32":
            np.testing.assert_allclose(results["cuda"].loss, exact[0], rtol=1e-5)
        else:
            loss_error = abs(results["cuda"].loss - exact[0])
            assert loss_error <= 2 * abs(results["cpu"].loss - exact[0]) + UNIT[precision] * exact[0]
        losses.append(results["cuda"].loss)
    worst = max(errors["cuda"])
    allowed = FP32_RTOL if precision == "fp32" else 2 * max(errors["cpu"]) + UNIT[precision]
    assert worst <= allowed, (worst, allowed)
    assert losses[-1] < losses[0]  # it learns the batch
    if precision == "fp16":
        assert steps["cuda"][1].scale_value == 2.0**16  # no overflow in these steps: the scale held


def test_the_kernels_did_the_work_on_cuda():
    """The parity above is worth something only if "cuda" ran the fused ops: it does here."""
    if not kernels.enabled():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    model = small_model().to("cuda")
    src, tgt_in, tgt_out = (mt.tensor(a, device="cuda") for a in copy_batch(np.random.default_rng(0), 4, 7))
    loss = F.cross_entropy(model(src, tgt_in), tgt_out, 0.1, PAD)
    ops = {node.fn.__name__ for node in _topological_order(loss._ctx)}  # every op of the graph
    assert {"FusedAttention", "FusedLayerNorm", "FusedCrossEntropy"} <= ops, ops


@pytest.mark.slow  # a whole training run on each device
def test_the_copy_task_trains_on_cuda_as_on_the_cpu():
    """examples/copy_task.py trained on "cuda" for 200 steps of 8 sequences (one layer each
    side, to keep CI short), through the fused attention (d_k = 32), layernorm and loss,
    forward and backward. At every log line the step
    that follows is computed on the CPU too, from the same weights and batch: the two losses
    agree within 1e-5 relative (the kernels' rounding is ~1e-6). Whole trajectories would not:
    two float32 runs part after ~100 steps, as any two orders of summation make them do."""
    import copy
    import importlib.util
    from pathlib import Path

    from minitransformer.train import compute_loss

    path = Path(__file__).resolve().parents[1] / "examples" / "copy_task.py"
    spec = importlib.util.spec_from_file_location("copy_task", path)
    copy_task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy_task)
    args = copy_task.parse_args(["--device", "cuda", "--batch-size", "8", "--steps", "200", "--min-len", "3",
                                 "--max-len", "6", "--heads", "2", "--layers", "1", "--dropout", "0", "--warmup", "100",
                                 "--peak-lr", "0.00375", "--log-every", "20"])
    mt.manual_seed(0)
    rng = np.random.default_rng(0)
    model, twin = copy_task.build(args).to("cuda"), copy_task.build(args)
    expected = {}  # step -> its loss computed on the CPU

    def check_next_step(step):
        twin.load_state_dict(model.state_dict())
        src, tgt_in, tgt_out, _ = copy_task.make_batch(copy.deepcopy(rng), args.batch_size, args.vocab,
                                                       args.min_len, args.max_len, args.task)
        twin.train()
        loss_sum, _, n = compute_loss(twin, mt.tensor(src), mt.tensor(tgt_in), mt.tensor(tgt_out),
                                      args.label_smoothing)
        expected[step + 1] = loss_sum.item() / n
        return False

    check_next_step(0)
    losses = copy_task.train(model, args, rng, stop=check_next_step)
    assert len(losses) == 200 and sorted(expected) == [1] + list(range(21, 202, 20))
    for step in sorted(expected)[:-1]:  # the last would follow the run's end
        np.testing.assert_allclose(losses[step - 1], expected[step], rtol=1e-5, err_msg=f"step {step}")
    assert np.mean(losses[-20:]) < 0.7 * np.mean(losses[:20])  # it learns
    # the fused ops did the work (as test_the_kernels_did_the_work_on_cuda shows for such a model)
    assert not kernels.enabled() or args.d_model // args.heads in kernels.limits()["attention_head_dims"]


def test_beam_search_and_greedy_on_cuda_equal_the_cpu():
    # An untrained model: its predictions are arbitrary but far from ties (the devices' logits
    # differ by ~1e-6), and rarely EOS, so hypotheses run to the length limit through the cache.
    model = small_model(seed=3)
    src = copy_batch(np.random.default_rng(5), 5, 8)[0]
    results = {}
    for device in ("cpu", "cuda"):
        model.to(device)
        s = mt.tensor(src, device=device)
        results[device] = (greedy_decode(model, s, max_len_extra=3),
                           beam_search(model, s, beam_size=3, alpha=0.6, max_len_extra=3))
    assert results["cuda"] == results["cpu"]
    assert sum(len(h) for h in results["cpu"][0]) > 10 and sum(len(h) for h in results["cpu"][1]) > 10


# --------------------------------------------------------------------------- fused ops through F


def directional_check(f, inputs, rtol, seed):
    """Autograd's derivative of ``f`` (a scalar Tensor function) along a random direction
    against the central difference of float32 evaluations: d/dh f(x + h v) at h = 0."""
    rng = np.random.default_rng(seed)
    directions = [rng.standard_normal(x.shape).astype(np.float32) for x in inputs]
    out = f(*inputs)
    out.backward()
    analytic = sum(float((x.grad.numpy() * d).sum()) for x, d in zip(inputs, directions))
    h = 1e-2

    def at(step):
        with mt.no_grad():
            return f(*(mt.tensor(x.numpy() + step * d, device=x.device)
                       for x, d in zip(inputs, directions))).item()

    numeric = (at(h) - at(-h)) / (2 * h)
    assert math.isclose(analytic, numeric, rel_tol=rtol, abs_tol=rtol), (analytic, numeric)


def weighted_sum(y, w):
    """<y, w> for a fixed random w: every output entry's gradient matters, with its own weight."""
    return (y * w).sum()


def cpu64(t):
    return mt.tensor(t.numpy().astype(np.float64), requires_grad=True)


@settings(max_examples=4, deadline=None)
@given(B=st.integers(1, 2), h=st.integers(1, 2), T=st.integers(1, 70), S=st.integers(1, 70),
       d_k=st.sampled_from([32, 64]), causal=st.booleans(), padded=st.booleans(),
       seed=st.integers(0, 2**31))
def test_fused_attention_through_F(B, h, T, S, d_k, causal, padded, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (mt.tensor(rng.standard_normal(s).astype(np.float32), device="cuda", requires_grad=True)
               for s in ((B, h, T, d_k), (B, h, S, d_k), (B, h, S, d_k)))
    lengths = rng.integers(1, S + 1, B) if padded else np.full(B, S)
    keep = np.arange(S)[None, :] < lengths[:, None]  # True = may attend
    mask = mt.tensor(keep[:, None, None, :], device="cuda") if padded else None
    w = mt.tensor(rng.standard_normal((B, h, T, d_k)).astype(np.float32), device="cuda")

    def f(q, k, v):
        return weighted_sum(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal), w)

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    if kernels.enabled():
        assert out._ctx.fn.__name__ == "FusedAttention"
    directional_check(f, [q, k, v], rtol=2e-2, seed=seed)
    # Against the composite op in float64 on the CPU, itself gradient-checked in test_attention.
    q64, k64, v64 = (cpu64(t) for t in (q, k, v))
    m64 = None if mask is None else mt.tensor(keep[:, None, None, :])
    ref = weighted_sum(F.scaled_dot_product_attention(q64, k64, v64, attn_mask=m64, is_causal=causal),
                       mt.tensor(w.numpy().astype(np.float64)))
    ref.backward()
    for got, want in zip((q, k, v), (q64, k64, v64)):
        np.testing.assert_allclose(got.grad.numpy(), want.grad.numpy(), rtol=1e-3, atol=1e-4)


@settings(max_examples=4, deadline=None)
@given(N=st.integers(1, 9), D=st.sampled_from([8, 64, 200]), affine=st.booleans(),
       seed=st.integers(0, 2**31))
def test_fused_layer_norm_through_F(N, D, affine, seed):
    rng = np.random.default_rng(seed)
    x = mt.tensor(rng.standard_normal((N, D)).astype(np.float32) * 3 + 1, device="cuda", requires_grad=True)
    params = [mt.tensor(rng.standard_normal(D).astype(np.float32), device="cuda", requires_grad=True)
              for _ in range(2)] if affine else []
    w = mt.tensor(rng.standard_normal((N, D)).astype(np.float32), device="cuda")

    def f(x, *wb):
        return weighted_sum(F.layer_norm(x, *wb), w)

    if kernels.enabled():
        assert F.layer_norm(x, *params)._ctx.fn.__name__ == "FusedLayerNorm"
    directional_check(f, [x, *params], rtol=2e-2, seed=seed)
    inputs64 = [cpu64(t) for t in (x, *params)]
    weighted_sum(F.layer_norm(*inputs64), mt.tensor(w.numpy().astype(np.float64))).backward()
    for got, want in zip((x, *params), inputs64):
        np.testing.assert_allclose(got.grad.numpy(), want.grad.numpy(), rtol=1e-3, atol=1e-4)


@settings(max_examples=4, deadline=None)
@given(N=st.integers(1, 6), V=st.sampled_from([5, 33, 1100]), seed=st.integers(0, 2**31))
def test_fused_softmax_through_F(N, V, seed):
    rng = np.random.default_rng(seed)
    x = mt.tensor(rng.standard_normal((N, V)).astype(np.float32) * 2, device="cuda", requires_grad=True)
    w = mt.tensor(rng.standard_normal((N, V)).astype(np.float32), device="cuda")
    if kernels.enabled():
        assert F.softmax(x)._ctx.fn.__name__ == "FusedSoftmax"
    directional_check(lambda x: weighted_sum(F.softmax(x), w), [x], rtol=2e-2, seed=seed)
    x64 = cpu64(x)
    weighted_sum(F.softmax(x64), mt.tensor(w.numpy().astype(np.float64))).backward()
    np.testing.assert_allclose(x.grad.numpy(), x64.grad.numpy(), rtol=1e-3, atol=1e-5)


@settings(max_examples=4, deadline=None)
@given(N=st.integers(1, 12), V=st.sampled_from([7, 1100]), eps=st.sampled_from([0.0, 0.1]),
       reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**31))
def test_fused_cross_entropy_through_F(N, V, eps, reduction, seed):
    rng = np.random.default_rng(seed)
    z = mt.tensor(rng.standard_normal((N, V)).astype(np.float32) * 2, device="cuda", requires_grad=True)
    t = rng.integers(0, V, N)
    t[rng.random(N) < 0.3] = PAD  # ignored positions
    target = mt.tensor(t, device="cuda")

    def f(z):
        return F.cross_entropy(z, target, eps, PAD, reduction)

    if kernels.enabled():
        assert f(z)._ctx.fn.__name__ == "FusedCrossEntropy"
    directional_check(f, [z], rtol=2e-2, seed=seed)
    z64 = cpu64(z)
    F.cross_entropy(z64, mt.tensor(t), eps, PAD, reduction).backward()
    np.testing.assert_allclose(z.grad.numpy(), z64.grad.numpy(), rtol=1e-3, atol=1e-6)
