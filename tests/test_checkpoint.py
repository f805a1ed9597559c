import json
import os

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import nn
from minitransformer.checkpoint import (
    Checkpoint, CheckpointError, average_checkpoints, load_checkpoint, restore, save_checkpoint, verify_checkpoint,
)
from minitransformer.optim import Adam, WarmupInverseSqrtSchedule
from minitransformer.train import train_step

CFG = dict(vocab_size=17, d_model=16, d_ff=32, h=2, num_encoder_layers=1, num_decoder_layers=1, dropout=0.3)


def setup(seed=0):
    mt.manual_seed(seed)
    model = nn.Transformer(nn.TransformerConfig(**CFG))
    opt = Adam(model.parameters())
    sched = WarmupInverseSqrtSchedule(opt, 16, warmup=10, factor=1.0)
    return model, opt, sched


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        src = rng.integers(4, 17, (4, 6))
        tgt = rng.integers(4, 17, (4, 6))
        tgt[:, 0] = 2
        out.append((src, tgt[:, :-1], tgt[:, 1:]))
    return out


def run(model, opt, sched, data):
    return [train_step(model, opt, sched, b).loss for b in data]


def test_resume_continues_the_loss_curve_exactly(tmp_path):
    data = batches(10)
    model, opt, sched = setup()
    run(model, opt, sched, data[:5])
    path = str(tmp_path / "step5.npz")
    save_checkpoint(path, model, opt, sched, extra={"step": 5})
    uninterrupted = run(model, opt, sched, data[5:])

    mt.manual_seed(999)  # a different process state, as after a crash
    model2, opt2, sched2 = setup(seed=123)
    ckpt = load_checkpoint(path)
    assert ckpt.extra == {"step": 5} and ckpt.config["d_model"] == 16
    restore(ckpt, model2, opt2, sched2)
    resumed = run(model2, opt2, sched2, data[5:])
    assert resumed == uninterrupted  # bit for bit: same weights, moments, schedule, dropout masks


def test_write_is_atomic(tmp_path, monkeypatch):
    model, opt, sched = setup()
    path = str(tmp_path / "last.npz")
    save_checkpoint(path, model, opt, sched)
    before = open(path, "rb").read()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, model, opt, sched)
    assert open(path, "rb").read() == before  # the last good checkpoint survives
    assert os.listdir(tmp_path) == ["last.npz"]  # and no temporary file is left behind


def test_truncated_and_foreign_files_raise_clear_errors(tmp_path):
    model, opt, sched = setup()
    path = tmp_path / "ckpt.npz"
    save_checkpoint(str(path), model, opt, sched)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated.npz.*not a readable minitransformer checkpoint"):
        load_checkpoint(str(truncated))
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello")
    with pytest.raises(CheckpointError, match="notes.txt"):
        load_checkpoint(str(foreign))
    other = tmp_path / "other.npz"
    np.savez(other, weights=np.ones(3))
    with pytest.raises(CheckpointError, match="no __meta__"):
        load_checkpoint(str(other))
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_checkpoint(str(tmp_path / "missing.npz"))


def rewritten(path, tmp_path, meta=None, arrays=None):
    """A copy of the checkpoint at ``path`` with its metadata or arrays changed, as a damaged or
    foreign file would hold them."""
    with np.load(path) as archive:
        members = {k: archive[k] for k in archive.files}
    old = json.loads(members["__meta__"].tobytes())
    members["__meta__"] = np.frombuffer((meta(old) if callable(meta) else meta).encode(), np.uint8) \
        if meta is not None else members["__meta__"]
    members.update(arrays(members) if arrays else {})
    out = tmp_path / "damaged.npz"
    np.savez(out, **members)
    return str(out)


def edit(change):
    def apply(meta):
        change(meta)
        return json.dumps(meta)
    return apply


