"""End to end on a few hundred Multi30k pairs: tokenizer, batching, training steps,
checkpoints, resume, averaging, beam search, BLEU, translate.py and plot_attention.py."""

import json
import logging
import math
import os
import pathlib
import subprocess
import sys
import types

import pytest

from tests.helpers import MULTI30K_DIR as DATA
from tests.helpers import ended_process, needs_multi30k

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = needs_multi30k

sys.path.insert(0, str(ROOT / "examples"))
import train_wmt  # noqa: E402
import translate  # noqa: E402

from minitransformer import files  # noqa: E402
from minitransformer.checkpoint import load_checkpoint  # noqa: E402
from minitransformer.data import batching  # noqa: E402
from minitransformer.optim import noam_lr  # noqa: E402

# --limit 300: 300 training pairs, 15 of validation and 15 of test.
SMALL = ["--data-dir", str(DATA), "--limit", "300", "--vocab-size", "400", "--d-model", "32",
         "--layers", "1", "--max-tokens", "600", "--eval-every", "3", "--bleu-sample", "4",
         "--log-every", "1", "--no-progress", "--average-last", "2", "--warmup", "10"]


def losses(out_dir):
    rows = [json.loads(line) for line in open(out_dir / "train.jsonl")]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_the_smoke_preset_trains_translates_and_scores_its_toy_size(tmp_path):
    """--preset smoke is the README's first look: its own toy size (2,000 pairs, 100 test
    sentences) and vocabulary, the whole path to BLEU (here cut to a few steps)."""
    result = train_wmt.main(["--preset", "smoke", "--data-dir", str(DATA), "--out-dir", str(tmp_path / "run"),
                             "--max-steps", "4", "--no-progress"])
    assert result["steps"] == 4 and result["test_sentences"] == 100
    assert len((tmp_path / "run" / "test.hyp.de").read_text().splitlines()) == 100
    model = load_checkpoint(str(tmp_path / "run" / "last.npz"), metadata_only=True).extra
    assert model["args"]["limit"] == 2000 and 0.0 <= result["bleu"] <= 100.0


def test_train_resume_average_translate(tmp_path, caplog):
    straight, split = tmp_path / "straight", tmp_path / "split"
    result = train_wmt.main(SMALL + ["--out-dir", str(straight), "--max-steps", "9"])
    assert result["steps"] == 9 and result["test_sentences"] == 15
    assert 0.0 <= result["bleu"] <= 100.0 and result["signature"].startswith("nrefs:1|case:mixed")
    assert result["averaged"] == ["ckpt-6.npz", "ckpt-9.npz"]
    hyps = (straight / "test.hyp.de").read_text().splitlines()
    assert len(hyps) == 15
    assert (straight / "curves.png").stat().st_size > 10_000
    assert json.loads((straight / "bleu.json").read_text())["bleu"] == result["bleu"]
    # The literature's metric beside ours: sacreBLEU on lowercased text, with its own signature.
    from sacrebleu.metrics import BLEU

    refs = train_wmt.data.load_corpus("multi30k", DATA, "test_2016_flickr").tgt[:15]
    lowered = BLEU(lowercase=True).corpus_score(hyps, [refs]).score
    assert result["bleu_lowercased"] == pytest.approx(lowered) and "case:lc" in result["signature_lowercased"]
    assert json.loads((straight / "bleu.json").read_text())["signature_lowercased"] == result["signature_lowercased"]
    preset = train_wmt.PRESETS["multi30k"]  # the beam search it scored with, saved for translate.py
    assert (result["beam"], result["alpha"]) == (preset.beam, preset.alpha)
    averaged = load_checkpoint(str(straight / "averaged.npz"), metadata_only=True).extra
    assert (averaged["beam"], averaged["alpha"]) == (preset.beam, preset.alpha)

    with pytest.raises(SystemExit, match="--resume"):  # never mixes with an earlier run's checkpoints
        train_wmt.main(SMALL + ["--out-dir", str(straight), "--max-steps", "3"])

    # Stop after 6 steps, then resume to 9: the loss curve must continue exactly.
    train_wmt.main(SMALL + ["--out-dir", str(split), "--max-steps", "6"])
    train_wmt.main(SMALL + ["--out-dir", str(split), "--max-steps", "9", "--resume"])
    expected, resumed = losses(straight), losses(split)
    assert sorted(resumed) == list(range(1, 10))
    assert [resumed[s] for s in (7, 8, 9)] == [expected[s] for s in (7, 8, 9)]
    assert resumed[9] < resumed[1]
    with caplog.at_level(logging.INFO, logger="train_wmt"):  # a finished run resumed below its step: nothing to train
        train_wmt.main(SMALL + ["--out-dir", str(split), "--max-steps", "7", "--resume"])
    assert "training stopped (max steps) after 9 steps" in caplog.text
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "--max-steps 7" in r.getMessage()]
    assert len(said) == 1 and "step 9" in said[0]  # said, not silently
    assert losses(split) == resumed
    # Each part of the run says what made it: its command, the code's commit, the seed.
    parts = json.loads((split / "bleu.json").read_text())["parts"]
    assert [p["step"] for p in parts] == [0, 6, 9]
    assert all("train_wmt.py" in p["command"] and p["seed"] == 1 for p in parts)
    assert "--resume" not in parts[0]["command"] and "--max-steps 9 --resume" in parts[1]["command"]
    assert all(p["commit"] is None or len(p["commit"].rstrip("+")) >= 7 for p in parts)

    out = subprocess.run([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(straight)],
                         input="A man is riding a bike.\nTwo dogs play in the snow.\n",
                         capture_output=True, text=True, timeout=120, check=True)
    assert len(out.stdout.splitlines()) == 2

    subprocess.run([sys.executable, str(ROOT / "examples" / "plot_attention.py"), "--run", str(straight),
                    "A dog runs."], capture_output=True, text=True, timeout=120, check=True)
    for name in ("encoder_self.png", "decoder_self.png", "cross.png"):
        assert (straight / "attention" / name).stat().st_size > 5_000


