"""examples/translate.py and plot_attention.py as a new user meets them: awkward lines, bad bytes,
the wrong tokenizer, interactive stdin, a large file. A tiny untrained model is enough: these
tests are about what reaches the output, not what the translation says."""

import os
import pathlib
import resource
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minitransformer import data, decoding
from minitransformer.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers import fill, sentences, tiny_run, tmpfs

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import plot_attention  # noqa: E402
import translate  # noqa: E402

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("run"), seed=0)


def cli(run, stdin: bytes, *args):
    return subprocess.run([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(run), *args],
                          input=stdin, capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_every_line_comes_back_and_unreadable_ones_empty(run, tmp_path, caplog):
    long_text = " ".join(["a man runs in the park."] * 400)  # 2,400 words, sentence ends inside
    long_words = " ".join(["water"] * 2000)  # no sentence end: truncated
    lines = ["A dog runs.", "", "   ", "\t", "中文 字符", long_text, long_words, "A man sits."]
    src = tmp_path / "in.en"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.de"
    translate.main(["--run", str(run), "--input", str(src), "--output", str(out), "--beam", "2"])
    hyps = out.read_text().split("\n")
    assert len(hyps) == len(lines) + 1 and hyps[-1] == ""  # one line out per line in
    assert hyps[1:5] == ["", "", "", ""]  # nothing invented for empty, blank, all-unknown lines
    assert hyps[0] and hyps[5] and hyps[6] and hyps[7]
    warnings = [r.getMessage() for r in caplog.records]
    assert any(w.startswith("line 5: the vocabulary knows none") for w in warnings)
    assert any(w.startswith("line 6:") and "translated in 400 parts" in w for w in warnings)
    assert any(w.startswith("line 7:") and "truncated to 31 tokens" in w for w in warnings)
    assert len(warnings) == 3


def test_the_same_sentence_alone_or_among_others(run):
    tok = data.Tokenizer(next(run.glob("*.model")))
    model = translate.load_model(str(run / "averaged.npz"), "cpu", tokenizer=tok)
    alone = decoding.translate(model, tok, ["A dog sits in the water."], beam_size=2)
    among = decoding.translate(model, tok, ["", "A dog sits in the water.", "中文"], beam_size=2)
    assert among == ["", alone[0], ""]


@pytest.mark.parametrize("how", ["stdin", "file"])
def test_bytes_that_are_not_utf8_are_named(run, tmp_path, how):
    text = b"A dog runs.\nA man \xff sits.\n"
    if how == "stdin":
        result = cli(run, text)
        where = "stdin"
    else:
        (tmp_path / "bad.en").write_bytes(text)
        result = cli(run, b"", "--input", str(tmp_path / "bad.en"))
        where = str(tmp_path / "bad.en")
    assert result.returncode != 0
    assert result.stderr.decode().strip().splitlines()[-1] == (
        f"error: {where}, line 2: byte 0xff at column 7 is not valid UTF-8 (invalid start byte)")


def test_a_failed_run_leaves_the_output_as_it_was_and_what_it_finished_beside_it(run, tmp_path):
    """A bad byte far into a file stops the run there: the output file is not truncated (here
    an earlier translation stays whole), and the lines translated before the stop, written as
    they were made, are in OUTPUT.partial."""
    src = tmp_path / "big.en"
    src.write_bytes(("\n".join(sentences(3000, seed=1)) + "\n").encode() + b"\xc3\x28\n")
    out = tmp_path / "big.de"
    out.write_text("an earlier translation\n")
    result = cli(run, b"", "--input", str(src), "--output", str(out), "--beam", "1")
    assert result.returncode == 1
    assert "line 3001: byte 0xc3" in result.stderr.decode()
    assert "line/s" in result.stderr.decode() or "it/s" in result.stderr.decode()  # tqdm's bar
    assert out.read_text() == "an earlier translation\n"
    written = (tmp_path / "big.de.partial").read_text().splitlines()
    assert 1000 < len(written) <= 3000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_sigterm_keeps_what_was_translated_as_ctrl_c_does(run, tmp_path):
    """SIGTERM (a scheduler ending the job) mid-file: the output as it was, the finished lines
    in OUTPUT.partial, no temporary file, an empty lock record, one line, status 143."""
    src, out = tmp_path / "big.en", tmp_path / "big.de"
    src.write_text("\n".join(sentences(3000, seed=2)) + "\n")
    out.write_text("an earlier translation\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(run), "--input",
                             str(src), "--output", str(out), "--beam", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-") and p.stat().st_size]:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()
    lines = err.decode().strip().splitlines()
    assert lines[-1] == "terminated (SIGTERM)" and "Traceback" not in err.decode()
    assert lines[-2] == f"{out} is unchanged; the lines translated before the stop are in {out}.partial"
    assert out.read_text() == "an earlier translation\n"
    assert 0 < len((tmp_path / "big.de.partial").read_text().splitlines()) < 3000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert not (tmp_path / ".big.de.lock").exists()  # the lock goes with its holder


@pytest.mark.parametrize("closed", [0, 1])
def test_a_closed_stdin_or_stdout_is_one_line_naming_it(run, closed):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(run)],
                            stdin=subprocess.PIPE if closed else None, stdout=None if closed else subprocess.PIPE,
                            stderr=subprocess.PIPE, timeout=120,  # the device is not what this is about
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MT_EMULATE_CUDA": "0"},
                            preexec_fn=lambda: os.close(closed))
    assert result.returncode == 2
    line = result.stderr.decode().strip().splitlines()[-1]
    assert line.startswith(f"translate.py: error: {['stdin', 'stdout'][closed]} is closed and there is no "
                           f"--{['input', 'output'][closed]}")