@pytest.mark.parametrize("meta, arrays, message", [
    ("[1, 2]", None, r"is not a minitransformer checkpoint \(format 'list'\)"),
    ('{"format": NaN}', None, "its metadata: not JSON .*NaN"),
    (edit(lambda m: m.update(config="d_model=512")), None, "config must be object or null"),
    (edit(lambda m: m.update(extra=[1])), None, "extra must be object"),
    (edit(lambda m: m["extra"].update(step="12")), None, r"extra.step must be integer \(got '12'\)"),
    (edit(lambda m: m["extra"].update(alpha="0.6")), None, "extra.alpha must be number or null"),
    (edit(lambda m: m["extra"].update(args={"beam": 0})), None, "extra.args.beam must be bigger than or equal to 1"),
    (edit(lambda m: m["optimizer"].pop("num_params")), None, "optimizer must contain"),
    (None, lambda a: {"model/src_embed.weight": np.array(["a", "b"])}, "model/src_embed.weight holds <U1 values"),
])
def test_metadata_and_arrays_are_checked_when_opened(tmp_path, meta, arrays, message):
    model, opt, sched = setup()
    path = tmp_path / "ckpt.npz"
    save_checkpoint(str(path), model, opt, sched, extra={"step": 3})
    damaged = rewritten(path, tmp_path, meta, arrays)
    with pytest.raises(CheckpointError, match="damaged.npz.*" + message) as e:
        load_checkpoint(damaged)
    assert "\n" not in str(e.value)


def test_a_config_field_this_code_does_not_know_is_named():
    with pytest.raises(ValueError, match="fields this code does not know: colour"):
        nn.TransformerConfig.from_dict({**CFG, "colour": "blue"})
    with pytest.raises(ValueError, match="share_embeddings must be True or False, got 'yes'"):
        nn.TransformerConfig.from_dict({**CFG, "share_embeddings": "yes"})
    with pytest.raises(ValueError, match="a mapping of its fields, not a str"):
        nn.TransformerConfig.from_dict("d_model=16")


def test_a_checkpoint_from_before_the_decoder_start_field_starts_from_bos(tmp_path, monkeypatch):
    model, *_ = setup()
    old = {k: v for k, v in model.config.to_dict().items() if k not in ("init", "decoder_start")}
    monkeypatch.setattr(model.config, "to_dict", lambda: old)  # as the code before the fields wrote it
    save_checkpoint(str(tmp_path / "old.npz"), model)
    config = load_checkpoint(str(tmp_path / "old.npz"), metadata_only=True).config
    assert "decoder_start" not in config
    assert nn.TransformerConfig.from_dict(config).start_id == model.config.bos_id


def test_a_weight_is_finite_in_the_dtype_it_is_used_in(tmp_path):
    """A float64 1e39 is finite until it becomes float32: refused by the checkpoint's check and
    by load_state_dict, not loaded as inf."""
    model, _, _ = setup()
    state = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    key = next(iter(state))
    state[key].flat[0] = 1e39
    ckpt = Checkpoint(model=state, config=model.config.to_dict())
    ckpt.require_finite("big.npz", np.float64)
    with pytest.raises(CheckpointError, match=f"big.npz: the weight {key} is not finite in float32 \\(1 of"):
        ckpt.require_finite("big.npz")
    with pytest.raises(ValueError, match=f"load_state_dict: {key} has 1 values beyond the range of float32"):
        model.load_state_dict(state)
    state[key].flat[0] = 1e30  # within float32's range: loads
    model.load_state_dict(state)


def test_verify_finds_a_truncated_or_corrupted_checkpoint_without_loading_it(tmp_path):
    model, opt, sched = setup()
    path = tmp_path / "ckpt.npz"
    save_checkpoint(str(path), model, opt, sched)
    verify_checkpoint(str(path))
    data = bytearray(path.read_bytes())
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(bytes(data[: len(data) - 100]))
    with pytest.raises(CheckpointError, match="truncated.npz"):
        verify_checkpoint(str(truncated))
    # One byte of an array flipped: the archive still opens, but a member's CRC fails.
    name = next(k for k in model.state_dict() if "weight" in k)
    weight = model.state_dict()[name]
    at = bytes(data).index(weight.tobytes()[:64]) + 32
    data[at] ^= 0xFF
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt.npz is corrupt: its member .* does not match its checksum"):
        verify_checkpoint(str(corrupt))


def test_average_checkpoints(tmp_path):
    paths, states = [], []
    for seed in range(3):
        model, _, _ = setup(seed)
        paths.append(str(tmp_path / f"c{seed}.npz"))
        save_checkpoint(paths[-1], model)
        states.append(model.state_dict())
    avg = average_checkpoints(paths)
    for k in states[0]:
        expected = np.mean([s[k].astype(np.float64) for s in states], axis=0)
        np.testing.assert_allclose(avg.model[k], expected, rtol=1e-6, atol=1e-8)
    model, _, _ = setup()
    model.load_state_dict(avg.model)
