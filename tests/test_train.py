import pathlib

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import backend, nn
from minitransformer.distributed.grad_hooks import register_post_accumulate_grad_hook
from minitransformer.optim import Adam, WarmupInverseSqrtSchedule
from minitransformer.train import EarlyStopping, accumulated_step, evaluate_loss, train_step
from tests.helpers import micro_batches, union

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = dict(vocab_size=17, d_model=16, d_ff=32, h=2, num_encoder_layers=1, num_decoder_layers=1)


def setup():
    mt.manual_seed(0)
    model = nn.Transformer(nn.TransformerConfig(**CFG))
    opt = Adam(model.parameters())
    return model, opt, WarmupInverseSqrtSchedule(opt, 16, warmup=10)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(4, 17, (4, 6))
    tgt = rng.integers(4, 17, (4, 7))
    tgt[:, 0] = 2
    tgt[0, -2:] = 0  # padding is not counted
    return src, tgt[:, :-1], tgt[:, 1:]


def test_step_reports_loss_perplexity_and_tokens():
    model, opt, sched = setup()
    r = train_step(model, opt, sched, batch())
    assert r.skipped is None and r.num_tokens == 4 * 6 - 2
    assert r.loss > r.nll > 0 and np.isclose(r.ppl, np.exp(r.nll))
    assert sched.step_count == 1 and opt.step_count == 1


@pytest.mark.parametrize("clip_norm", [None, 0.5])
def test_the_plain_step_is_the_robust_step_of_one_batch(clip_norm):
    """train_step, the textbook step, and accumulated_step of one micro-batch without ddp or
    mixed precision do the same arithmetic: two steps of each (dropout on, the same masks from
    the same seed) report the same loss, NLL, norm and rate, and leave the same weights, Adam
    moments and schedule, to float32 rounding."""
    runs = []
    for step in (lambda m, o, s, b: train_step(m, o, s, b, clip_norm=clip_norm),
                 lambda m, o, s, b: accumulated_step(m, o, s, [b], clip_norm=clip_norm)):
        model, opt, sched = setup()
        results = [step(model, opt, sched, batch(i)) for i in range(2)]
        runs.append((results, model.state_dict(), opt.state_dict(), sched.state_dict()))
    (plain, weights, adam, schedule), (robust, weights_r, adam_r, schedule_r) = runs
    assert schedule == schedule_r and schedule["step_count"] == 2 and adam["step_count"] == adam_r["step_count"] == 2
    for p, r in zip(plain, robust):
        assert p.skipped is None and r.skipped is None and p.num_tokens == r.num_tokens
        np.testing.assert_allclose([p.loss, p.nll, p.grad_norm, p.lr], [r.loss, r.nll, r.grad_norm, r.lr], rtol=1e-6)
    if clip_norm is not None:
        assert all(r.grad_norm > clip_norm for r in plain)  # so clipping did happen
    assert weights.keys() == weights_r.keys()
    for k in weights:
        np.testing.assert_allclose(weights[k], weights_r[k], rtol=1e-6, atol=1e-7, err_msg=k)
    for m, m_r in zip(adam["m"] + adam["v"], adam_r["m"] + adam_r["v"]):
        np.testing.assert_allclose(m, m_r, rtol=1e-5, atol=1e-12)


def test_clip_norm_scales_the_gradients_adam_steps_on():
    """With clip_norm below the gradients' global norm, Adam steps on the same gradients scaled
    down to that norm, and the step reports the norm before clipping; above it, they are left
    as they are."""
    seen, reported = {}, {}
    for clip_norm in (None, 0.05, 1e6):
        model, opt, sched = setup()
        adam_step = opt.step

        def spy(clip_norm=clip_norm, opt=opt, adam_step=adam_step):
            seen[clip_norm] = [p.grad.numpy().astype(np.float64) for p in opt.params]
            adam_step()

        opt.step = spy
        reported[clip_norm] = train_step(model, opt, sched, batch(), clip_norm=clip_norm).grad_norm
    norm = np.sqrt(sum((g * g).sum() for g in seen[None]))
    assert norm > 0.05
    np.testing.assert_allclose([reported[None], reported[0.05], reported[1e6]], norm, rtol=1e-5)
    np.testing.assert_allclose(np.sqrt(sum((g * g).sum() for g in seen[0.05])), 0.05, rtol=1e-5)
    for g, clipped, kept in zip(seen[None], seen[0.05], seen[1e6]):
        np.testing.assert_allclose(clipped, g * (0.05 / norm), rtol=1e-5, atol=1e-12)
        np.testing.assert_array_equal(kept, g)


def test_non_finite_loss_is_caught_not_trained_on():
    model, opt, sched = setup()
    model.src_embed.weight.data[5] = np.nan
    before = model.state_dict()
    r = accumulated_step(model, opt, sched, [batch()])
    assert r.skipped == "non-finite loss"
    after = model.state_dict()
    assert all(np.array_equal(before[k], after[k], equal_nan=True) for k in before)
    assert opt.step_count == 0 and sched.step_count == 0


