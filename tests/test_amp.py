"""Mixed precision: 16-bit ops keep their dtype and accumulate in float32, autocast swaps the
master weights in and out, the loss scaler backs off and grows, and a float16 or bfloat16
training step tracks the float32 one."""

import math

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import backend, nn
from minitransformer import functional as F
from minitransformer.amp import GradScaler, autocast
from minitransformer.checkpoint import load_checkpoint, restore, save_checkpoint
from minitransformer.optim import Adam, WarmupInverseSqrtSchedule
from minitransformer.train import accumulated_step

LOW = ["float16", "bfloat16"]
# Unit roundoff of each format: a correctly rounded result is within this relative error.
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
CFG = dict(vocab_size=17, d_model=16, d_ff=32, h=2, num_encoder_layers=1, num_decoder_layers=1)


def low(x64, dtype, device="cpu", requires_grad=False):
    return mt.tensor(x64, dtype=dtype, device=device, requires_grad=requires_grad)


def f64(t):
    return t.numpy().astype(np.float64)


# --------------------------------------------------------------------------- 16-bit ops


@pytest.mark.parametrize("dtype", LOW)
def test_ops_keep_the_16_bit_dtype(device, dtype):
    rng = np.random.default_rng(1)
    x = low(rng.standard_normal((2, 3, 8)), dtype, device, requires_grad=True)
    w = low(rng.standard_normal((8, 8)), dtype, device, requires_grad=True)
    g, b = (low(rng.standard_normal(8), dtype, device, requires_grad=True) for _ in range(2))
    outs = {
        "x * 0.5": x * 0.5, "2.0 + x": 2.0 + x, "x / 3": x / 3, "x ** 2": x**2,
        "linear": F.linear(x, w, b), "matmul": x @ w, "softmax": F.softmax(x),
        "log_softmax": F.log_softmax(x), "layer_norm": F.layer_norm(x, g, b),
        "attention": F.scaled_dot_product_attention(x, x, x, is_causal=True),
        "sum": x.sum(axis=-1), "mean": x.mean(axis=-1), "dropout": F.dropout(x, 0.5),
    }
    for name, out in outs.items():
        assert out.dtype == x.dtype, f"{name} returned {out.dtype} for {dtype} inputs"
        out.sum().backward()
    for t in (x, w, g, b):
        assert t.grad.dtype == t.dtype


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_long_sums_accumulate_in_float32(device, dtype, reduce):
    x = np.random.default_rng(2).uniform(0.05, 0.15, 20000)
    out = getattr(F, reduce)(low(x, dtype, device))
    ref = getattr(f64(low(x, dtype)), reduce)()  # the exact result on the 16-bit inputs
    assert abs(out.item() - ref) <= UNIT[dtype] * abs(ref) * 1.01  # one rounding, at the end


@pytest.mark.parametrize("dtype", LOW)
def test_backward_row_sums_accumulate_in_float32(device, dtype):
    """Backward passes sum long rows too: softmax's sum(g * y), log-softmax's sum(g), the
    embedding's sum over a frequent token's uses, layer norm's dweight and dbias. Each
    gradient is its float64 value on the same 16-bit inputs, rounded a few times."""
    rng = np.random.default_rng(7)
    n = 8192
    # Upstream gradients as loss scaling makes them: softmax's dx stays clear of float16's subnormals.
    g = low(rng.uniform(50, 150, (2, n)), dtype, device)
    gd = f64(g)
    for fn in (F.softmax, F.log_softmax):
        x = low(rng.standard_normal((2, n)), dtype, device, requires_grad=True)
        out = fn(x)
        out.backward(g)
        y = f64(out) if fn is F.softmax else np.exp(f64(out))
        if fn is F.softmax:
            s = (gd * y).sum(-1, keepdims=True)
            ref, size = y * (gd - s), y * (gd + np.abs(s))
        else:
            s = gd.sum(-1, keepdims=True)
            ref, size = gd - y * s, gd + y * s
        assert (np.abs(f64(x.grad) - ref) <= 4 * UNIT[dtype] * size).all(), fn.__name__

    w = low(rng.standard_normal((3, 4)), dtype, device, requires_grad=True)
    ge = low(rng.uniform(0.05, 0.15, (n, 4)), dtype, device)
    F.embedding(mt.tensor(np.zeros(n, dtype=np.int64), device=device), w).backward(ge)  # one token, n times
    ref = f64(ge).sum(0)
    assert (np.abs(f64(w.grad)[0] - ref) <= 2 * UNIT[dtype] * ref).all()

    x = low(rng.standard_normal((n, 8)) + 30.0, dtype, device)
    wl, bl = (low(a, dtype, device, requires_grad=True) for a in (rng.uniform(0.5, 1.5, 8), rng.standard_normal(8)))
    gl = low(rng.uniform(0.05, 0.15, (n, 8)), dtype, device)
    F.layer_norm(x, wl, bl).backward(gl)
    xd, gld = f64(x), f64(gl)
    xhat = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-5)
    assert (np.abs(f64(bl.grad) - gld.sum(0)) <= 2 * UNIT[dtype] * gld.sum(0)).all()
    assert (np.abs(f64(wl.grad) - (gld * xhat).sum(0)) <= 4 * UNIT[dtype] * (gld * np.abs(xhat)).sum(0)).all()


