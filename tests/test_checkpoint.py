import os

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import nn
from minitransformer.checkpoint import (
    CheckpointError, average_checkpoints, load_checkpoint, restore, save_checkpoint, verify_checkpoint,
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
    return [train_step(model, opt, sched, *b).loss for b in data]


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