def test_non_finite_gradient_skips_the_step():
    model, opt, sched = setup()
    w = model.encoder.layers[0].ffn.w_1.weight
    register_post_accumulate_grad_hook(w, lambda t: t.grad.data.__setitem__((0, 0), np.inf))
    before = model.state_dict()
    r = accumulated_step(model, opt, sched, [batch()])
    assert r.skipped == "non-finite gradient"
    assert all(np.array_equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_loss_falls_and_evaluation_is_deterministic():
    model, opt, sched = setup()
    data = [batch(i % 3) for i in range(150)]
    first = evaluate_loss(model, data[:3])
    for b in data:
        train_step(model, opt, sched, b, label_smoothing=0.0)
    last = evaluate_loss(model, data[:3])
    # Over six dropout seeds the loss ends at 0.32-0.63 of where it started: a model that
    # does not learn stays near 1.
    assert last[0] < 0.7 * first[0]
    assert evaluate_loss(model, data[:3]) == last


def test_batch_size_mismatch_names_the_shapes():
    model, opt, sched = setup()
    src, tgt_in, tgt_out = batch()
    with pytest.raises(ValueError, match=r"src \(3, 6\), tgt_in \(4, 6\)"):
        train_step(model, opt, sched, (src[:3], tgt_in, tgt_out))
    with pytest.raises(ValueError, match=r"src \(3, 6\), tgt_in \(4, 6\)"):
        accumulated_step(model, opt, sched, [(src[:3], tgt_in, tgt_out)])


def test_an_update_that_would_overflow_the_weights_is_skipped():
    model, opt, sched = setup()
    before = [p.data.copy() for p in opt.params]
    sched.factor = 1e45  # lr * C_t above float32's largest
    r = accumulated_step(model, opt, sched, [batch()])
    assert r.skipped == "an update that would overflow the weights"
    assert all(np.array_equal(p.data, b) for p, b in zip(opt.params, before))
    assert sched.step_count == 0 and opt.step_count == 0  # a skipped step moves neither


def test_format_ppl_reads_at_every_scale():
    from minitransformer.train import format_ppl, perplexity

    assert format_ppl(5.4912) == "5.49" and format_ppl(3.7e7) == "3.7e+07"
    assert format_ppl(perplexity(1e9)) == ">1e304" and format_ppl(float("inf")) == ">1e304"
    assert format_ppl(float("nan")) == "nan" and np.isnan(perplexity(float("nan")))


def replay(losses, vocab_size=8000, **kwargs):
    """(step, reason) of the first divergence the detector finds in [(step, loss)], or None."""
    from minitransformer.train import DivergenceDetector

    detector = DivergenceDetector(vocab_size, **kwargs)
    for step, loss in losses:
        why = detector.update(step, loss)
        if why:
            return step, why
    return None


def healthy(rng, steps=3000, every=1):
    """A training curve as the main job's: from ln V down to ~2.5, noisy, with a spike."""
    curve = []
    for step in range(1, steps + 1, every):
        loss = 2.5 + 6.5 * np.exp(-step / 400) + rng.normal(0, 0.15)
        if 1500 <= step < 1560:  # a loss spike that training recovers from
            loss += 1.2
        curve.append((step, loss))
    return curve


def test_the_divergence_detector_leaves_healthy_training_alone_and_stops_what_diverges():
    rng = np.random.default_rng(0)
    assert replay(healthy(rng)) is None and replay(healthy(rng, every=20)) is None  # every step, or as logged
    # --lr-factor 1e6 as a user met it: 9.4 to 3.7e7 over 150 steps, every loss finite.
    climbing = [(s, 9.4 * (3.7e7 / 9.4) ** (s / 150)) for s in range(1, 151)]
    step, why = replay(climbing)
    assert step < 60 and "grown without bound" in why
    # A collapse: the loss jumps from its best to twice as much, and stays.
    collapse = healthy(rng)[:2000] + [(s, 5.5 + rng.normal(0, 0.1)) for s in range(2001, 2600)]
    step, why = replay(collapse)
    assert 2200 <= step < 2300 and "far above its best" in why
    assert replay(collapse, patience=1000) is None  # ...but only after a sustained stretch
    # Skipped steps (non-finite losses) extend a stretch that has begun; they do not start one.
    assert replay([(s, float("nan")) for s in range(1, 500)]) is None


@pytest.mark.parametrize("log", sorted((ROOT / "tests" / "fixtures" / "train_logs").glob("*.jsonl")),
                         ids=lambda p: p.stem)
def test_the_divergence_detector_never_fires_on_real_runs(log):
    """The recorded train.jsonl of real main-job and ablation runs (their training lines, every
    20 steps), replayed through the detector: healthy training must never stop."""
    import json

    rows = [json.loads(line) for line in log.read_text().splitlines()]
    vocab = rows[0]["vocab_size"]
    curve = [(r["step"], r["loss"]) for r in rows[1:]]
    assert len(curve) > 30
    assert replay(curve, vocab_size=vocab) is None
    if curve[-1][0] >= 2000:  # long enough that its losses, played backwards, climb for good
        backwards = [(step, loss) for (step, _), (_, loss) in zip(curve, reversed(curve))]
        assert replay(backwards, vocab_size=vocab) is not None


def test_the_divergence_detector_resumes_from_its_state():
    from minitransformer.train import DivergenceDetector

    rng = np.random.default_rng(1)
    curve = healthy(rng)[:1000] + [(s, 6.0) for s in range(1001, 1400)]
    whole, split = DivergenceDetector(8000), DivergenceDetector(8000)
    verdicts = [whole.update(s, loss) for s, loss in curve]
    for s, loss in curve[:1100]:
        split.update(s, loss)
    resumed = DivergenceDetector(8000)
    resumed.load_state_dict(json_round_trip(split.state_dict()))
    assert [resumed.update(s, loss) for s, loss in curve[1100:]] == verdicts[1100:]
    assert any(verdicts)


def json_round_trip(obj):
    import json

    return json.loads(json.dumps(obj))


# --------------------------------------------------------------------------- gradient accumulation


def on_device(batches, device):
    return [tuple(mt.tensor(a, device=device) for a in b) for b in batches]


def float64_setup(device):
    """setup()'s model in float64 without dropout (so two steps see the same function), on
    ``device``, with a schedule and Adam."""
    mt.manual_seed(0)
    model = nn.Transformer(nn.TransformerConfig(**CFG, dropout=0.0))
    for p in model.parameters():
        p.data = p.data.astype(np.float64)
    model.to(device)
    opt = Adam(model.parameters())
    return model, opt, WarmupInverseSqrtSchedule(opt, 16, warmup=10)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not backend.has_cuda(), reason="no CUDA device (or MT_EMULATE_CUDA=1)"))])