def test_float16_attention_scores_do_not_overflow_before_scaling(device):
    """q . k = 64 * 40 * 40 = 102400 is past float16's 65504; the scaled score, 12800, is not.
    Equal scores: the weights are uniform, and the output is the mean of the (random) values."""
    q = low(np.full((1, 2, 64), 40.0), "float16", device)
    v = low(np.random.default_rng(5).standard_normal((1, 2, 64)), "float16", device)
    out = F.scaled_dot_product_attention(q, q, v)
    expected = f64(v).mean(-2, keepdims=True).repeat(2, axis=-2)
    np.testing.assert_allclose(f64(out), expected, rtol=2 * UNIT["float16"], atol=2 * UNIT["float16"])


@pytest.mark.parametrize("dtype", LOW)
def test_layer_norm_softmax_and_attention_are_rounded_float32_results(device, dtype):
    """Computed in float32 and rounded once: error against float64 on the same 16-bit inputs
    is a few units of roundoff, even for rows with a large mean (fatal in 16-bit sums)."""
    rng = np.random.default_rng(3)
    x = low(rng.standard_normal((4, 64)) + 30.0, dtype, device)
    g, b = low(rng.uniform(0.5, 1.5, 64), dtype, device), low(rng.standard_normal(64), dtype, device)
    xd, gd, bd = f64(x), f64(g), f64(b)
    ref = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-5) * gd + bd
    err = np.abs(f64(F.layer_norm(x, g, b)) - ref)
    assert (err <= 4 * UNIT[dtype] * (np.abs(ref) + 1)).all()

    s = low(rng.standard_normal((4, 300)) * 3, dtype, device)
    sd = f64(s)
    ref = np.exp(sd - sd.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    assert (np.abs(f64(F.softmax(s)) - ref) <= 2 * UNIT[dtype] * ref + 1e-7).all()

    q, k, v = (low(rng.standard_normal((2, 2, 24, 16)), dtype, device) for _ in range(3))
    qd, kd, vd = f64(q), f64(k), f64(v)
    p = np.exp(qd @ kd.swapaxes(-1, -2) / 4.0)
    ref = (p / p.sum(-1, keepdims=True)) @ vd
    # P is rounded to 16 bits before P V, as on tensor cores: a few units of roundoff.
    err = np.abs(f64(F.scaled_dot_product_attention(q, k, v)) - ref)
    assert err.max() <= 8 * UNIT[dtype] * np.abs(vd).max()


def test_bfloat16_tensors_can_require_grad_and_be_drawn():
    t = mt.randn(3, 4, dtype=mt.bfloat16, requires_grad=True)
    assert t.dtype == mt.bfloat16 and np.isfinite(f64(t)).all() and f64(t).std() > 0
    assert mt.rand(5, dtype="bfloat16").dtype == mt.bfloat16
    assert mt.randn(2, dtype=mt.float16).dtype == mt.float16


# --------------------------------------------------------------------------- autocast


def model_and_batch(device="cpu", dropout=0.0):
    mt.manual_seed(0)
    model = nn.Transformer(nn.TransformerConfig(**CFG, dropout=dropout)).to(device)
    rng = np.random.default_rng(0)
    src = rng.integers(4, 17, (4, 6))
    tgt = rng.integers(4, 17, (4, 7))
    tgt[:, 0] = 2
    tgt[0, -2:] = 0
    xp = backend.get_array_module(device)
    return model, (xp.asarray(src), xp.asarray(tgt[:, :-1]), xp.asarray(tgt[:, 1:]))


@pytest.mark.parametrize("dtype", LOW)
def test_autocast_swaps_in_16_bit_copies_and_restores_the_masters(device, dtype):
    model, (src, tgt_in, _) = model_and_batch(device)
    masters = {name: p.data for name, p in model.named_parameters()}
    with autocast(model, dtype):
        with autocast(model, dtype):  # nested: a no-op
            logits = model(src, tgt_in)
        assert all(p.dtype == backend.resolve_dtype(dtype) for p in model.parameters())
    assert logits.dtype == backend.resolve_dtype(dtype)
    # The same float32 arrays are back (the optimiser's moments and DDP hold on to them).
    assert all(p.data is masters[name] for name, p in model.named_parameters())
    with pytest.raises(RuntimeError, match="boom"):
        with autocast(model, dtype):
            raise RuntimeError("boom")
    assert all(p.data is masters[name] for name, p in model.named_parameters())


@pytest.mark.parametrize("dtype", LOW)
def test_gradients_reach_the_masters_in_float32_and_match_float32_training(device, dtype):
    model, (src, tgt_in, tgt_out) = model_and_batch(device)
    F.cross_entropy(model(src, tgt_in), tgt_out, 0.1, 0).backward()
    ref = {n: f64(p.grad) for n, p in model.named_parameters()}
    model.zero_grad()
    with autocast(model, dtype):
        loss = F.cross_entropy(model(src, tgt_in), tgt_out, 0.1, 0)
    assert loss.dtype == np.float32  # the loss itself is computed in float32
    loss.backward()
    total = np.sqrt(sum(np.sum(g**2) for g in ref.values()))
    for name, p in model.named_parameters():
        assert p.grad.dtype == np.float32, name
        # A 16-bit forward perturbs each gradient by some units of roundoff times the depth of
        # the graph. The floor covers gradients that are 0 in exact arithmetic (k_proj.bias:
        # softmax ignores a constant added to a row of scores) and so only hold rounding noise.
        err = np.linalg.norm(f64(p.grad) - ref[name])
        assert err < 25 * UNIT[dtype] * max(np.linalg.norm(ref[name]), 1e-2 * total), (name, err)


def test_autocast_refuses_a_wide_dtype_and_a_nested_other_dtype():
    model, _ = model_and_batch()
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        autocast(model, mt.float32)
    with pytest.raises(RuntimeError, match="inside autocast"):
        with autocast(model, "float16"), autocast(model, "bfloat16"):
            pass
    assert all(p.dtype == np.float32 for p in model.parameters())
    with autocast(model, None):  # float32 training: the block changes nothing
        assert all(p.dtype == np.float32 for p in model.parameters())
    with autocast(model, "float16"), autocast(model, None):
        assert all(p.dtype == np.float16 for p in model.parameters())


def test_autocast_reentered_restores_only_on_the_outer_exit():
    model, _ = model_and_batch()
    block = autocast(model, "float16")
    with block:
        with block:
            pass
        assert all(p.dtype == np.float16 for p in model.parameters())
    assert all(p.dtype == np.float32 for p in model.parameters())


def test_autocast_that_fails_halfway_leaves_the_masters(monkeypatch):
    model, _ = model_and_batch()
    params = list(model.parameters())
    calls = []

    def cast(a, dtype):  # the third cast runs out of memory
        calls.append(a)
        if len(calls) == 3:
            raise MemoryError("out of memory")
        return a.view(np.ndarray).astype(dtype)

    class Flaky(np.ndarray):
        def astype(self, dtype, **kw):
            return cast(self, dtype)

    masters = [p.data for p in params]
    for p in params:
        p.data = p.data.view(Flaky)
    with pytest.raises(MemoryError):
        with autocast(model, "float16"):
            pass
    assert all(p.dtype == np.float32 for p in params)
    with autocast(model, "float16"):  # and the model is not left marked as autocast
        assert all(p.dtype == np.float16 for p in params)
    for p, m in zip(params, masters):
        p.data = m


def test_backward_inside_autocast_leaves_float32_gradients():
    model, (src, tgt_in, tgt_out) = model_and_batch()
    with autocast(model, "float16"):
        F.cross_entropy(model(src, tgt_in), tgt_out, 0.1, 0).backward()
    assert all(p.grad.dtype == np.float32 for p in model.parameters())


# --------------------------------------------------------------------------- GradScaler


def test_scaler_backs_off_on_overflow_and_grows_after_good_steps():
    s = GradScaler(init_scale=1024.0, growth_interval=3)
    s.update(found_inf=True)
    assert s.scale_value == 512.0 and s.good_steps == 0
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale_value == 512.0
    s.update(found_inf=False)
    assert s.scale_value == 1024.0 and s.good_steps == 0
    s.update(False)
    s.update(True)  # an overflow also restarts the run of good steps
    assert s.scale_value == 512.0 and s.good_steps == 0

    loss = mt.tensor(3.0, requires_grad=True)
    assert s.scale(loss).item() == 3.0 * 512.0
    p = mt.tensor([1.0, 2.0], requires_grad=True)
    s.scale(p.sum()).backward()
    s.unscale_([p])
    np.testing.assert_array_equal(p.grad.numpy(), [1.0, 1.0])

    t = GradScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    off = GradScaler(enabled=False)
    off.update(True)
    assert off.scale_value == 1.0 and off.scale(loss) is loss


def test_scaler_gives_up_on_gradients_that_overflow_at_any_scale_and_resumes_only_when_on():
    s = GradScaler(init_scale=2.0**-20)
    for _ in range(4):
        s.update(found_inf=True)
    with pytest.raises(FloatingPointError, match="not finite at any scale"):
        s.update(found_inf=True)
    off = GradScaler(enabled=False)
    off.load_state_dict(GradScaler(init_scale=8.0).state_dict())  # e.g. resumed in bfloat16
    assert off.scale_value == 1.0 and not off.enabled


def setup_training(device="cpu"):
    model, _ = model_and_batch(device, dropout=0.1)
    opt = Adam(model.parameters())
    return model, opt, WarmupInverseSqrtSchedule(opt, 16, warmup=10, factor=1.0)


def batches(n, device="cpu"):
    rng = np.random.default_rng(5)
    xp = backend.get_array_module(device)
    out = []
    for _ in range(n):
        src, tgt = rng.integers(4, 17, (4, 6)), rng.integers(4, 17, (4, 7))
        tgt[:, 0] = 2
        out.append((xp.asarray(src), xp.asarray(tgt[:, :-1]), xp.asarray(tgt[:, 1:])))
    return out


def test_an_overflowing_float16_step_is_skipped_and_lowers_the_scale(device):
    model, opt, sched = setup_training(device)
    before = model.state_dict()
    scaler = GradScaler(init_scale=2.0**40)  # 2^40 times any gradient overflows float16
    r = accumulated_step(model, opt, sched, batches(1, device), amp_dtype=mt.float16, scaler=scaler)
    assert r.skipped == "non-finite gradient" and math.isfinite(r.loss)
    assert scaler.scale_value == 2.0**39 and opt.step_count == 0
    assert all(np.array_equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("dtype", LOW)
def test_mixed_precision_training_tracks_float32(device, dtype):
    data = batches(6, device)
    curves = {}
    for name, amp_dtype in (("fp32", None), ("amp", dtype)):
        model, opt, sched = setup_training(device)
        scaler = GradScaler(growth_interval=2) if dtype == "float16" and amp_dtype else None
        curves[name] = [accumulated_step(model, opt, sched, [b], amp_dtype=amp_dtype, scaler=scaler)
                        for b in data]
        assert all(p.dtype == np.float32 for p in model.parameters())
    for a, b in zip(curves["fp32"], curves["amp"]):
        assert b.skipped is None
        assert abs(a.loss - b.loss) < 20 * UNIT[dtype] * a.loss, (a.loss, b.loss)
        # Adam is blind to a constant factor on the gradients: the norm shows a missed unscale_.
        assert abs(a.grad_norm - b.grad_norm) < 20 * UNIT[dtype] * a.grad_norm, (a.grad_norm, b.grad_norm)


def test_float16_training_resumes_exactly_with_its_loss_scale(tmp_path):
    data = batches(8)
    model, opt, sched = setup_training()
    scaler = GradScaler(growth_interval=3)
    run = lambda m, o, s, sc, bs: [accumulated_step(m, o, s, [b], amp_dtype=mt.float16, scaler=sc).loss  # noqa: E731
                                   for b in bs]
    run(model, opt, sched, scaler, data[:4])
    path = str(tmp_path / "last.npz")
    save_checkpoint(path, model, opt, sched, scaler=scaler)
    assert load_checkpoint(path).model["src_embed.weight"].dtype == np.float32  # the masters
    uninterrupted = run(model, opt, sched, scaler, data[4:])

    model2, opt2, sched2 = setup_training()
    scaler2 = GradScaler()
    restore(load_checkpoint(path), model2, opt2, sched2, scaler=scaler2)
    assert scaler2.good_steps == 4 % 3 and scaler2.scale_value == 2.0**17
    assert run(model2, opt2, sched2, scaler2, data[4:]) == uninterrupted


def test_data_parallel_float16_steps_reduce_float32_gradients(device):
    """Under DDP (world size 1 here) the gradients that reach the buckets are the float32 ones,
    scaled, and after the reduction they equal the plain step's. (DDP backpropagates the summed
    loss, whose gradients are n_tokens times the mean's: a small scale keeps both free of
    overflow, so neither step is skipped.)"""
    from minitransformer import distributed as dist

    batch = batches(1, device)[0]
    grads = {}
    for mode in ("plain", "ddp"):
        model, opt, sched = setup_training(device)
        ddp = None
        if mode == "ddp":
            world = dist.World(rank=0, world_size=1, local_rank=0, device=device,
                               comm=dist.LocalCommunicator(device))
            ddp = dist.DistributedDataParallel(model, world)
            assert [f.dtype for f in ddp.flats] == [np.float32]
        r = accumulated_step(model, opt, sched, [batch], ddp=ddp, amp_dtype=mt.float16,
                             scaler=GradScaler(init_scale=16.0))
        assert r.skipped is None
        grads[mode] = {n: f64(p.grad) for n, p in model.named_parameters()}  # unscaled, reduced
    total = np.sqrt(sum(np.sum(g**2) for g in grads["plain"].values()))
    for name, g in grads["plain"].items():
        # float16 rounds the summed and the mean loss's gradients differently: a few units.
        assert np.linalg.norm(grads["ddp"][name] - g) < 25 * UNIT["float16"] * max(np.linalg.norm(g), 1e-2 * total)


@pytest.mark.parametrize("dtype", LOW)
def test_module_to_dtype_casts_in_place_for_16_bit_inference(device, dtype):
    model, (src, tgt_in, _) = model_and_batch(device)
    model.eval()
    ref = f64(model(src, tgt_in))
    params = list(model.parameters())
    assert model.to(dtype) is model
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # the same Parameters
    assert all(p.dtype == backend.resolve_dtype(dtype) for p in params)
    out = model(src, tgt_in)
    assert out.dtype == backend.resolve_dtype(dtype)
    assert np.abs(f64(out) - ref).max() < 50 * UNIT[dtype] * np.abs(ref).max()
    with pytest.raises(TypeError, match="floating-point"):
        model.to(np.int32)


def test_precision_names_map_to_dtypes_and_only_float16_gets_a_scaler():
    from minitransformer.amp import PRECISIONS, scaler_for

    assert PRECISIONS == {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
    assert isinstance(scaler_for(PRECISIONS["fp16"]), GradScaler)
    assert scaler_for(PRECISIONS["bf16"]) is None and scaler_for(PRECISIONS["fp32"]) is None