@pytest.mark.slow  # a whole run, resumed
def test_float16_training_resumes_exactly_with_its_loss_scale(tmp_path):
    fp16 = SMALL + ["--precision", "fp16", "--eval-every", "2", "--bleu-sample", "2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    result = train_wmt.main(fp16 + ["--out-dir", str(straight), "--max-steps", "4"])
    assert result["precision"] == "fp16" and result["steps"] == 4
    rows = [json.loads(line) for line in open(straight / "train.jsonl") if '"train"' in line]
    assert all(r["loss_scale"] > 1.0 for r in rows)
    train_wmt.main(fp16 + ["--out-dir", str(split), "--max-steps", "2"])
    train_wmt.main(fp16 + ["--out-dir", str(split), "--max-steps", "4", "--resume"])
    expected, resumed = losses(straight), losses(split)
    assert [resumed[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]


@pytest.mark.slow  # a whole run, resumed
@pytest.mark.parametrize("accumulate", ["1", "2"])
def test_resume_across_the_end_of_the_epochs_is_exact(tmp_path, accumulate):
    """A run that stops at the end of its epochs resumes with the next epoch's first batch;
    with --accumulate 2, an epoch's last step takes the one batch or two it has left."""
    args = SMALL + ["--eval-every", "5", "--accumulate", accumulate]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_wmt.main(args + ["--out-dir", str(straight), "--epochs", "2"])
    train_wmt.main(args + ["--out-dir", str(split), "--epochs", "1"])
    train_wmt.main(args + ["--out-dir", str(split), "--epochs", "2", "--resume"])
    assert losses(split) == losses(straight)


def test_resume_survives_a_torn_log_and_refuses_other_settings(tmp_path):
    args = SMALL + ["--out-dir", str(tmp_path)]
    train_wmt.main(args + ["--max-steps", "3"])
    with open(tmp_path / "train.jsonl", "a") as f:
        f.write('null\n{"kind": "train", "step": "2"}\n')  # damaged lines: dropped on resume, with a warning
        f.write('{"kind": "train", "st')  # a line cut short by a crash
    with pytest.raises(SystemExit, match="--warmup"):
        train_wmt.main(args + ["--max-steps", "6", "--resume", "--warmup", "99"])
    with pytest.raises(SystemExit, match="trained with --accumulate 1, not 2"):
        train_wmt.main(args + ["--max-steps", "6", "--resume", "--accumulate", "2"])
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit, match="--limit 300, not with --limit 200") as e:
        train_wmt.main(args + ["--max-steps", "6", "--resume", "--limit", "200"])
    one_line_error(e)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # refused before it wrote a tokenizer
    train_wmt.main(args + ["--max-steps", "6", "--resume"])
    assert sorted(losses(tmp_path)) == list(range(1, 7))
    checkpoint, tokenizer = translate.find_run_files(str(tmp_path))
    assert pathlib.Path(tokenizer).name == load_checkpoint(checkpoint, metadata_only=True).extra["tokenizer"]


def test_resume_refuses_the_batches_of_an_earlier_batcher(tmp_path, monkeypatch):
    args = SMALL + ["--out-dir", str(tmp_path)]
    monkeypatch.setattr(batching, "BATCHING", batching.BATCHING - 1)
    train_wmt.main(args + ["--max-steps", "2"])
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="made by an earlier version of the batcher") as e:
        train_wmt.main(args + ["--max-steps", "4", "--resume"])
    one_line_error(e)


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_resume_refuses_another_model_shape_and_finds_a_bad_checkpoint_early(tmp_path):
    args = SMALL + ["--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="does not exist") as e:  # --resume into an empty folder
        train_wmt.main(args + ["--max-steps", "3", "--resume"])
    assert "drop --resume" in one_line_error(e)
    train_wmt.main(args + ["--max-steps", "6", "--alpha", "1.3"])  # ckpt-3.npz, ckpt-6.npz, last.npz
    with pytest.raises(SystemExit, match="--d-model 32, but these settings give 48") as e:
        train_wmt.main(args + ["--max-steps", "9", "--resume", "--d-model", "48"])
    one_line_error(e)
    with pytest.raises(SystemExit, match="--d-ff 128, but these settings give 96"):  # SMALL's d_ff: 4 * 32
        train_wmt.main(args + ["--max-steps", "9", "--resume", "--d-ff", "96"])
    with pytest.raises(SystemExit, match="--layers 1, but these settings give 2"):
        train_wmt.main(args + ["--max-steps", "9", "--resume", "--layers", "2"])
    model = train_wmt.PRESETS["multi30k"].model  # the run's P_drop and eps_ls
    with pytest.raises(SystemExit, match=f"--dropout {model['dropout']}, but these settings give 0.3"):
        train_wmt.main(args + ["--max-steps", "9", "--resume", "--dropout", "0.3"])
    with pytest.raises(SystemExit, match=f"--label-smoothing {model['label_smoothing']}, but these settings give 0.3"):
        train_wmt.main(args + ["--max-steps", "9", "--resume", "--label-smoothing", "0.3"])

    # A checkpoint to be averaged, cut short (a full disk); and a write that a kill interrupted.
    ckpt = tmp_path / "ckpt-3.npz"
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    (tmp_path / ".tmp-k1ll3d.npz").write_bytes(b"a user's")  # not named as atomic_write names: kept
    pid, start = ended_process()
    killed = tmp_path / f".tmp-last.npz-@{files._host()}:{pid}.{start}-x7f2q"  # as files.atomic_write does
    killed.write_bytes(b"half a checkpoint")
    with pytest.raises(SystemExit, match=r"ckpt-3\.npz .*truncated.*delete it") as e:
        train_wmt.main(args + ["--max-steps", "9", "--resume"])
    one_line_error(e)
    assert (tmp_path / ".tmp-k1ll3d.npz").read_bytes() == b"a user's" and not killed.exists()
    ckpt.unlink()  # as the message says
    result = train_wmt.main(args + ["--max-steps", "9", "--resume"])
    assert result["averaged"] == ["ckpt-6.npz", "ckpt-9.npz"]
    assert result["alpha"] == 1.3  # a resumed run keeps its beam search unless told otherwise


def misaligned_corpus(tmp_path) -> pathlib.Path:
    """Multi30k's files, but the German training file one line short."""
    import gzip
    import itertools

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in DATA.glob("*.gz"):
        with gzip.open(f, "rt", encoding="utf-8") as src:
            lines = [line.rstrip("\n") for line in itertools.islice(src, 50)]
        if f.name == "train.de.gz":
            lines = lines[:-1]
        with gzip.open(corpus / f.name, "wt", encoding="utf-8") as out:
            out.write("\n".join(lines) + "\n")
    return corpus


def test_user_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    from minitransformer import backend
    from minitransformer.data import CorpusError

    corpus = misaligned_corpus(tmp_path)
    args = SMALL[2:] + ["--data-dir", str(corpus), "--out-dir", str(tmp_path / "run"), "--max-steps", "1"]
    with pytest.raises(SystemExit, match=r"^error: .*train\.(en|de).* 50 .* 49") as e:
        train_wmt.main(args)
    one_line_error(e)
    with pytest.raises(CorpusError):
        train_wmt.main(args + ["--debug"])

    for value, debug in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("MT_DEBUG", value)
        assert train_wmt.parse_args([]).debug is debug

    monkeypatch.setattr(backend, "has_cuda", lambda: False)  # refused when parsed, before anything runs
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_wmt.main(args + ["--device", "cuda"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "argument --device: device 'cuda'" in line and ("CuPy" in line or "CUDA" in line)


def test_fairseq_s_conventions_train_translate_and_are_recorded(tmp_path):
    """--subwords subword-nmt, --init fairseq and --decoder-start eos: the run trains on
    subword-nmt's pieces with tgt_in starting at EOS, records the three choices (model config,
    checkpoints, bleu.json), and translate.py reads them back; a resume with another start is refused."""
    run = tmp_path / "run"
    args = SMALL + ["--out-dir", str(run), "--max-steps", "3", "--subwords", "subword-nmt", "--init", "fairseq",
                    "--decoder-start", "eos"]
    result = train_wmt.main(args)
    assert (result["subwords"], result["init"], result["decoder_start"]) == ("subword-nmt", "fairseq", "eos")
    averaged = load_checkpoint(str(run / "averaged.npz"))
    assert (averaged.config["init"], averaged.config["decoder_start"]) == ("fairseq", "eos")
    assert averaged.extra["subwords"] == "subword-nmt" and averaged.extra["tokenizer"].endswith(".bpe")
    assert len((run / "test.hyp.de").read_text().splitlines()) == result["test_sentences"]

    (tmp_path / "in.en").write_text("A man is riding a bike.\nTwo dogs play in the snow.\n")
    translate.main(["--run", str(run), "--input", str(tmp_path / "in.en"), "--output", str(tmp_path / "out.de")])
    assert len((tmp_path / "out.de").read_text().splitlines()) == 2
    model = translate.model_from(averaged, "averaged.npz", "cpu")
    assert model.config.start_id == train_wmt.data.EOS_ID
    spm = types.SimpleNamespace(path=run / averaged.extra["tokenizer"], vocab_size=averaged.config["vocab_size"],
                                kind="sentencepiece")
    with pytest.raises(SystemExit, match="subword-nmt"):  # its detokenizer would not undo "@@ "
        translate.model_from(averaged, "averaged.npz", "cpu", tokenizer=spm)
    with pytest.raises(SystemExit, match="--decoder-start eos, but these settings give bos") as e:
        train_wmt.main(args[:-2] + ["--decoder-start", "bos", "--max-steps", "6", "--resume"])
    one_line_error(e)


def test_settings_are_refused_when_parsed_and_unusable_data_before_the_tokenizer_is_trained(tmp_path, capsys):
    """A model its heads cannot split, found when parsed; training data whose every pair is
    longer than the preset keeps, found before the tokenizer is trained: one line each, and
    nothing written."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_wmt.main(SMALL + ["--d-model", "30", "--out-dir", str(out)])  # the preset's 4 heads
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "d_model" in line and "30" in line and not out.exists()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            (corpus / f"{split}.{lang}").write_text(("word " * train_wmt.PRESETS["multi30k"].max_len + "\n") * 20)
    with pytest.raises(SystemExit, match=r"^error: .*train\.(en|de)") as e:
        train_wmt.main(SMALL + ["--data-dir", str(corpus), "--out-dir", str(out)])
    one_line_error(e)
    assert not list(out.glob("spm-*"))


def test_model_flags_override_the_preset():
    preset = train_wmt.PRESETS["multi30k"]
    config = train_wmt.model_config(train_wmt.parse_args(["--d-model", "64", "--layers", "2", "--dropout", "0.3",
                                                          "--label-smoothing", "0.2"]), preset, vocab_size=100)
    assert (config.d_model, config.d_ff, config.num_encoder_layers, config.num_decoder_layers, config.dropout,
            config.label_smoothing) == (64, 256, 2, 2, 0.3, 0.2)
    narrow = train_wmt.model_config(train_wmt.parse_args(["--d-model", "64", "--d-ff", "128"]), preset, vocab_size=100)
    assert (narrow.d_model, narrow.d_ff) == (64, 128)
    default = train_wmt.model_config(train_wmt.parse_args([]), preset, vocab_size=100)
    assert (default.d_model, default.dropout, default.label_smoothing) == (
        preset.model["d_model"], preset.model["dropout"], preset.model["label_smoothing"])
    assert (default.init, default.decoder_start) == ("plain", "bos")  # today's, until the runs decide
    fairseq = train_wmt.model_config(train_wmt.parse_args(["--init", "fairseq", "--decoder-start", "eos"]), preset, 100)
    assert (fairseq.init, fairseq.decoder_start) == ("fairseq", "eos")


def test_a_stop_just_after_a_checkpoint_replaces_it_rather_than_averaging_a_near_copy(tmp_path):
    """The last checkpoint, written where training stops, replaces the regular one before it when
    that is less than half a checkpoint interval older, and joins the others when it is not."""
    args = SMALL + ["--eval-every", "4", "--average-last", "3"]
    near = train_wmt.main(args + ["--out-dir", str(tmp_path / "near"), "--max-steps", "9"])
    assert near["averaged"] == ["ckpt-4.npz", "ckpt-9.npz"]
    far = train_wmt.main(args + ["--out-dir", str(tmp_path / "far"), "--max-steps", "11"])
    assert far["averaged"] == ["ckpt-4.npz", "ckpt-8.npz", "ckpt-11.npz"]


def test_every_checkpoint_is_kept_on_request_and_across_a_resume_while_the_last_are_averaged(tmp_path):
    """--keep-checkpoints 0 keeps every step checkpoint (a curve of the run's progress reads
    them); a resumed run keeps doing so without being told again; the final model still
    averages only the last --average-last. By default only those are kept."""
    args = SMALL + ["--eval-every", "2", "--out-dir", str(tmp_path)]
    train_wmt.main(args + ["--max-steps", "6", "--keep-checkpoints", "0"])
    result = train_wmt.main(args + ["--max-steps", "10", "--resume"])
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.npz")) == [f"ckpt-{s}.npz" for s in (10, 2, 4, 6, 8)]
    assert result["averaged"] == ["ckpt-8.npz", "ckpt-10.npz"]
    train_wmt.main(args + ["--max-steps", "12", "--resume", "--keep-checkpoints", "3"])  # told otherwise
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.npz")) == ["ckpt-10.npz", "ckpt-12.npz", "ckpt-8.npz"]
    default = train_wmt.main(args + ["--out-dir", str(tmp_path / "default"), "--max-steps", "6"])
    assert sorted(p.name for p in (tmp_path / "default").glob("ckpt-*.npz")) == ["ckpt-4.npz", "ckpt-6.npz"]
    assert default["averaged"] == ["ckpt-4.npz", "ckpt-6.npz"]


def test_the_step_batch_is_shared_among_the_ranks():
    """--max-tokens (or the preset's) is the step's batch, whatever the number of ranks (each
    takes a share of its sentences, data.TokenBatcher), so the schedule tuned for it holds; a
    W-th of it must hold the preset's longest sentence."""
    preset = train_wmt.PRESETS["multi30k"]
    world = lambda size: types.SimpleNamespace(world_size=size)  # noqa: E731
    no_flag = types.SimpleNamespace(max_tokens=None)
    assert [train_wmt.step_tokens(no_flag, preset, world(w)) for w in (1, 2, 4)] == [2500] * 3
    assert train_wmt.step_tokens(types.SimpleNamespace(max_tokens=601), preset, world(2)) == 601
    with pytest.raises(train_wmt.SetupError, match="among 4 ranks gives each 99, fewer than the longest"):
        train_wmt.step_tokens(types.SimpleNamespace(max_tokens=399), preset, world(4))


def test_the_bar_shows_the_budget_the_run_really_has():
    """A run ends at the first of its limits: the bar's share is the larger share spent, so a
    9,000-step run is half done at step 4,500, not at half of the steps its epochs would take."""
    steps = train_wmt.Budget(epochs=100, max_steps=9000, eval_every=200)
    assert steps.spent(step=4500, epochs=23.2) == pytest.approx(0.5)
    epochs = train_wmt.Budget(epochs=2, max_steps=math.inf, eval_every=200)
    assert epochs.spent(step=10, epochs=1.5) == pytest.approx(0.75)
    assert steps.spent(step=9000, epochs=200) == 1.0


def test_the_progress_bar_counts_the_budget(tmp_path, capsys):
    args = [a for a in SMALL if a != "--no-progress"]
    train_wmt.main(args + ["--out-dir", str(tmp_path), "--max-steps", "4"])
    err = capsys.readouterr().err
    assert "100% of the budget" in err and "step=4" in err


# The anchor's preset at toy sizes: its text, schedule, optimiser, clipping, stopping and scoring,
# on a model, vocabulary and batches a few seconds can train.
TINY = ["--preset", "multi30k-tiny", "--data-dir", str(DATA), "--limit", "300", "--vocab-size", "400",
        "--d-model", "32", "--d-ff", "64", "--layers", "1", "--max-tokens", "600", "--log-every", "1", "--no-progress"]


def test_the_anchor_s_preset_is_its_recipe():
    """Each row of Wu et al. (2021)'s recipe (the README's table): the model, the optimiser, the
    schedule's peak, clipping, batches, stopping, averaging and decoding."""
    args = train_wmt.parse_args(["--preset", "multi30k-tiny"])
    preset = train_wmt.PRESETS["multi30k-tiny"]
    config = train_wmt.model_config(args, preset, vocab_size=10000)
    assert (config.d_model, config.d_ff, config.h, config.num_encoder_layers, config.num_decoder_layers) == (
        128, 256, 4, 4, 4)
    assert (config.dropout, config.attention_dropout, config.label_smoothing, config.share_embeddings) == (
        0.3, 0.0, 0.1, True)
    assert (args.preprocess, args.adam_eps, args.clip_norm, args.patience, args.bleu_sample) == (
        "moses-lc", 1e-8, 25.0, 10, 0)
    for d_model in (128, 32):  # fairseq's --lr is the peak, whatever the model's width
        factor = train_wmt.lr_factor(args, preset, d_model, preset.warmup)
        assert noam_lr(preset.warmup, d_model, preset.warmup, factor) == pytest.approx(0.005, rel=1e-12)
    mine = train_wmt.lr_factor(train_wmt.parse_args(["--preset", "multi30k-tiny", "--peak-lr", "0.001"]), preset,
                               128, 2000)
    assert noam_lr(2000, 128, 2000, mine) == pytest.approx(0.001, rel=1e-12)
    plain = train_wmt.PRESETS["multi30k"]  # a factor, not a peak
    assert train_wmt.lr_factor(train_wmt.parse_args([]), plain, 128, plain.warmup) == plain.lr_factor
    assert (preset.max_tokens, preset.max_steps, preset.average_last) == (8192, 8000, 10)
    assert (preset.beam, preset.alpha, preset.length_penalty) == (5, 1.0, "fairseq")
    assert train_wmt.data.PRESETS[preset.tokenizer].vocab_size == 10000
    assert train_wmt.average_last(train_wmt.parse_args(["--preset", "multi30k-tiny", "--average-last", "3"])) == 3


@pytest.mark.slow  # a whole run, resumed
def test_the_anchor_s_preset_trains_on_moses_text_and_scores_in_the_literature_s_metric(tmp_path):
    from minitransformer.bleu import bleu_literature, bleu_lowercased
    from minitransformer.data import moses

    result = train_wmt.main(TINY + ["--out-dir", str(tmp_path), "--max-steps", "3", "--eval-every", "3"])
    assert (result["preprocess"], result["beam"], result["alpha"], result["length_penalty"]) == (
        "moses-lc", 5, 1.0, "fairseq")
    tokens = (tmp_path / "test.tok.de").read_text().splitlines()
    assert len(tokens) == 15 and all(line == line.lower() for line in tokens)
    assert (tmp_path / "test.hyp.de").read_text().splitlines() == moses.detokenize(tokens, "de")
    refs = train_wmt.data.load_corpus("multi30k", DATA, "test_2016_flickr").tgt[:15]
    assert result["bleu"] is None and result["signature"] is None  # a lowercased model has no cased figure
    assert result["literature"] == bleu_literature(tokens, moses.moses_lc(refs, "de"), tokenized=True)[0]
    assert result["bleu_lowercased"] == bleu_lowercased(moses.detokenize(tokens, "de"), refs)[0]
    assert json.loads((tmp_path / "bleu.json").read_text())["literature"] == result["literature"]
    # The recipe, as the checkpoint keeps it for --resume: Adam's eps, fairseq's peak, the clipping.
    last = load_checkpoint(str(tmp_path / "last.npz"))
    flags = last.extra["args"]
    assert (flags["adam_eps"], flags["clip_norm"], flags["patience"], flags["bleu_sample"]) == (1e-8, 25.0, 10, 0)
    assert last.optimizer["eps"] == 1e-8
    sched = last.schedule
    assert noam_lr(sched["warmup"], sched["d_model"], sched["warmup"], sched["factor"]) == pytest.approx(
        0.005, rel=1e-12)
    # The tokenizer learned lowercased Moses tokens: no capital letter among its pieces.
    tok = train_wmt.data.Tokenizer(tmp_path / last.extra["tokenizer"])
    assert not any(c.isupper() for piece in tok.id_to_piece(range(tok.vocab_size)) for c in piece if c.isalpha())
    # translate.py reads the run's text settings from its averaged model: raw English in,
    # lowercased German out, as test.hyp.de.
    sources = train_wmt.data.load_corpus("multi30k", DATA, "test_2016_flickr").src[:2]
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(tmp_path)],
                         input="\n".join(sources) + "\n", capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines() == (tmp_path / "test.hyp.de").read_text().splitlines()[:2]
    assert "text moses-lc" in out.stderr and "(fairseq)" in out.stderr
    # plot_attention.py gives the model the same text: its maps are of lowercased Moses tokens.
    import plot_attention

    drawn = []
    real_draw = plot_attention.draw
    plot_attention.draw = lambda maps, rows, cols, *a, **k: (drawn.append(cols), real_draw(maps, rows, cols, *a, **k))
    try:
        plot_attention.main([sources[0], "--run", str(tmp_path), "--out", str(tmp_path / "maps"), "--beam", "2"])
    finally:
        plot_attention.draw = real_draw
    (expected,) = tok.encode(moses.moses_lc(sources[:1], "en"))
    assert drawn[0] == tok.id_to_piece(expected + [tok.eos_id])  # the encoder's map: the source's pieces
    with pytest.raises(SystemExit, match="--preprocess moses-lc, not with --preprocess raw"):
        train_wmt.main(TINY + ["--out-dir", str(tmp_path), "--max-steps", "4", "--resume", "--preprocess", "raw"])
    with pytest.raises(SystemExit, match="peak rate of 0.005, not --peak-lr 0.001"):
        train_wmt.main(TINY + ["--out-dir", str(tmp_path), "--max-steps", "4", "--resume", "--peak-lr", "0.001"])


def scripted_validation(monkeypatch, curve):
    """evaluate_loss replaced by a curve of label-smoothed losses, one per call, in order."""
    values = iter(curve)

    def evaluate(*args, **kwargs):
        loss = next(values)
        return loss, math.exp(loss)

    monkeypatch.setattr(train_wmt, "evaluate_loss", evaluate)


def test_patience_stops_on_the_validation_loss_and_a_resumed_run_counts_on(tmp_path, monkeypatch):
    """--patience 2 on 5, 4, 4.5, 4.2: the second validation in a row without a better loss
    ends training there, at step 4, and bleu.json says why. A run stopped at step 3 by
    --max-steps (one bad validation counted) and resumed stops at step 4 as well, which it
    would not if its count started again; a run that has stopped early trains no more."""
    common = TINY + ["--eval-every", "1", "--patience", "2", "--average-last", "10"]
    args = common + ["--max-steps", "10"]
    curve = [5.0, 4.0, 4.5, 4.2]
    scripted_validation(monkeypatch, curve)
    straight = train_wmt.main(args + ["--out-dir", str(tmp_path / "straight")])
    assert straight["steps"] == 4 and straight["stopped"].startswith("patience: no better validation loss in 2")
    assert straight["averaged"] == [f"ckpt-{s}.npz" for s in (1, 2, 3, 4)]  # every epoch's (here, step's)
    saved = load_checkpoint(str(tmp_path / "straight" / "last.npz"), metadata_only=True).extra["early_stopping"]
    assert saved == {"best": 4.0, "best_step": 2, "bad": 2}

    scripted_validation(monkeypatch, curve)
    train_wmt.main(common + ["--max-steps", "3", "--out-dir", str(tmp_path / "split")])
    resumed = train_wmt.main(args + ["--out-dir", str(tmp_path / "split"), "--resume"])
    assert resumed["steps"] == 4 and resumed["stopped"] == straight["stopped"]
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")
    again = train_wmt.main(args + ["--out-dir", str(tmp_path / "split"), "--resume"])
    assert again["steps"] == 4 and again["stopped"] == straight["stopped"]


def test_a_stopped_run_resumes_with_a_longer_patience_but_not_a_shorter_one(tmp_path, monkeypatch, caplog):
    """Patience decides where a run ends, not what it trains on: a run stopped by --patience 2
    and resumed with --patience 0 (never) or 3 trains on as that run would have from the start,
    to the same losses; --patience 1 might have stopped it earlier, and is refused, as is a
    finite patience after none."""
    common = TINY + ["--eval-every", "1", "--average-last", "10"]
    curve = [5.0, 4.0, 4.5, 4.2, 3.9, 4.3]
    scripted_validation(monkeypatch, curve)
    never = train_wmt.main(common + ["--patience", "0", "--max-steps", "6", "--out-dir", str(tmp_path / "never")])
    assert never["steps"] == 6 and never["stopped"] == "max steps"

    scripted_validation(monkeypatch, curve)
    stopped = train_wmt.main(common + ["--patience", "2", "--max-steps", "6", "--out-dir", str(tmp_path / "run")])
    assert stopped["steps"] == 4
    with pytest.raises(SystemExit, match=r"--patience 2, not 1: a shorter patience might have stopped it"):
        train_wmt.main(common + ["--patience", "1", "--max-steps", "6", "--out-dir", str(tmp_path / "run"), "--resume"])
    scripted_validation(monkeypatch, curve[4:])
    with caplog.at_level("INFO", logger="train_wmt"):
        resumed = train_wmt.main(common + ["--patience", "0", "--max-steps", "6", "--out-dir", str(tmp_path / "run"),
                                           "--resume"])
    assert "--patience 0 where the run had 2" in caplog.text
    assert resumed["steps"] == 6 and resumed["stopped"] == "max steps"
    assert losses(tmp_path / "run") == losses(tmp_path / "never")
    assert load_checkpoint(str(tmp_path / "run" / "last.npz"), metadata_only=True).extra["args"]["patience"] == 0
    with pytest.raises(SystemExit, match=r"--patience 0, not 3: a shorter patience"):
        train_wmt.main(common + ["--patience", "3", "--max-steps", "7", "--out-dir", str(tmp_path / "run"), "--resume"])

    scripted_validation(monkeypatch, curve)
    train_wmt.main(common + ["--patience", "2", "--max-steps", "6", "--out-dir", str(tmp_path / "longer")])
    scripted_validation(monkeypatch, curve[4:])
    longer = train_wmt.main(common + ["--patience", "3", "--max-steps", "6", "--out-dir", str(tmp_path / "longer"),
                                      "--resume"])
    assert longer["steps"] == 6 and losses(tmp_path / "longer") == losses(tmp_path / "never")


def recorded_with(path, **old):
    """Rewrite checkpoint ``path``'s resume record (its options) as the code before issue 74
    wrote it: ``old``'s options in place of --limit."""
    import numpy as np

    with np.load(path) as archive:
        arrays = {k: archive[k] for k in archive.files}
    meta = json.loads(arrays["__meta__"].tobytes())
    meta["extra"]["args"].pop("limit", None)
    meta["extra"]["args"].update(old)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


def test_a_run_recorded_with_removed_options_resumes_with_their_replacements_or_is_refused(tmp_path):
    args = SMALL + ["--out-dir", str(tmp_path)]
    train_wmt.main(args + ["--max-steps", "3"])
    last = str(tmp_path / "last.npz")
    recorded_with(last, limit_train=300, limit_val=20, limit_test=2, lr_factor=None, time_budget=None, bpe_dropout=0.0)
    with pytest.raises(SystemExit, match="trained with --limit 300, not with --limit 200") as e:
        train_wmt.main(args + ["--max-steps", "6", "--resume", "--limit", "200"])
    one_line_error(e)
    assert train_wmt.main(args + ["--max-steps", "6", "--resume"])["steps"] == 6  # --limit-train 300 is --limit 300
    recorded_with(last, limit_train=300, bpe_dropout=0.1)
    with pytest.raises(SystemExit, match=r"trained with --bpe-dropout 0\.1: .*start a new run") as e:
        train_wmt.main(args + ["--max-steps", "9", "--resume"])
    one_line_error(e)
