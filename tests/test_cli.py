"""minitransformer.cli, and every command-line program of the project read through it: each
numeric option refuses nan, inf, negatives and what its program cannot use, at parse time, in
one line naming the option; ordinary failures end in one line."""

from __future__ import annotations

import argparse
import errno
import importlib
import pathlib
import sys

import pytest

from minitransformer import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
for folder in ("examples", "benchmarks"):
    sys.path.insert(0, str(ROOT / folder))

PROGRAMS = ["train_wmt", "translate", "export_ctranslate2", "tune_decoding", "ablations", "copy_task",
            "tour", "plot_attention", "train_step", "translate_speed", "attn", "allreduce", "bpe_dropout", "mutants",
            "minitransformer.data.download"]


def test_every_program_has_a_parser_to_read():
    """Every script of examples/ and benchmarks/ that parses options is in PROGRAMS."""
    scripts = {p.stem for folder in ("examples", "benchmarks") for p in (ROOT / folder).glob("*.py")
               if "add_argument(" in p.read_text()}
    assert scripts <= set(PROGRAMS), scripts - set(PROGRAMS)


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
        assert action.type not in (int, float), f"{program} {action.option_strings}: an unchecked {action.type}"
        if not hasattr(action.type, "kind"):  # not a number (a path, a choice)
            continue
        kind = getattr(action.type, "element", action.type)  # a list of numbers: each is checked
        assert kind.kind in ("integer", "real"), f"{program} {action.option_strings}"
        numeric += 1
        assert kind.low is not None, f"{program} {action.option_strings}: no option takes any negative number"
        wrap = (lambda v: f"1,{v}") if kind is not action.type else (lambda v: v)  # "1,": a good first element
        for text in ("nan", "inf", "-inf"):
            assert not accepts(action.type, wrap(text)), f"{program} {action.option_strings} took {text}"
        for value in (0, -1):
            assert accepts(action.type, wrap(str(value))) == in_range(kind, value), \
                f"{program} {action.option_strings} at {value}"
    assert numeric or program == "plot_attention"


@pytest.mark.parametrize("program, argv", [
    ("train_wmt", ["--alpha", "nan"]), ("train_wmt", ["--max-tokens", "0"]), ("translate", ["--alpha", "inf"]),
    ("translate", ["--max-tokens", "0"]), ("tune_decoding", ["--run", "x", "--data-dir", "y", "--beam", "4,0"]),
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