def test_a_reader_that_goes_away_ends_the_translation_quietly(run):
    """translate.py | head -1: SIGPIPE's status, and no error."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(run), "--beam",
                             "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.close()  # the reader is gone before the first line
    _, err = proc.communicate(("\n".join(sentences(40, seed=3)) + "\n").encode(), timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE, err.decode()
    assert "error" not in err.decode() and "Traceback" not in err.decode()


@pytest.mark.parametrize("path", ["same", "link", "other-path", "hard-link"])
def test_the_input_as_output_is_refused_before_anything_is_written(run, tmp_path, path):
    src = tmp_path / "in.en"
    src.write_text("A dog runs.\nA man sits.\n")
    out = {"same": src, "link": tmp_path / "link.en", "other-path": tmp_path / "sub" / ".." / "in.en",
           "hard-link": tmp_path / "hard.en"}[path]
    (tmp_path / "sub").mkdir()
    if path == "link":
        out.symlink_to(src)
    if path == "hard-link":
        os.link(src, out)
    result = cli(run, b"", "--input", str(src), "--output", str(out))
    assert result.returncode == 2
    line = result.stderr.decode().strip().splitlines()[-1]  # after the emulated device's banner
    assert f"--output {out} is the input file" in line
    assert src.read_text() == "A dog runs.\nA man sits.\n"


@pytest.mark.parametrize("what", ["averaged.npz", "tokenizer"])
def test_the_model_or_tokenizer_as_output_is_refused(run, tmp_path, what):
    folder = tmp_path / "run"
    folder.mkdir()
    tiny_run(folder, seed=0)
    target = folder / "averaged.npz" if what == "averaged.npz" else next(folder.glob("spm-*.model"))
    before = target.read_bytes()
    result = cli(folder, b"A dog.\n", "--output", str(target))
    assert result.returncode == 2 and "writing it would destroy it" in result.stderr.decode().splitlines()[-1]
    assert target.read_bytes() == before


def test_an_output_in_a_missing_folder_is_one_line(run, tmp_path):
    result = cli(run, b"A dog.\n", "--output", str(tmp_path / "missing" / "out.de"))
    assert result.returncode == 2
    line = result.stderr.decode().strip().splitlines()[-1]
    assert "does not exist" in line and str(tmp_path / "missing") in line


def test_a_named_pipe_is_read_as_stdin_is(run, tmp_path):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(run), "--input",
                             str(fifo)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    with open(fifo, "w") as f:
        f.write("A dog runs.\n\nA man sits.\n")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().split("\n")
    assert len(lines) == 4 and lines[0] and lines[1] == "" and lines[2] and lines[3] == ""


def test_a_small_batch_budget_never_truncates(run):
    tok = data.Tokenizer(next(run.glob("*.model")))
    model = translate.load_model(str(run / "averaged.npz"), "cpu", tokenizer=tok)
    lines = ["A man in a blue shirt rides a bike.", "A dog.", "Two women sit on a bench in the park."]
    assert decoding.translate(model, tok, lines, beam_size=2, max_tokens=3) == decoding.translate(
        model, tok, lines, beam_size=2)


def test_the_model_loaded_is_named_and_a_missing_average_said(run, tmp_path):
    folder = tmp_path / "unfinished"
    folder.mkdir()
    tiny_run(folder, seed=0)
    (folder / "averaged.npz").rename(folder / "last.npz")
    result = cli(folder, b"A dog.\n")
    assert result.returncode == 0
    err = result.stderr.decode()
    assert "has no averaged.npz" in err and "using its last checkpoint" in err
    assert f"translate.py: {folder / 'last.npz'}: the last checkpoint" in err
    err = cli(run, b"A dog.\n").stderr.decode()
    assert "has no averaged.npz" not in err and f"translate.py: {run / 'averaged.npz'}" in err


def test_a_checkpoint_of_another_configuration_is_refused_with_the_run(run, tmp_path):
    import minitransformer as mt
    from minitransformer import nn

    config = load_checkpoint(str(run / "averaged.npz"), metadata_only=True).config
    other = nn.Transformer(nn.TransformerConfig(**{**config, "d_ff": 48}))
    save_checkpoint(str(tmp_path / "other.npz"), other, extra={"tokenizer": next(run.glob("*.model")).name})
    assert mt  # the tokenizer is shared: only the configuration tells them apart
    result = cli(run, b"A dog.\n", "--checkpoint", str(tmp_path / "other.npz"))
    assert result.returncode == 1
    (line,) = [x for x in result.stderr.decode().strip().splitlines() if "error" in x]
    assert "d_ff 48 (the run's: 32)" in line


def test_stdin_is_answered_line_by_line(run):
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(run)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for line in (b"A dog runs.\n", b"\n", b"A man sits in the park.\n"):
            proc.stdin.write(line)
            proc.stdin.flush()  # stdin stays open: the answer must come before the input ends
            assert select.select([proc.stdout], [], [], 60)[0], "no answer while stdin is open"
            answer = proc.stdout.readline()
            assert answer.endswith(b"\n") and (answer.strip() != b"") == (line.strip() != b"")
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_a_tokenizer_of_another_run_is_refused(run, tmp_path):
    other = tiny_run(tmp_path, seed=1)  # the same vocabulary size, other pieces
    tok = data.Tokenizer(next(other.glob("*.model")))
    assert tok.vocab_size == data.Tokenizer(next(run.glob("*.model"))).vocab_size
    with pytest.raises(SystemExit, match="was trained with the tokenizer spm-bpe60-0.model, not"):
        translate.main(["--checkpoint", str(run / "averaged.npz"), "--tokenizer", str(tok.path)])


def test_plot_attention_refuses_an_empty_sentence(run, capsys):
    with pytest.raises(SystemExit):
        plot_attention.main(["--run", str(run), "  "])
    assert "the sentence is empty" in capsys.readouterr().err


@pytest.mark.parametrize("layers, titles", [
    ("all", [f"layer {i}, head {j}" for i in (1, 2) for j in (1, 2, 3)]),
    ("last", ["layer 2, head 1", "layer 2, head 2", "layer 2, head 3"]),
])
def test_plot_attention_draws_every_layer_or_the_last_alone(monkeypatch, tmp_path, layers, titles):
    """--layers last: the last layer's heads only, two to a row (a cell left empty for an odd
    count), each map the last layer's own."""
    rng = np.random.default_rng(0)
    maps = [rng.random((3, 4, 5)) for _ in range(2)]  # 2 layers of 3 heads, T = 4, S = 5
    drawn = {}
    monkeypatch.setattr(plot_attention.files, "save_figure", lambda fig, path, **kw: drawn.setdefault("fig", fig))
    plot_attention.draw(maps, list("abcd"), list("vwxyz"), "t", str(tmp_path / "x.png"), layers=layers)
    panels = [ax for ax in drawn["fig"].axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == titles
    for ax, title in zip(panels, titles):
        i, j = (int(n) - 1 for n in title.replace(",", "").split()[1::2])
        np.testing.assert_array_equal(ax.get_images()[0].get_array(), maps[i][j])
    if layers == "last":
        assert drawn["fig"].axes[0].get_gridspec().get_geometry() == (2, 2)


def test_plot_attention_never_mixes_two_runs_in_one_folder(run, tmp_path, monkeypatch, capsys):
    """A second run into a folder being drawn into is refused; an earlier run's maps (a part of
    a longer text too) are replaced as a whole; a folder of other files is refused."""
    out = tmp_path / "maps"
    monkeypatch.setattr(plot_attention, "draw", lambda maps, rows, cols, title, path, *a: pathlib.Path(path).write_text("map"))
    with plot_attention.files.lock_output(out):  # another run draws into it
        with pytest.raises(plot_attention.files.FileInUse, match=str(out)):
            plot_attention.main(["--run", str(run), "--out", str(out), "--beam", "1", "A dog runs."])
    (out / "part-2").mkdir(parents=True)
    (out / "part-2" / "cross.png").write_text("an earlier run's")
    plot_attention.main(["--run", str(run), "--out", str(out), "--beam", "1", "A dog runs."])
    assert sorted(p.name for p in out.iterdir()) == sorted(plot_attention.MAPS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["maps"]  # no lock, no temporary folder left
    (out / "notes.txt").write_text("a user's")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        plot_attention.main(["--run", str(run), "--out", str(out), "--beam", "1", "A dog runs."])
    assert e.value.code == 2 and "notes.txt" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "a user's"


def test_beam_and_alpha_default_to_the_runs(run, tmp_path, monkeypatch):
    """train_wmt.py saves the beam and alpha it chose beside the averaged model; translate.py
    uses them unless told otherwise, and 4 and 0.6 for a checkpoint without them."""
    ours = tmp_path / "ours"
    ours.mkdir()
    tiny_run(ours, seed=0)
    ckpt = load_checkpoint(str(ours / "averaged.npz"))
    save_checkpoint(str(ours / "averaged.npz"), translate.model_from(ckpt, "averaged.npz", "cpu"),
                    extra={**ckpt.extra, "beam": 3, "alpha": 1.7})
    seen = []
    monkeypatch.setattr(translate, "translate",
                        lambda model, tok, lines, device, beam, alpha, *a, **k: seen.append((beam, alpha)) or lines)
    src = tmp_path / "in.en"
    src.write_text("A dog runs.\n")
    for folder, flags in ((ours, []), (ours, ["--beam", "2", "--alpha", "0"]), (run, [])):
        translate.main(["--run", str(folder), "--input", str(src), "--output", str(tmp_path / "out.de"), *flags])
    assert seen == [(3, 1.7), (2, 0.0), (4, 0.6)]


@pytest.mark.slow  # issue 77's budget
def test_plot_attention_draws_the_runs_translation_a_row_per_piece_predicted(run, tmp_path, monkeypatch):
    """The maps are of the translation translate.py gives (the run's beam, alpha and length
    penalty, unless told otherwise), and a decoder map's row t is labelled with the piece that
    position predicts: the translation's pieces, then EOS."""
    ours = tmp_path / "ours"
    ours.mkdir()
    tiny_run(ours, seed=0)
    ckpt = load_checkpoint(str(ours / "averaged.npz"))
    save_checkpoint(str(ours / "averaged.npz"), translate.model_from(ckpt, "averaged.npz", "cpu"),
                    extra={**ckpt.extra, "beam": 3, "alpha": 1.7, "length_penalty": "fairseq"})
    searched, drawn = [], {}
    real_search = plot_attention.beam_search
    monkeypatch.setattr(plot_attention, "beam_search", lambda model, src, **k: searched.append(k) or real_search(model, src, **k))
    monkeypatch.setattr(plot_attention, "draw", lambda maps, rows, cols, title, *a: drawn.__setitem__(title, (rows, cols)))
    for flags in ([], ["--beam", "2", "--alpha", "0", "--length-penalty", "gnmt"]):
        plot_attention.main(["--run", str(ours), "--out", str(tmp_path / "maps"), "A dog runs.", *flags])
    assert [(k["beam_size"], k["alpha"], k["length_penalty"]) for k in searched] == [(3, 1.7, "fairseq"), (2, 0.0, "gnmt")]
    tok = data.Tokenizer(str(next(ours.glob("*.model"))))  # the maps of the second: beam 2, alpha 0
    (hypothesis,) = real_search(translate.load_model(str(ours / "averaged.npz"), "cpu"),
                                np.array([tok.encode(["A dog runs."])[0] + [data.EOS_ID]]), beam_size=2, alpha=0.0)
    predicted = tok.id_to_piece(hypothesis + [data.EOS_ID])
    assert drawn["encoder-decoder attention"][0] == predicted
    assert drawn["decoder self-attention (causal)"] == (predicted, tok.id_to_piece([data.BOS_ID] + hypothesis))


def test_a_truncated_checkpoint_is_one_line(run, tmp_path):
    folder = tmp_path / "cut"
    folder.mkdir()
    tiny_run(folder, seed=0)
    ckpt = folder / "averaged.npz"
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])  # a full disk, a copy cut short
    result = cli(folder, b"A dog.\n")
    assert result.returncode == 1 and "Traceback" not in result.stderr.decode()
    line = result.stderr.decode().strip().splitlines()[-1]
    assert line.startswith(f"error: {ckpt}") and "truncated" in line


