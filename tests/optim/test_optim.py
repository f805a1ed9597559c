import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minitransformer as mt
from minitransformer.optim import Adam, WarmupInverseSqrtSchedule, clip_grad_norm_, grad_norm, noam_lr, schedule_factor
from minitransformer.optim.adam import CPU_BLOCK, adam_formula


# One parameter smaller than a block, one of a block and a ragged part: the blocked update is
# the plain formula wherever the blocks are cut.
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_matches_the_plain_formula(device, weight_decay):
    rng = np.random.default_rng()
    shapes = [(3, 4), (CPU_BLOCK + 1000,)]
    p0 = [rng.standard_normal(s) for s in shapes]
    grads = [[rng.standard_normal(s) for s in shapes] for _ in range(5)]
    params = [mt.tensor(a, device=device, requires_grad=True) for a in p0]
    opt = Adam(params, lr=0.01, betas=(0.9, 0.98), eps=1e-9, weight_decay=weight_decay)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = mt.tensor(g, device=device)
        opt.step()
    for i, p in enumerate(params):
        want, m, v = p0[i], 0.0, 0.0
        for t, step in enumerate(grads, start=1):
            want, m, v = adam_formula(want, step[i], m, v, t, 0.01, (0.9, 0.98), 1e-9, weight_decay)
        # atol: an element that the steps bring near zero keeps the absolute error of the rest
        np.testing.assert_allclose(p.numpy(), want, rtol=1e-10, atol=1e-14)


def test_adam_state_dict_round_trip():
    rng = np.random.default_rng(1)
    a = mt.tensor(rng.standard_normal(5), requires_grad=True)
    b = mt.tensor(a.numpy(), requires_grad=True)
    opt_a, opt_b = Adam([a], lr=0.1), Adam([b], lr=0.5)
    a.grad = mt.tensor(rng.standard_normal(5))
    opt_a.step()
    b.data = a.data.copy()
    opt_b.load_state_dict(opt_a.state_dict())
    g = mt.tensor(rng.standard_normal(5))
    a.grad, b.grad = g, g
    opt_a.step()
    opt_b.step()
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(ValueError):  # one parameter's moments for two parameters
        Adam([a, b]).load_state_dict(opt_a.state_dict())


def test_adam_step_names_a_parameter_whose_gradient_has_another_shape():
    """A gradient that merely broadcasts (here (1, 3) for (2, 3)) would update with NumPy's
    broadcasting, or fail inside it anonymously: refused before any parameter is written."""
    a, b = mt.zeros(4, requires_grad=True), mt.zeros(2, 3, requires_grad=True)
    opt = Adam([a, b], lr=0.1)
    a.grad, b.grad = mt.ones(4), mt.ones(1, 3)
    with pytest.raises(ValueError, match="parameter 1") as e:
        opt.step()
    assert "\n" not in str(e.value)
    assert opt.step_count == 0 and a._version == 0 and not a.numpy().any() and opt.m == [None, None]


def test_schedule_is_equation_3():
    d, warmup = 512, 4000
    assert noam_lr(1, d, warmup) == pytest.approx(d**-0.5 * warmup**-1.5)
    assert noam_lr(warmup, d, warmup) == pytest.approx(d**-0.5 * warmup**-0.5)  # the peak
    assert noam_lr(4 * warmup, d, warmup) == pytest.approx(noam_lr(warmup, d, warmup) / 2)
    steps = [noam_lr(s, d, warmup) for s in range(1, 3 * warmup)]
    assert int(np.argmax(steps)) + 1 == warmup
    opt = Adam([mt.zeros(1, requires_grad=True)])
    sched = WarmupInverseSqrtSchedule(opt, d, warmup, factor=2.0)
    sched.step()
    sched.step()
    assert opt.lr == pytest.approx(2 * noam_lr(2, d, warmup))


def fairseq_inverse_sqrt(n: int, peak: float, warmup: int, warmup_init: float = 0.0) -> float:
    """fairseq's inverse_sqrt schedule at update n, as its step_update writes it: a linear ramp
    from warmup_init to peak over the warmup, then peak * warmup^0.5 * n^-0.5."""
    if n < warmup:
        return warmup_init + n * (peak - warmup_init) / warmup
    return peak * warmup**0.5 * n**-0.5


