"""examples/score.py: a hypothesis file's three BLEU figures, a line each."""

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minitransformer.bleu import bleu, bleu_literature, bleu_lowercased
from minitransformer.data.moses import moses_lc

SCORE = Path(__file__).resolve().parents[2] / "examples" / "score.py"
HYPS = ["ein Mann fährt mit einem Fahrrad.", "Zwei Kinder sagen hallo."]
REFS = ["Ein Mann fährt mit dem Fahrrad.", 'Zwei Kinder sagen "Hallo".']


def score(*args):
    return subprocess.run([sys.executable, str(SCORE), *map(str, args)], capture_output=True, text=True, timeout=60)


def figures(stdout: str) -> dict:
    return dict(line.split(": ", 1) for line in stdout.splitlines()[:3])


def test_three_figures_each_on_its_line(tmp_path):
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de.gz"
    hyp.write_text("\n".join(HYPS) + "\n")
    ref.write_bytes(gzip.compress(("\n".join(REFS) + "\n").encode()))
    out = score(hyp, ref)
    assert out.returncode == 0, out.stderr
    assert figures(out.stdout) == {"cased": f"{bleu(HYPS, REFS)[0]:.2f}",
                                   "lowercased": f"{bleu_lowercased(HYPS, REFS)[0]:.2f}",
                                   "literature": f"{bleu_literature(HYPS, REFS)[0]:.2f}"}
    assert "literature signature: lowercased+normalized+tokenized" in out.stdout


def test_moses_tokens_are_scored_as_they_are_and_have_no_cased_figure(tmp_path):
    hyp, ref = tmp_path / "hyp.tok.de", tmp_path / "ref.de"
    tokens = moses_lc(HYPS, "de")
    hyp.write_text("\n".join(tokens) + "\n")
    ref.write_text("\n".join(REFS) + "\n")
    got = figures(score("--tokenized", hyp, ref).stdout)
    assert got["cased"] == "n/a"
    assert got["literature"] == f"{bleu_literature(tokens, moses_lc(REFS, 'de'), tokenized=True)[0]:.2f}"
    assert float(got["literature"]) == pytest.approx(bleu_literature(HYPS, REFS)[0], abs=0.005)


def test_files_of_different_lengths_are_one_line_naming_both(tmp_path):
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
    hyp.write_text(HYPS[0] + "\n")
    ref.write_text("\n".join(REFS) + "\n")
    out = score(hyp, ref)
    assert out.returncode == 1 and out.stdout == ""
    last = out.stderr.strip().splitlines()[-1]  # after the emulated device's banner
    assert last == f"error: {hyp} has 1 lines but {ref} has 2: one translation a reference, line by line"
    assert "Traceback" not in out.stderr
    missing = score(tmp_path / "none.de", ref)  # refused when parsed
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1] == (
        f"score.py: error: argument hyp: {tmp_path / 'none.de'}: no such file (see --help)")


def test_a_pipe_is_read_and_a_folder_refused_in_one_line(tmp_path):
    """score.py <(gunzip -c hyp.gz) ref: the hypotheses may come through a pipe, read once."""
    ref, fifo = tmp_path / "ref.de", tmp_path / "hyp.fifo"
    ref.write_text("\n".join(REFS) + "\n")
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, str(SCORE), str(fifo), str(ref)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    with open(fifo, "w") as f:
        f.write("\n".join(HYPS) + "\n")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert figures(out)["cased"] == f"{bleu(HYPS, REFS)[0]:.2f}"
    folder = score(tmp_path, ref)
    assert folder.returncode == 2 and folder.stderr.strip().splitlines()[-1] == (
        f"score.py: error: argument hyp: {tmp_path} is a folder, not a file (see --help)")


def test_an_unknown_language_is_refused_in_one_line(tmp_path, capsys):
    sys.path.insert(0, str(SCORE.parent))
    import score as program

    hyp = tmp_path / "hyp.de"
    hyp.write_text("\n".join(HYPS) + "\n")
    with pytest.raises(SystemExit) as e:
        program.main([str(hyp), str(hyp), "--lang", "zz"])
    (line,) = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and "--lang" in line and "zz" in line
