"""Fault injection against train_wmt.py, as a user meets faults: an interrupt at a step drawn
at random (its seed printed), a full disk, a read-only folder, two runs into one folder, a run
that diverges, and training data that changed under a resumed run. Each ends in one line that
says what happened and what to do, and loses nothing that was saved. (Bad option values:
tests/test_cli.py tries every option of every program.)"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import pathlib
import random
import shlex
import signal
import subprocess
import sys
import time

import pytest

from minitransformer import files
from minitransformer.checkpoint import load_checkpoint, verify_checkpoint
from tests.examples.test_train_wmt import SMALL, losses, one_line_error, train_wmt
from tests.helpers import MULTI30K_DIR as DATA
from tests.helpers import needs_multi30k, tmpfs

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [needs_multi30k, pytest.mark.slow]  # whole runs, interrupted and damaged
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def start(args, **kwargs) -> subprocess.Popen:
    # SIGINT back to its default in the child: a shell's background job (pytest started with &)
    # ignores it, Python then never installs KeyboardInterrupt, and Ctrl-C's test saw exit 0
    return subprocess.Popen([sys.executable, str(ROOT / "examples" / "train_wmt.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def wait_for(condition, what: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (status {proc.returncode}) before {what}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def logged_step(out_dir: pathlib.Path) -> int:
    try:
        rows = [json.loads(line) for line in open(out_dir / "train.jsonl") if line.endswith("\n")]
    except FileNotFoundError:
        return 0
    return max((r["step"] for r in rows if r["kind"] == "train"), default=0)


def test_an_interrupt_at_a_random_step_ends_in_one_line_and_resumes_exactly(tmp_path):
    """With --accumulate 2, so that the interrupt may come between a step's two micro-batches:
    the resumed run does that step again from its first."""
    seed = random.randrange(1 << 16)
    at = random.Random(seed).randrange(4, 11)  # past the first checkpoint (step 3), before the end
    why = f"interrupt seed {seed}: SIGINT at step {at}"
    print(why)  # shown with a failure, to replay it
    straight, split = tmp_path / "straight", tmp_path / "split"
    args = SMALL + ["--max-steps", "12", "--accumulate", "2"]
    proc = start(args + ["--out-dir", str(split)])
    wait_for(lambda: logged_step(split) >= at, f"step {at}", proc)
    proc.send_signal(signal.SIGINT)  # as Ctrl-C does
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, why
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err, why
    assert last.startswith("interrupted: continue with: python ") and last.endswith(" --resume"), (why, last)
    command = shlex.split(last.removeprefix("interrupted: continue with: "))
    assert command[1].endswith("train_wmt.py") and command[2:-1] == args + ["--out-dir", str(split)], why

    train_wmt.main(command[2:])  # the printed command, in this process
    train_wmt.main(args + ["--out-dir", str(straight)])
    assert losses(split) == losses(straight), why


def test_a_full_disk_ends_in_one_line_and_the_run_resumes_once_there_is_room(tmp_path):
    with tmpfs(tmp_path / "disk", "size=1200k") as disk:
        out = disk / "run"
        with pytest.raises(SystemExit, match=r"^error: No space left on device: .*/run/") as e:
            train_wmt.main(SMALL + ["--out-dir", str(out), "--max-steps", "60"])
        one_line_error(e)
        assert not [p for p in out.iterdir() if p.name.startswith(files.PREFIX)]  # no half-written file
        verify_checkpoint(str(out / "last.npz"))  # what was saved is whole
        reached = load_checkpoint(str(out / "last.npz"), metadata_only=True).extra["step"]
        assert 3 <= reached < 60
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        result = train_wmt.main(SMALL + ["--out-dir", str(out), "--max-steps", "60", "--resume"])
        assert result["steps"] == 60 and sorted(losses(out)) == list(range(1, 61))


def test_a_read_only_folder_is_refused_in_one_line_before_anything_runs(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=64k") as folder:
        with pytest.raises(SystemExit) as e:
            train_wmt.main(SMALL + ["--out-dir", str(folder), "--max-steps", "3"])
        assert e.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"argument --out-dir: cannot write {folder}: Read-only file system: {folder}" in line


def test_a_second_run_into_a_folder_in_use_is_refused_from_its_first_moment(tmp_path, caplog):
    out = tmp_path / "run"
    first = start(SMALL + ["--out-dir", str(out), "--max-steps", "500", "--eval-every", "400"])
    try:
        wait_for(lambda: (out / files.LOCK_NAME).is_file() and (out / files.LOCK_NAME).read_text(), "lock", first)
        for extra in ([], ["--resume"]):  # before any checkpoint exists, and with --resume
            with pytest.raises(SystemExit, match=rf"^error: {out} is in use by another run \(pid {first.pid} on ") as e:
                train_wmt.main(SMALL + ["--out-dir", str(out), "--max-steps", "3", *extra])
            one_line_error(e)
        wait_for(lambda: logged_step(out) >= 1, "a step of the first run", first)
    finally:
        first.kill()  # kill -9: no chance to release the lock
        first.communicate(timeout=60)
    assert (out / files.LOCK_NAME).read_text().startswith(f"pid {first.pid} ")  # left behind
    assert not (out / "last.npz").exists()  # killed before its first checkpoint (step 400)
    with caplog.at_level(logging.WARNING, logger="train_wmt"):  # the kernel dropped the lock with its process
        assert train_wmt.main(SMALL + ["--out-dir", str(out), "--max-steps", "3"])["steps"] == 3
    assert f"held by a run that ended without releasing it (pid {first.pid} on " in caplog.text
    assert (out / files.LOCK_NAME).read_text() == ""  # released


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # it overflows on purpose
@pytest.mark.parametrize("peak_lr, why", [  # SMALL's schedule peaks at factor * (32 * 10)^-0.5
    ("5e4", r"grown without bound"),  # every loss finite, climbing away
    ("5e18", r"the validation loss is nan"),  # one step destroys the model: every later loss is NaN
    ("5e43", r"100 steps in a row were skipped \(the last for an update that would overflow the weights\)"),
])
def test_a_diverging_run_stops_in_one_line_and_keeps_its_last_good_checkpoint(tmp_path, peak_lr, why):
    with pytest.raises(SystemExit, match=rf"^error: training diverged at step \d+: .*{why}") as e:
        train_wmt.main(SMALL + ["--out-dir", str(tmp_path), "--max-steps", "400", "--eval-every", "5",
                                "--peak-lr", peak_lr])
    message = one_line_error(e)
    if (tmp_path / "last.npz").exists():
        good = load_checkpoint(str(tmp_path / "last.npz"), metadata_only=True).extra["step"]
        assert f"Its last good checkpoint, of step {good}, is {tmp_path / 'last.npz'}" in message
    else:
        assert "It wrote no checkpoint before it diverged" in message
    assert "lower --peak-lr" in message
    assert not (tmp_path / "averaged.npz").exists() and not (tmp_path / "bleu.json").exists()


def copy_of_the_corpus(folder: pathlib.Path, n: int = 300) -> pathlib.Path:
    folder.mkdir()
    for f in DATA.glob("*.gz"):
        with gzip.open(f, "rt", encoding="utf-8") as src:
            lines = list(itertools.islice(src, n))
        with gzip.open(folder / f.name, "wt", encoding="utf-8") as out:
            out.writelines(lines)
    return folder


def test_resuming_on_other_training_data_is_refused_before_anything_is_written(tmp_path):
    corpus = copy_of_the_corpus(tmp_path / "corpus")
    args = SMALL[2:] + ["--data-dir", str(corpus), "--out-dir", str(tmp_path / "run")]
    train_wmt.main(args + ["--max-steps", "3"])
    with gzip.open(corpus / "train.en.gz", "rt", encoding="utf-8") as f:
        lines = f.readlines()
    lines[7] = "A sentence that was not there when the run began.\n"
    with gzip.open(corpus / "train.en.gz", "wt", encoding="utf-8") as f:
        f.writelines(lines)
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with pytest.raises(SystemExit, match=r"^error: .*last\.npz was trained on other data than 300 pairs of ") as e:
        train_wmt.main(args + ["--max-steps", "6", "--resume"])
    one_line_error(e)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


def test_a_bad_max_tokens_is_refused_before_anything_is_read_or_written(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --max-tokens 50 shared among 1 ranks gives each 50, fewer") as e:
        train_wmt.main(SMALL + ["--max-tokens", "50", "--out-dir", str(tmp_path / "run")])
    one_line_error(e)
    assert not (tmp_path / "run").exists()
