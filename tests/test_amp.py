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
from minitransformer.train import train_step

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
def test_long_sums_accumulate_in_float32(device, dtype):
    x = np.random.default_rng(2).uniform(0.05, 0.15, 20000)
    out = F.sum(low(x, dtype, device))
    ref = f64(low(x, dtype)).sum()  # the exact sum of the 16-bit inputs
    assert abs(out.item() - ref) <= UNIT[dtype] * abs(ref) * 1.01  # one rounding, at the end


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


def test_autocast_refuses_a_wide_dtype():
    model, _ = model_and_batch()
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        autocast(model, mt.float32)


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
    r = train_step(model, opt, sched, *batches(1, device)[0], amp_dtype=mt.float16, scaler=scaler)
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
        curves[name] = [train_step(model, opt, sched, *b, amp_dtype=amp_dtype, scaler=scaler)
                        for b in data]
        assert all(p.dtype == np.float32 for p in model.parameters())
    for a, b in zip(curves["fp32"], curves["amp"]):
        assert b.skipped is None
        assert abs(a.loss - b.loss) < 20 * UNIT[dtype] * a.loss, (a.loss, b.loss)


def test_float16_training_resumes_exactly_with_its_loss_scale(tmp_path):
    data = batches(8)
    model, opt, sched = setup_training()
    scaler = GradScaler(growth_interval=3)
    run = lambda m, o, s, sc, bs: [train_step(m, o, s, *b, amp_dtype=mt.float16, scaler=sc).loss  # noqa: E731
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
        r = train_step(model, opt, sched, *batch, ddp=ddp, amp_dtype=mt.float16,
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
