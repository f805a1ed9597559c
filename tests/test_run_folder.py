"""minitransformer.run_folder: a run's folder and the checks of --resume, on records written
here (train_wmt.py's runs resume end to end in tests/examples/test_train_wmt.py)."""

import logging
import types

import pytest

from minitransformer import nn, run_folder
from minitransformer.checkpoint import save_checkpoint
from minitransformer.run_folder import ResumeError

CONFIG = dict(vocab_size=20, d_model=16, d_ff=32, h=2, num_encoder_layers=1, num_decoder_layers=1)
# The options open_record reads, as train_wmt.py gives them.
ARGS = dict(precision="fp32", adam_eps=1e-9, clip_norm=0.0, accumulate=1, patience=0)


def a_run(folder, **record) -> types.SimpleNamespace:
    """A folder whose last.npz holds a tiny model and ``record`` as its options; the options now."""
    save_checkpoint(str(folder / "last.npz"), nn.Transformer(nn.TransformerConfig(**CONFIG)),
                    extra={"args": {**ARGS, **record}})
    return types.SimpleNamespace(out_dir=str(folder), **ARGS)


def opened(args) -> dict:
    return run_folder.open_record(args, lambda vocab_size: nn.TransformerConfig(**CONFIG))["args"]


def test_options_removed_since_the_record_are_read_as_their_replacements(tmp_path, caplog):
    args = a_run(tmp_path, limit_train=300, limit_val=20, limit_test=2, lr_factor=2.0, time_budget=None,
                 bpe_dropout=0.0)
    flags = opened(args)
    assert flags["limit"] == 300  # --limit-train N was N training pairs, as --limit N is
    assert not {"limit_train", "limit_val", "limit_test", "lr_factor", "time_budget", "bpe_dropout"} & set(flags)
    with caplog.at_level(logging.WARNING):
        opened(a_run(tmp_path, time_budget=600.0))
    assert "--time-budget 600.0" in caplog.text and "--max-steps" in caplog.text


def test_a_record_of_bpe_dropout_is_refused_in_one_line(tmp_path):
    with pytest.raises(ResumeError, match=r"--bpe-dropout 0\.1.*experiments/bpe_dropout/") as e:
        opened(a_run(tmp_path, bpe_dropout=0.1))
    assert "\n" not in str(e.value)


def test_the_run_s_settings_must_be_the_same(tmp_path):
    for key, other in (("precision", "fp16"), ("adam_eps", 1e-8), ("clip_norm", 1.0), ("accumulate", 2)):
        args = a_run(tmp_path)
        setattr(args, key, other)
        with pytest.raises(ResumeError, match=f"--{key.replace('_', '-')} "):
            opened(args)
    with pytest.raises(ResumeError, match="does not exist"):
        opened(types.SimpleNamespace(out_dir=str(tmp_path / "nothing"), **ARGS))


@pytest.mark.parametrize("before, now, extends", [(10, 10, True), (10, 0, True), (10, 11, True), (10, 9, False),
                                                   (0, 0, True), (0, 10, False)])
def test_patience_extends(before, now, extends):
    assert run_folder.patience_extends(before, now) is extends


def test_checkpoints_are_the_steps_oldest_first(tmp_path):
    for name in ("ckpt-10.npz", "ckpt-9.npz", "ckpt-best.npz", "last.npz"):
        (tmp_path / name).write_bytes(b"")
    assert [p.rsplit("/", 1)[1] for p in run_folder.checkpoints(str(tmp_path))] == ["ckpt-9.npz", "ckpt-10.npz"]


def test_an_interrupted_run_says_how_to_continue(tmp_path):
    argv = ["--out-dir", str(tmp_path)]
    assert "nothing to resume" in run_folder.resume_hint(str(tmp_path), "train_wmt.py", argv)
    (tmp_path / "last.npz").write_bytes(b"")
    hint = run_folder.resume_hint(str(tmp_path), "train_wmt.py", argv)
    assert hint.startswith("continue with: python ") and hint.endswith(f"--out-dir {tmp_path} --resume")