@pytest.mark.parametrize("peak, d, warmup", [(0.005, 128, 2000), (7e-4, 512, 4000), (0.1, 1, 1)])
def test_schedule_by_its_peak_is_fairseq_s_inverse_sqrt(peak, d, warmup):
    factor = schedule_factor(peak, d, warmup)
    for n in [1, 2, warmup // 2 + 1, warmup, warmup + 1, 3 * warmup, 8000, 100_000]:
        assert noam_lr(n, d, warmup, factor) == pytest.approx(fairseq_inverse_sqrt(n, peak, warmup), rel=1e-12)
    # fairseq's ramp starts at --warmup-init-lr (1e-7 by default), equation (3)'s at 0.
    for n in range(1, warmup + 1):
        assert abs(noam_lr(n, d, warmup, factor) - fairseq_inverse_sqrt(n, peak, warmup, 1e-7)) <= 1e-7


def test_clip_grad_norm():
    rng = np.random.default_rng(4)
    ga, gb = rng.standard_normal(3) * 3, rng.standard_normal(4) * 3
    a, b = mt.zeros(3, requires_grad=True), mt.zeros(4, requires_grad=True)
    a.grad, b.grad = mt.tensor(ga), mt.tensor(gb)
    total = math.sqrt((ga**2).sum() + (gb**2).sum())  # one norm over all tensors, not one each
    assert clip_grad_norm_([a, b], 1.0) == pytest.approx(total)
    np.testing.assert_allclose(a.grad.numpy(), ga / total, rtol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), gb / total, rtol=1e-6)
    a.grad = mt.tensor([np.nan, 0, 0])
    assert not math.isfinite(grad_norm([a, b]))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_grad_norm_neither_overflows_nor_loses_small_gradients(dtype):
    """The sums of squares are float32 dot products (16-bit gradients widened first), redone in
    float64 when they overflow: a float16 gradient of norm above 256, a float32 one above 1e19,
    and one of norm 1e-4 all come out right; only a truly non-finite gradient reads as one."""
    rng = np.random.default_rng()
    big = 1e3 if dtype == "float16" else 1e20
    for scale in (1e-4 / 30, 1.0, big):  # 1e-4: squares of 3e-6 are below float16's range
        g = (rng.standard_normal(1000) * scale).astype(dtype)
        p = mt.zeros(1000, requires_grad=True)
        p.grad = mt.tensor(g)
        exact = math.sqrt((g.astype(np.float64) ** 2).sum())
        assert grad_norm([p]) == pytest.approx(exact, rel=1e-5)
    g[3] = np.inf
    p.grad = mt.tensor(g)
    assert grad_norm([p]) == math.inf


@pytest.mark.parametrize("make,message", [
    (lambda p: Adam(p, lr=-1e-3), "Adam: lr must be a finite number >= 0, got -0.001"),
    (lambda p: Adam(p, lr=float("nan")), "Adam: lr must be a finite number >= 0, got nan"),
    (lambda p: Adam(p, betas=(0.9, 1.0)), r"Adam: betas\[1\] must be a number in \[0, 1\), got 1.0"),
    (lambda p: Adam(p, betas=(-0.1, 0.98)), r"Adam: betas\[0\] must be a number in \[0, 1\), got -0.1"),
    (lambda p: Adam(p, betas=(0.9,)), r"Adam: betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
    (lambda p: Adam(p, eps=0.0), "Adam: eps must be a finite number > 0, got 0.0"),
    (lambda p: Adam(p, weight_decay=-0.01), "Adam: weight_decay must be a finite number >= 0, got -0.01"),
    (lambda p: Adam([*p, mt.zeros(2, 3, requires_grad=True), p[0]]),  # PyTorch only warns
     r"Adam: parameter 2 \(shape \(1,\)\) is parameter 0 again: each parameter once, or it is updated twice a step"),
    (lambda p: clip_grad_norm_(p, float("nan")), "clip_grad_norm_: max_norm must be a finite number > 0, got nan"),
    (lambda p: clip_grad_norm_(p, 0.0), r"clip_grad_norm_: max_norm must be a finite number > 0, got 0.0"),
    (lambda p: WarmupInverseSqrtSchedule(Adam(p), 512, warmup=0),
     "WarmupInverseSqrtSchedule: warmup must be an integer >= 1, got 0"),  # was 0 ** -1.5
    (lambda p: WarmupInverseSqrtSchedule(Adam(p), 512, warmup=-10),
     "WarmupInverseSqrtSchedule: warmup must be an integer >= 1, got -10"),  # a complex lr
    (lambda p: WarmupInverseSqrtSchedule(Adam(p), 0),
     "WarmupInverseSqrtSchedule: d_model must be an integer >= 1, got 0"),
    (lambda p: WarmupInverseSqrtSchedule(Adam(p), 512, factor=0.0),
     "WarmupInverseSqrtSchedule: factor must be a finite number > 0, got 0.0"),
    (lambda p: WarmupInverseSqrtSchedule(Adam(p), 512, factor=float("inf")),
     "WarmupInverseSqrtSchedule: factor must be a finite number > 0, got inf"),
])
def test_optimizer_and_schedule_refuse_bad_settings(make, message):
    params = [mt.zeros(1, requires_grad=True)]
    Adam(params, lr=0.0, betas=(0.0, 0.0), weight_decay=0.0)  # the edges are accepted
    with pytest.raises(ValueError, match="^" + message + "$") as e:
        make(params)
    assert "\n" not in str(e.value)


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(1, 40), b1=st.floats(0.0, 0.99), b2=st.floats(0.5, 0.999), scale=st.floats(-20, 20),
       spread=st.floats(0, 8), seed=st.integers(0, 2**31 - 1))
def test_max_update_bounds_every_step_whatever_the_gradients(steps, b1, b2, scale, spread, seed):
    """|p_t - p_{t-1}| <= Adam.max_update() at every step, for gradients of any scale and sign
    pattern (eps 0, where the bound is tightest)."""
    rng = np.random.default_rng(seed)
    p = mt.tensor(rng.standard_normal(64), dtype=mt.float64, requires_grad=True)
    opt = Adam([p], lr=0.01, betas=(b1, b2), eps=1e-300)
    for _ in range(steps):
        bound = opt.max_update()
        before = p.data.copy()
        p.grad = mt.tensor(rng.standard_normal(64) * 10.0 ** (scale + rng.uniform(-spread, spread, 64)),
                           dtype=mt.float64)
        opt.step()
        assert np.abs(p.data - before).max() <= bound * (1 + 1e-9)