def test_an_accumulated_step_is_one_step_on_the_union_batch(device):
    """The objective is the mean over the whole step's tokens: the gradients, the loss and the
    updated weights equal one step on all the micro-batches' sentences at once. One optimiser
    step and one schedule step, whatever the number of micro-batches."""
    parts = on_device(micro_batches(0), device)
    model, opt, sched = float64_setup(device)
    accumulated = accumulated_step(model, opt, sched, parts, label_smoothing=0.1)
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    weights = [p.numpy().copy() for p in model.parameters()]
    assert sched.step_count == 1 and opt.step_count == 1

    model, opt, sched = float64_setup(device)
    whole = accumulated_step(model, opt, sched, on_device([union(micro_batches(0))], device), label_smoothing=0.1)
    assert accumulated.num_tokens == whole.num_tokens == sum(int((p[2].numpy() != 0).sum()) for p in parts)
    np.testing.assert_allclose(accumulated.loss, whole.loss, rtol=1e-12)
    np.testing.assert_allclose(accumulated.nll, whole.nll, rtol=1e-12)
    for g, w, p in zip(grads, weights, model.parameters()):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-9, atol=1e-10)
        # Adam moves an element by about lr whatever its gradient's size, so an element whose
        # gradient is zero but for rounding (the key projection's bias: softmax ignores a
        # shift) goes the way the rounding points; the others move alike.
        real = np.abs(p.grad.numpy()) > 1e-8
        np.testing.assert_allclose(w[real], p.numpy()[real], rtol=1e-9, atol=1e-12)


def test_a_non_finite_micro_batch_skips_the_whole_step():
    model, opt, sched = setup()
    parts = on_device(micro_batches(0), "cpu")
    model.src_embed.weight.data[int(parts[1][0].numpy()[0, 0])] = np.nan  # a token of the second micro-batch
    before = model.state_dict()
    r = accumulated_step(model, opt, sched, parts)
    assert r.skipped == "non-finite loss"
    assert all(np.array_equal(before[k], v, equal_nan=True) for k, v in model.state_dict().items())
    assert opt.step_count == 0 and sched.step_count == 0 and all(p.grad is None for p in model.parameters())


def test_early_stopping_counts_validations_without_a_strictly_better_loss():
    stop = EarlyStopping(patience=3)
    curve = [5.0, 4.0, 4.0, 4.5, 3.9, 4.1, 4.0, 3.9]  # a tie is no improvement
    decisions = [stop.update(step, loss) for step, loss in enumerate(curve, 1)]
    assert decisions == [False] * 7 + [True]
    assert (stop.best, stop.best_step, stop.bad) == (3.9, 5, 3)
    resumed = EarlyStopping(patience=3)
    resumed.load_state_dict(EarlyStopping(3).state_dict() | {"best": 3.9, "best_step": 5, "bad": 2})
    assert resumed.update(9, 3.95) is True and resumed.state_dict() == {"best": 3.9, "best_step": 5, "bad": 3}
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(0)