def test_a_checkpoint_with_non_finite_weights_is_refused_in_one_line(run, tmp_path):
    weights = dict(np.load(run / "averaged.npz"))
    name = sorted(k for k in weights if k.startswith("model/") and weights[k].ndim == 2)[0]
    weights[name] = weights[name].copy()
    weights[name].flat[3] = np.nan
    with open(tmp_path / "nan.npz", "wb") as f:
        np.savez(f, **weights)
    result = cli(run, b"A dog runs.\n", "--checkpoint", str(tmp_path / "nan.npz"))
    err = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in err and result.stdout == b""
    assert err.strip().splitlines()[-1] == (f"error: {tmp_path / 'nan.npz'}: the weight {name.removeprefix('model/')} "
                                            f"is not finite in float32 (1 of {weights[name].size} values NaN, "
                                            f"infinite or beyond its range); "
                                            f"refusing to use it")


@pytest.mark.parametrize("program", ["translate", "plot_attention", "tune_decoding", "translate_speed",
                                     "export_ctranslate2"])
def test_a_beam_wider_than_the_vocabulary_is_refused_in_one_line(run, program, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = __import__(program)
    argv = {"plot_attention": ["A dog runs."], "tune_decoding": ["--data-dir", "nowhere"]}.get(program, [])
    with pytest.raises(SystemExit) as e:
        module.main(["--run", str(run), "--beam", "61", *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --beam 61: wider than the target vocabulary (60 tokens) (see --help)")


def test_train_wmt_refuses_a_beam_wider_than_its_vocabulary(capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    import train_wmt

    assert train_wmt.parse_args(["--vocab-size", "300", "--beam", "300"]).beam == 300
    with pytest.raises(SystemExit):
        train_wmt.parse_args(["--vocab-size", "300", "--beam", "301"])
    assert "--beam 301: wider than the target vocabulary (300 tokens)" in capsys.readouterr().err


def plot(run, sentence: str, out) -> subprocess.CompletedProcess:
    """plot_attention.py under a 3 GB address-space limit: a text it would blow up on fails
    here instead of swapping."""
    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run([sys.executable, str(ROOT / "examples" / "plot_attention.py"), "--run", str(run),
                           "--out", str(out), "--beam", "1", sentence], capture_output=True, text=True,
                          timeout=300, preexec_fn=limit,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "MT_EMULATE_CUDA": "0"})


@pytest.mark.slow  # a long decoding
def test_plot_attention_draws_a_long_text_sentence_by_sentence(run, tmp_path):
    text = " ".join(["A man runs in the park."] * 3)  # past the 32 positions
    result = plot(run, text, tmp_path / "maps")
    assert result.returncode == 0, result.stderr
    parts = sorted(p.name for p in (tmp_path / "maps").iterdir())
    assert parts == ["part-1", "part-2", "part-3"]
    assert all((tmp_path / "maps" / p / name).is_file() for p in parts
               for name in ("encoder_self.png", "decoder_self.png", "cross.png"))


def test_plot_attention_refuses_a_sentence_longer_than_the_positions_in_one_line(run, tmp_path):
    result = plot(run, " ".join(["water"] * 500), tmp_path / "maps")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "the sentence has" in line and "more than the model's 32 positions" in line
    assert not (tmp_path / "maps").exists()


def test_a_second_translation_into_the_same_output_is_refused_in_one_line(run, tmp_path):
    out = tmp_path / "out.de"
    first = subprocess.Popen([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(run),
                              "--output", str(out)], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        lock = tmp_path / ".out.de.lock"
        for _ in range(600):  # the first holds the output (its lock names it) while it waits for stdin
            if lock.exists() and lock.read_text().startswith(f"pid {first.pid} "):
                break
            assert first.poll() is None, first.stderr.read()
            select.select([], [], [], 0.05)
        second = cli(run, b"A dog runs.\n", "--output", str(out))
        assert second.returncode == 1
        line = second.stderr.decode().strip().splitlines()[-1]
        assert line.startswith(f"error: {out} is being written by another process (pid {first.pid} ")
        other = cli(run, b"A dog runs.\n", "--output", str(tmp_path / "other.de"))  # another file: allowed
        assert other.returncode == 0 and (tmp_path / "other.de").read_text().count("\n") == 1
        first.communicate(b"A man sits.\n", timeout=120)
        assert first.returncode == 0 and out.read_text().count("\n") == 1 and not lock.exists()
    finally:
        first.kill()


def cut_short(result, out: pathlib.Path, whole: list[str]) -> None:
    """A translation stopped by a write that failed: one error line naming the output, which is
    not made; what was finished, in whole lines, in OUTPUT.partial, as the message says."""
    err = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in err, err
    (line,) = [e for e in err.splitlines() if e.startswith("error")]
    assert str(out) in line
    partial = pathlib.Path(f"{out}.partial").read_text().splitlines(keepends=True)
    assert f"{out}.partial" in err and 0 < len(partial) < len(whole) and partial == whole[:len(partial)]
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.slow  # three translations of a file
def test_a_full_disk_or_a_file_size_limit_mid_write_leaves_whole_lines(run, tmp_path):
    src = tmp_path / "in.en"
    src.write_text("\n".join(sentences(300, seed=4)) + "\n")  # 25 kB of translations
    whole = cli(run, src.read_bytes(), "--beam", "1").stdout.decode().splitlines(keepends=True)
    with tmpfs(tmp_path / "disk", "size=256k") as disk:
        fill(disk, leave=8192)
        out = disk / "out.de"
        cut_short(cli(run, b"", "--input", str(src), "--output", str(out), "--beam", "1"), out, whole)
    out = tmp_path / "limited.de"
    limited = subprocess.run([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(run), "--input",
                              str(src), "--output", str(out), "--beam", "1"], capture_output=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)},
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192)))  # ulimit -f
    cut_short(limited, out, whole)


@pytest.mark.slow  # a translation killed, and another
def test_what_a_killed_translation_left_is_removed_by_the_next_one_into_the_folder(run, tmp_path):
    """kill -9 leaves the temporary output and the lock (no handler runs); the next translation
    into that folder, of another file too, removes them, saying so once."""
    src, out = tmp_path / "big.en", tmp_path / "big.de"
    src.write_text("\n".join(sentences(3000, seed=5)) + "\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "translate.py"), "--run", str(run), "--input",
                             str(src), "--output", str(out), "--beam", "1"], stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-") and p.stat().st_size]:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert len(left) == 2 and ".big.de.lock" in left  # and .tmp-big.de-@host:pid...
    other = cli(run, b"A dog runs.\n", "--output", str(tmp_path / "other.de"))
    assert other.returncode == 0
    said = [line for line in other.stderr.decode().splitlines() if all(name in line for name in left)]
    assert len(said) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.en", "other.de"]
