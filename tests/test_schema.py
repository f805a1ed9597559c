"""Every loader checks what its constructor checks, and is all-or-nothing.

One rule for every ``state_dict`` the package loads (model, optimiser, schedule, loss scaler,
early stopping, divergence detector, data iterator): a state with any one field made invalid,
or a key missing or added, is refused in one line, and the object is left exactly as it was
(a half-loaded model trains on a mix of two).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minitransformer as mt
from minitransformer import data, nn
from minitransformer.amp import GradScaler
from minitransformer.optim import Adam, WarmupInverseSqrtSchedule
from minitransformer.train import DivergenceDetector, EarlyStopping

NOT_NUMBERS = st.sampled_from([None, True, "1", [1.0], {}])


def bad_int(low: int):
    """What an integer field >= ``low`` refuses: smaller integers, floats (even 3.0), others."""
    return st.one_of(st.integers(max_value=low - 1), st.floats(), NOT_NUMBERS)


def bad_number(low=-math.inf, high=math.inf, open_low=False, open_high=False, none_ok=False):
    """What a finite number field in the interval refuses: numbers outside it, nan, infinities."""
    def outside(v):
        return not (math.isfinite(v) and (low < v or v == low and not open_low) and (v < high or v == high and not open_high))
    others = NOT_NUMBERS.filter(lambda v: v is not None) if none_ok else NOT_NUMBERS
    return st.one_of(st.floats().filter(outside), st.integers(-3, 3).filter(outside), others)


def bad_array(shape, dtype=np.float32, finite=False, nonnegative=False):
    """What an array field of ``shape`` refuses: other shapes, no numbers, values beyond the
    dtype (and non-finite or negative ones where the field must not hold them)."""
    bad = [np.zeros(shape + (1,), dtype), np.zeros((), dtype), np.full(shape, "x"),
           np.full(shape, None, object), np.full(shape, 1 + 1j), np.full(shape, 1e39), None, "weights"]
    if finite:
        bad += [np.full(shape, np.nan, dtype), np.full(shape, -np.inf, dtype)]
    if nonnegative:
        bad.append(np.full(shape, -1.0, dtype))
    return st.sampled_from(bad)


def model():
    mt.manual_seed(0)
    cfg = nn.TransformerConfig(vocab_size=12, d_model=8, d_ff=16, h=2, num_encoder_layers=1, num_decoder_layers=1)
    return nn.Transformer(cfg)


def adam():
    params = [mt.zeros(2, 3, requires_grad=True), mt.zeros(4, requires_grad=True)]
    return Adam(params, lr=0.1), params


def loaders():
    """name -> (a fresh object, a valid state of another of its kind, {field: invalid values})."""
    m = model()
    other = model()
    for p in other.parameters():
        p.data = p.data + 1.0
    fields = {k: bad_array(v.shape) for k, v in m.state_dict().items()}
    out = {"model": (m, other.state_dict(), fields)}

    opt, params = adam()
    trained, tparams = adam()
    for p in tparams:
        p.grad = mt.ones(*p.shape)
    trained.step()
    moments = {name: st.one_of(*(bad_array(p.shape, finite=True, nonnegative=name == "v").map(lambda a, i=i: (i, a))
                                 for i, p in enumerate(params)))  # (which parameter, its bad moment)
               for name in ("m", "v")}
    out["optimizer"] = (opt, trained.state_dict(), {
        "lr": bad_number(0), "eps": bad_number(0, open_low=True), "weight_decay": bad_number(0),
        "betas": st.one_of(NOT_NUMBERS, st.lists(st.floats(0, 0.9), max_size=4).filter(lambda b: len(b) != 2),
                           st.tuples(bad_number(0, 1, open_high=True), st.just(0.9)),
                           st.tuples(st.just(0.9), bad_number(0, 1, open_high=True))),
        "step_count": bad_int(0),
        "m": st.one_of(moments["m"], NOT_NUMBERS, st.just([None])),
        "v": st.one_of(moments["v"], NOT_NUMBERS, st.just([None, None])),  # v without m
    })

    schedule = WarmupInverseSqrtSchedule(adam()[0], d_model=8, warmup=10)
    ahead = WarmupInverseSqrtSchedule(adam()[0], d_model=16, warmup=20, factor=2.0)
    ahead.step()
    out["schedule"] = (schedule, ahead.state_dict(), {
        "step_count": bad_int(0), "d_model": bad_int(1), "warmup": bad_int(1),
        "factor": bad_number(0, open_low=True)})

    grown = GradScaler(init_scale=8.0, growth_interval=5)
    grown.update(False)
    out["scaler"] = (GradScaler(), grown.state_dict(), {
        "enabled": st.sampled_from([1, 0, None, "yes"]), "scale": bad_number(0, open_low=True),
        "good_steps": bad_int(0), "growth_factor": bad_number(1, open_low=True),
        "backoff_factor": bad_number(0, 1, open_low=True, open_high=True), "growth_interval": bad_int(1)})

    stopped = EarlyStopping(3)
    for step, loss in enumerate([5.0, 4.0, 4.5], 1):
        stopped.update(step, loss)
    out["early stopping"] = (EarlyStopping(3), stopped.state_dict(), {
        "best": bad_number(none_ok=True), "best_step": bad_int(0), "bad": bad_int(0)})

    detector = DivergenceDetector(100, patience=5, runaway=3)
    for step, loss in enumerate([4.0, 3.0, 9.0, 12.0], 1):
        detector.update(step, loss)
    out["divergence detector"] = (DivergenceDetector(100, patience=5, runaway=3), detector.state_dict(), {
        "smoothed": bad_number(), "best": bad_number(),  # None for one of two numbers: refused too
        "best_step": bad_int(0), "last_step": bad_int(0),
        "far_since": bad_int(0).filter(lambda v: v is not None),
        "runaway_since": bad_int(0).filter(lambda v: v is not None)})

    def batcher():
        pairs = [[4 + i % 5] * (1 + i % 4) for i in range(40)]
        return data.TokenBatcher(pairs, pairs, max_tokens=16, seed=3)

    moved = batcher()
    moved.position = (2, 1)
    # Settings the batches depend on: a state that differs (True is 1 to Python) is another run's.
    settings_ = {k: st.one_of(NOT_NUMBERS, st.integers(0, 100)).filter(lambda v, k=k: v != moved.state_dict()[k])
                 for k in ("seed", "world_size", "num_pairs", "max_tokens", "max_len", "batching")}
    out["data iterator"] = (batcher(), moved.state_dict(), {"epoch": bad_int(0), "step": bad_int(0), **settings_})
    return out


LOADERS = ("model", "optimizer", "schedule", "scaler", "early stopping", "divergence detector", "data iterator")
built = functools.cache(loaders)  # one set for all the examples: a refused load leaves each as it was


def snapshot(obj):
    """Everything a loader may change: the state, and the parameters' versions."""
    versions = [p._version for p in obj.parameters()] if isinstance(obj, nn.Module) else None
    return obj.state_dict(), versions


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    return type(a) is type(b) and (a == b or a != a and b != b)


def test_every_loader_takes_a_state_dict_of_its_kind():
    assert list(built()) == list(LOADERS)
    for obj, state, _ in loaders().values():
        obj.load_state_dict(state)
        assert same(obj.state_dict(), state)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_loader_refuses_an_invalid_field_in_one_line_and_changes_nothing(draw):
    name = draw.draw(st.sampled_from(LOADERS), label="loader")
    obj, valid, fields = built()[name]
    state = dict(valid)
    change = draw.draw(st.sampled_from([*fields, "missing key", "extra key"]), label="field")
    if change == "missing key":
        del state[draw.draw(st.sampled_from(list(state)))]
    elif change == "extra key":
        state["unexpected"] = 0
    else:
        value = draw.draw(fields[change], label="value")
        if name == "optimizer" and change in ("m", "v") and isinstance(value, tuple):
            i, array = value  # one parameter's moment replaced
            value = list(state[change])
            value[i] = array
        state[change] = value
    before = snapshot(obj)
    with pytest.raises((ValueError, TypeError, KeyError)) as e:
        obj.load_state_dict(state)
    assert "\n" not in str(e.value)
    after = snapshot(obj)
    assert same(after[0], before[0]) and after[1] == before[1]
