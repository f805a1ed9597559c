"""minitransformer.cli, and every command-line program of the project read through it: each
numeric option refuses nan, inf, negatives and what its program cannot use, at parse time, in
one line naming the option; ordinary failures end in one line."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import pathlib
import re
import resource
import signal
import subprocess
import sys

import pytest

from minitransformer import backend, cli, files

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("examples", "benchmarks", "docs", "tools/kernels",
           *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "experiments").iterdir() if p.is_dir()))
for folder in FOLDERS:
    sys.path.insert(0, str(ROOT / folder))

PROGRAMS = ["train_wmt", "translate", "export_ctranslate2", "tune_decoding", "ablations", "copy_task",
            "tour", "plot_attention", "train_step", "translate_speed", "attn", "allreduce", "bpe_dropout", "mutants", "wmt_scale",
            "bleu_tokens", "bleu_minutes", "recipe", "subwords", "reproduction", "ncu_counts", "score", "build", "figures",
            "trained", "render", "prebuilt", "why_self_attention", "minitransformer.data.download"]


def test_every_program_has_a_parser_to_read():
    """Every script of examples/, benchmarks/, docs/, tools/kernels/ and experiments/*/ that parses
    options is in PROGRAMS."""
    scripts = {p.stem for folder in FOLDERS for p in (ROOT / folder).glob("*.py") if "add_argument(" in p.read_text()}
    assert scripts <= set(PROGRAMS), scripts - set(PROGRAMS)


def options_of(program: str, kind) -> list[str]:
    """The options of ``program`` whose values ``kind`` (a cli type) reads."""
    parser = importlib.import_module(program).build_parser()
    return [a.option_strings[0] for a in parser._actions if a.type is kind]


def one_line_parse_error(program: str, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        importlib.import_module(program).build_parser().parse_args(argv)
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


def test_every_device_option_and_output_is_checked_when_parsed():
    """No program takes --device, or a path it writes, without the cli type that checks it."""
    for program in PROGRAMS:
        for action in importlib.import_module(program).build_parser()._actions:
            name = action.option_strings[0] if action.option_strings else action.dest
            if name == "--device":
                assert action.type is cli.device, program
            if name in ("--out", "--out-dir", "--output", "--json", "--report", "--results", "--dest"):
                assert action.type in (cli.output_file, cli.output_or_stdout, cli.output_folder), (program, name)


@pytest.mark.parametrize("program", [p for p in PROGRAMS if options_of(p, cli.device)])
def test_a_device_that_cannot_be_used_is_refused_in_one_line(program, monkeypatch, capsys):
    monkeypatch.setattr(backend, "_cupy", None)  # as on a machine without CuPy
    line = one_line_parse_error(program, ["--device", "cuda"], capsys)
    assert "--device" in line and "needs CuPy" in line and line.endswith("(see --help)")


@pytest.mark.parametrize("program, option, kind", [
    (p, option, kind) for p in PROGRAMS for kind in (cli.output_file, cli.output_or_stdout, cli.output_folder)
    for option in options_of(p, kind)])
def test_an_output_that_cannot_be_written_is_refused_in_one_line(program, option, kind, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    refused = {tmp_path / "a-file" / "x": "is not a folder", tmp_path / "dangling": "dangling symbolic link"}
    refused[tmp_path / ("a-file" if kind is cli.output_folder else "a-folder")] = (
        "is not a folder" if kind is cli.output_folder else "is a folder")
    for path, why in refused.items():
        line = one_line_parse_error(program, [option, str(path)], capsys)
        assert option in line and str(path) in line and why in line, line


def test_output_types_take_what_can_be_written(tmp_path):
    assert cli.output_file(str(tmp_path / "new" / "deeper" / "x.json")) == str(tmp_path / "new" / "deeper" / "x.json")
    assert cli.output_folder(str(tmp_path)) == str(tmp_path)
    (tmp_path / "old.txt").write_text("kept")
    assert cli.output_file(str(tmp_path / "old.txt")) == str(tmp_path / "old.txt")
    assert (tmp_path / "old.txt").read_text() == "kept" and not (tmp_path / "new").exists()  # nothing made


def accepts(parse, text: str) -> bool:
    try:
        parse(text)
    except argparse.ArgumentTypeError:
        return False
    return True


def in_range(kind, value: float) -> bool:
    low_ok = value > kind.low or (value == kind.low and not kind.low_open)
    high_ok = kind.high is None or value < kind.high or (value == kind.high and not kind.high_open)
    return low_ok and high_ok


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_numeric_option_is_checked_when_parsed(program):
    parser = importlib.import_module(program).build_parser()
    assert isinstance(parser, cli.ArgumentParser)
    numeric = 0
    for action in parser._actions:
        assert action.type not in (int, float, re.compile), \
            f"{program} {action.option_strings}: an unchecked {action.type} (cli.integer, cli.real, cli.regex)"
        if not hasattr(action.type, "kind"):  # not a number (a path, a choice)
            continue
        kind = getattr(action.type, "element", action.type)  # a list of numbers: each is checked
        assert kind.kind in ("integer", "real"), f"{program} {action.option_strings}"
        numeric += 1
        assert kind.low is not None, f"{program} {action.option_strings}: no option takes any negative number"
        assert kind.high is not None, \
            f"{program} {action.option_strings}: every option has a largest value the code can compute with"
        good = kind.low + 1 if kind.kind == "integer" else (kind.low + kind.high) / 2
        wrap = (lambda v: f"{good},{v}") if kind is not action.type else (lambda v: v)  # a good first element
        for text in ("nan", "inf", "-inf"):
            assert not accepts(action.type, wrap(text)), f"{program} {action.option_strings} took {text}"
        for value in (0, -1, kind.high, 10**30 if kind.kind == "integer" else 1e308):
            assert accepts(action.type, wrap(str(value))) == in_range(kind, value), \
                f"{program} {action.option_strings} at {value}"
    assert numeric or program in ("plot_attention", "build", "figures", "render", "bleu_tokens", "recipe", "reproduction",
                                  "score", "ncu_counts", "why_self_attention")  # none takes a number


@pytest.mark.parametrize("program, argv", [
    ("mutants", ["--match", "("]), ("train_wmt", ["--alpha", "1e308"]), ("train_wmt", ["--alpha", "nan"]), ("train_wmt", ["--max-tokens", "0"]), ("translate", ["--alpha", "inf"]),
    ("translate", ["--max-tokens", "0"]), ("tune_decoding", ["--run", ".", "--data-dir", "y", "--beam", "4,0"]),
])
def test_a_bad_option_is_one_line_naming_it(program, argv, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(program).build_parser().parse_args(argv)
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert argv[-2] in line and argv[-1].split(",")[-1] in line and line.endswith("(see --help)")


def test_help_shows_defaults_but_not_unset_ones(capsys):
    with pytest.raises(SystemExit):
        importlib.import_module("train_wmt").build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("data/<corpus>") == 1 and "(default: 20)" in text  # --log-every's


def test_integer_and_real_bounds():
    assert cli.integer(1)("3") == 3 and not accepts(cli.integer(1), "0") and not accepts(cli.integer(1), "2.5")
    assert not accepts(cli.integer(0, 4), "5") and accepts(cli.integer(0, 4), "4")
    p = cli.real(0.0, 1.0, high_open=True)
    assert p("0") == 0.0 and not accepts(p, "1") and accepts(p, "0.999")
    assert not accepts(cli.real(0.0, low_open=True), "0") and cli.real(0.0, low_open=True)("1e-30") == 1e-30
    assert not accepts(cli.real(), "nan") and not accepts(cli.real(), "1e400")  # inf by overflow
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be a number > 0.0$"):
        cli.real(0.0, low_open=True)("-2")


def fails_with(exc):
    def main(argv):
        raise exc
    return main


def test_run_tells_ordinary_failures_in_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.run(fails_with(KeyboardInterrupt()), [], on_interrupt=lambda: "continue with: x --resume")
    assert e.value.code == 130 and capsys.readouterr().err.strip() == "interrupted: continue with: x --resume"
    with pytest.raises(SystemExit) as e:
        cli.run(fails_with(KeyboardInterrupt()), [], on_interrupt=lambda: False)  # another rank speaks
    assert e.value.code == 130 and capsys.readouterr().err == ""

    # A full disk: the write fails, then so does the cleanup; the first error names the file.
    full = OSError(errno.ENOSPC, "No space left on device")
    full.filename = str(tmp_path / "ckpt-30.npz")
    try:
        try:
            raise full
        except OSError:
            raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as chained:
        with pytest.raises(SystemExit, match=f"^error: No space left on device: {full.filename}$"):
            cli.run(fails_with(chained), [])

    class BadCorpus(ValueError):
        pass

    with pytest.raises(SystemExit, match="^error: line 3 is bad$"):
        cli.run(fails_with(BadCorpus("line 3 is bad")), [], user_errors=(BadCorpus,))
    with pytest.raises(BadCorpus):  # --debug: the traceback
        cli.run(fails_with(BadCorpus("line 3 is bad")), ["--debug"], user_errors=(BadCorpus,))
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        cli.run(fails_with(ZeroDivisionError()), [])


def test_an_interrupt_that_no_except_sees_leaves_no_temporary_file(tmp_path, monkeypatch, capsys):
    """Ctrl-C or SIGTERM raised just after mkstemp made an atomic write's temporary file, before
    atomic_write's try: cli.run removes what the write left (an MPI rank 0 ends by MPI_Abort,
    so no finaliser would)."""
    real_open = os.open

    def interrupted_open(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if os.path.basename(path).startswith(files.PREFIX):
            raise KeyboardInterrupt  # the signal's handler, run at the next line
        return fd

    def main(argv):
        (tmp_path / "kept.txt").write_text("someone else's")
        with files.atomic_write(tmp_path / "ckpt-2.npz", "wb") as f:
            f.write(b"weights")

    monkeypatch.setattr(os, "open", interrupted_open)
    with pytest.raises(SystemExit) as e:
        cli.run(main, [])
    assert e.value.code == cli.INTERRUPTED and capsys.readouterr().err.strip() == "interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]


@pytest.mark.parametrize("script, argv", [("benchmarks/train_step.py", ["--vocab", "100000000", "--steps", "1"]),
                                          ("examples/copy_task.py", ["--vocab", "100000000"])])
def test_sizes_that_cannot_be_allocated_end_in_one_line(script, argv):
    """Under a 4 GB address-space limit, so that the test fails rather than swaps if a program
    ever tries to fill what it asks for."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    run = subprocess.run([sys.executable, str(ROOT / script), *argv], capture_output=True, text=True, timeout=120,
                         preexec_fn=limit, env={**os.environ, "PYTHONPATH": str(ROOT), "MT_EMULATE_CUDA": "0"})
    assert run.returncode == 1, run.stderr
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith("error: out of memory: Unable to allocate") and "(100000000," in run.stderr


def test_run_tells_memory_and_device_failures_in_one_line():
    with pytest.raises(SystemExit, match="^error: out of memory$"):
        cli.run(fails_with(MemoryError()), [])
    with pytest.raises(SystemExit, match="^error: device 'cuda' needs CuPy"):
        cli.run(fails_with(backend.DeviceUnavailable("device 'cuda' needs CuPy")), [])


TERMINATED_PROGRAM = """
import os, signal, sys, time
from minitransformer import cli

def main(argv):
    try:
        print("ready", flush=True)
        time.sleep(60)
    finally:
        open(sys.argv[1], "w").write("cleaned up")  # what a program's cleanup does on Ctrl-C

cli.run(main, [], on_interrupt=lambda: "continue with: prog --resume")
"""


@pytest.mark.parametrize("signum, ignored", [("SIGTERM", False), ("SIGHUP", False), ("SIGHUP", True)])
def test_sigterm_and_sighup_end_a_program_as_ctrl_c_does(tmp_path, signum, ignored):
    """A scheduler's SIGTERM and a closed terminal's SIGHUP get Ctrl-C's cleanup and its one
    line, with the status 128 + the signal; a signal ignored at the start (nohup) stays so."""
    number = getattr(signal, signum)
    marker = tmp_path / "cleanup"
    proc = subprocess.Popen([sys.executable, "-c", TERMINATED_PROGRAM, str(marker)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=lambda: signal.signal(number, signal.SIG_IGN if ignored else signal.SIG_DFL))
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(number)
    if ignored:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.5)
        proc.kill()
        proc.wait()
        assert not marker.exists()
        return
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + number
    assert err.strip().splitlines()[-1] == f"terminated ({signum}): continue with: prog --resume"
    assert "Traceback" not in err and marker.read_text() == "cleaned up"


def test_a_removed_option_stops_in_one_line_naming_what_took_its_place(capsys):
    p = cli.ArgumentParser(prog="x")
    p.add_argument("--limit", type=cli.integer(1))
    p.add_removed("--limit-train", "--limit N")
    p.add_removed("--time-budget", "removed: runs end at their steps")
    assert vars(p.parse_args(["--limit", "3"])) == {"limit": 3}  # nothing of the removed ones
    for argv, said in ((["--limit-train", "300"], "--limit-train was replaced by --limit N"),
                       (["--limit-train=300"], "--limit-train was replaced by --limit N"),
                       (["--limit", "3", "--time-budget"], "--time-budget was removed: runs end at their steps")):
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        assert e.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert said in line
    assert "--limit-train" not in p.format_help()


@pytest.mark.parametrize("program", [p for p in PROGRAMS if importlib.import_module(p).build_parser().removed])
def test_every_program_s_removed_options_name_their_replacement(program, capsys):
    parser = importlib.import_module(program).build_parser()
    for flag, replacement in parser.removed.items():
        line = one_line_parse_error(program, [flag, "1"], capsys)
        assert flag in line and replacement in line
        assert flag not in parser.format_help()


def test_every_program_holds_signals_from_its_first_line_until_run_ends_it_in_one_line():
    """A Ctrl-C while a program's imports load (up to seconds) waits for cli.run (cli.PREAMBLE);
    a module run with -m loads the package first, and has nothing to hold."""
    for program in PROGRAMS:
        source = pathlib.Path(importlib.import_module(program).__file__).read_text()
        assert "cli.run" in source, f"{program}: every program ends through cli.run"
        if not program.startswith("minitransformer."):
            assert "from __future__ import annotations\n\n" + cli.PREAMBLE in source, \
                f"{program}: its first lines must be cli.PREAMBLE"


def test_a_reader_of_stdout_gone_ends_a_program_quietly_as_a_pipe_s_writer(monkeypatch, capsys):
    """One rule for every program (cli.run): ``... | head`` ends it with 128 + SIGPIPE and says
    nothing; a broken pipe that is not stdout's is an error like any other."""
    read, write = os.pipe()
    os.close(read)
    monkeypatch.setattr(sys, "stdout", open(write, "w"))

    def prints(argv):
        print("a line that nobody reads")

    with pytest.raises(SystemExit) as e:
        cli.run(prints, [])
    assert e.value.code == 128 + signal.SIGPIPE and capsys.readouterr().err == ""
    broken = BrokenPipeError(errno.EPIPE, "Broken pipe")
    broken.filename = "out.fifo"
    monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    with pytest.raises(SystemExit, match="^error: Broken pipe: out.fifo$"):
        cli.run(fails_with(broken), [])


def test_a_dash_is_a_stream_where_the_option_takes_one_and_refused_elsewhere(tmp_path):
    assert cli.input_or_stdin("-") is None and cli.output_or_stdout("-") is None  # the options' defaults
    for parse in (cli.input_file, cli.output_file, cli.input_folder, cli.output_folder, cli.data_folder):
        assert not accepts(parse, "-")
    (tmp_path / "-").write_text("a file named -")
    assert cli.input_file(str(tmp_path / "-")) == str(tmp_path / "-")
