"""The fault suite, generated from every program's options: each option that names a file or a
folder (``cli.input_file``, ``input_folder``, ``data_folder``, ``output_file``, ``output_folder``)
is given each hostile kind of path, and every cell must end the way a careful program ends.

Kinds: a link to a file outside the run, a dangling link, a FIFO, a character device (a
``mknod`` of /dev/full's numbers in a tmp folder, never a real /dev node), a folder where a
file goes, a file where a folder goes, a read-only place (a read-only tmpfs: chmod does not
stop root), and "-", standard input or output where the option takes a stream, refused
elsewhere. Every program's parser also refuses, in one line naming it, a boolean environment
variable that is neither on nor off.

Every cell parses the program's options in-process; a refusal is exit status 2 and one line
naming the option, and an accepted path is one the kind legitimately is (reading through a
link, writing a stream to a FIFO). Around every cell the folder tree is snapshotted: nothing
changes, is replaced or deleted, the user's file outside the run included. The programs whose
whole run costs little (``RUN``) are also run to their end through their own entry point, with
content kinds as well (a truncated file, random bytes, valid JSON of the wrong type): exit
status 0, 1 or 2, at most three lines on stderr, no traceback, no hang, no network, and nothing
outside the program's own outputs changed. Their outputs are also cut short mid-write, by a full
disk and by a file-size limit (``ulimit -f``): one line naming the file, no temporary file left.
And each is interrupted while it imports, and inside sentencepiece's training: one line, 130.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pathlib
import re
import resource
import runpy
import shutil
import signal
import socket
import stat
import subprocess
import sys

import pytest

from minitransformer import cli, files, settings
from tests.helpers import fill, tiny_run, tiny_test_set, tmpfs
from tests.test_cli import PROGRAMS, ROOT

PATH_TYPES = (cli.input_file, cli.input_or_stdin, cli.input_folder, cli.data_folder, cli.output_file,
              cli.output_or_stdout, cli.output_folder)
# Options that take text, not a path (a test below keeps every other option typed).
NOT_PATHS = {("ablations", "--rows"), ("plot_attention", "sentence"), ("bleu_tokens", "--note"), ("bleu_minutes", "--label"), ("score", "--lang"),
             ("figures", "names"), ("trained", "--trained-at"), ("trained", "--command"),
             ("ncu_counts", "--ncu"), ("ncu_counts", "--launch"), ("prebuilt", "--python"),  # a command, or a path
             ("minitransformer.data.download", "--base-url")}
KINDS = ("link-to-file", "dangling-link", "fifo", "device", "folder", "file", "read-only", "dash")


def path_options(program: str) -> list[tuple[str, object]]:
    """(option or positional name, its cli type) of every option of ``program`` that names a path."""
    parser = importlib.import_module(program).build_parser()
    return [(a.option_strings[0] if a.option_strings else a.dest, a.type) for a in parser._actions
            if a.type in PATH_TYPES]


def test_every_option_that_names_a_path_is_typed():
    for program in PROGRAMS:
        parser = importlib.import_module(program).build_parser()
        for a in parser._actions:
            name = a.option_strings[0] if a.option_strings else a.dest
            if a.nargs == 0 or name == "help" or a.choices or getattr(a.type, "kind", None) or a.type is cli.regex \
                    or name in parser.removed:  # refused whatever its value
                continue
            assert a.type in PATH_TYPES or (program, name) in NOT_PATHS, \
                f"{program} {name}: a path option needs a cli path type (or is it text? NOT_PATHS)"


def snapshot(root: pathlib.Path) -> dict:
    """Every entry under ``root``: its kind, size, mtime and content or link target."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = os.lstat(path)
        key = str(path.relative_to(root))
        if stat.S_ISLNK(st.st_mode):
            out[key] = ("link", os.readlink(path))
        elif stat.S_ISREG(st.st_mode):
            out[key] = ("file", st.st_size, st.st_mtime_ns, path.read_bytes())
        else:
            out[key] = (stat.S_IFMT(st.st_mode), st.st_mtime_ns if stat.S_ISDIR(st.st_mode) else 0)
    return out


def hostile(kind: str, where: pathlib.Path, stack: contextlib.ExitStack) -> pathlib.Path:
    """A path of ``kind`` in ``where``; a user's file beside it, outside, must never change."""
    precious = where / "outside" / "precious.txt"
    precious.parent.mkdir(exist_ok=True)
    precious.write_text("a user's file\n")
    path = where / "given"
    if kind == "link-to-file":
        path.symlink_to(precious)
    elif kind == "dangling-link":
        path.symlink_to(where / "nowhere" / "gone")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        except PermissionError:
            pytest.skip("mknod is not allowed here (not root, or no CAP_MKNOD)")
    elif kind == "folder":
        path.mkdir()
    elif kind == "file":
        path.write_text("not a folder\n")
    elif kind == "read-only":
        path = stack.enter_context(tmpfs(where / "ro", "ro,size=64k")) / "given"
    elif kind == "dash":
        path = pathlib.Path("-")
    return path


# Which kinds each path type takes (the others are refused when parsed). A data folder may be
# missing (it is downloaded into): in a read-only place too, where the download then fails.
ACCEPTS = {
    cli.input_file: {"file", "link-to-file", "fifo", "device"},
    cli.input_or_stdin: {"file", "link-to-file", "fifo", "device", "dash"},
    cli.input_folder: {"folder"},
    cli.data_folder: {"folder", "read-only"},
    cli.output_file: {"file", "link-to-file", "fifo", "device"},
    cli.output_or_stdout: {"file", "link-to-file", "fifo", "device", "dash"},
    cli.output_folder: {"folder"},
}


def parse(program: str, argv: list[str], capsys) -> tuple[int, list[str]]:
    parser = importlib.import_module(program).build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        return e.code, capsys.readouterr().err.splitlines()
    return 0, capsys.readouterr().err.splitlines()


CELLS = [(p, option, kind) for p in PROGRAMS for option, _ in path_options(p) for kind in KINDS]


@pytest.mark.parametrize("program, option, kind", CELLS)
def test_a_hostile_path_is_refused_in_one_line_or_legitimately_taken(program, option, kind, tmp_path, capsys):
    typed = dict(path_options(program))[option]
    with contextlib.ExitStack() as stack:
        path = hostile(kind, tmp_path, stack)
        before = snapshot(tmp_path)
        status, err = parse(program, arguments(program, {**REQUIRED.get(program, {}), option: str(path)}), capsys)
        assert snapshot(tmp_path) == before, f"{program} {option} {kind}: the folder tree changed"
    assert not os.path.lexists("-"), f"{program} {option}: a file named - was made"
    if kind in ACCEPTS[typed]:
        assert all(option not in line for line in err), (program, option, kind, err)
        return
    assert status == 2, (program, option, kind, err)
    assert len(err) == 1 and (option in err[0] or f"argument {option}" in err[0]), (program, option, kind, err)
    assert str(path) in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("program, variable", [(p, v) for p in PROGRAMS for v in settings.BOOLEAN_VARIABLES])
def test_a_boolean_environment_variable_is_refused_in_one_line_unless_on_or_off(program, variable, monkeypatch,
                                                                               capsys):
    argv = arguments(program, REQUIRED.get(program, {}))
    monkeypatch.setenv(variable, "maybe")
    status, err = parse(program, argv, capsys)
    assert status == 2 and len(err) == 1 and variable in err[0], (program, variable, err)
    monkeypatch.setenv(variable, " Off")
    assert not any(variable in line for line in parse(program, argv, capsys)[1])


# Options each program requires, with values that parse, for the cells of its other options.
REQUIRED: dict[str, dict[str, str]] = {}


def arguments(program: str, values: dict[str, str]) -> list[str]:
    """argv of ``values`` (option or positional name -> value), positionals in the parser's order."""
    parser = importlib.import_module(program).build_parser()
    positional = [a.dest for a in parser._actions if not a.option_strings]
    argv = [values[name] for name in positional if name in values]
    for name, value in values.items():
        if name.startswith("-"):
            argv += [name, value]
    return argv


@pytest.fixture(scope="module")
def required(tmp_path_factory):
    run = tiny_run(tmp_path_factory.mktemp("run"))
    data = tiny_test_set(tmp_path_factory.mktemp("data"))
    text = data / "test_2016_flickr.de"
    REQUIRED.update({
        "translate": {"--run": str(run)}, "export_ctranslate2": {"--run": str(run)},
        "tune_decoding": {"--run": str(run), "--data-dir": str(data)},
        "plot_attention": {"--run": str(run), "sentence": "A dog."}, "translate_speed": {"--run": str(run)},
        "bpe_dropout": {"--tokenizer": str(next(run.glob("*.model")))}, "subwords": {"--data-dir": str(data)},
        "reproduction": {"--run": str(run)}, "score": {"hyp": str(text), "ref": str(text)},
        "trained": {"--run": str(run), "--trained-at": "abc1234"},
    })
    yield
    REQUIRED.clear()


pytestmark = pytest.mark.usefixtures("required")


# The programs run to their end in the cells below: each costs well under a second here.
# program -> (script, {option: what a valid value is}); "out:" values are the program's own
# outputs, in a folder of their own, which the snapshot leaves out.
RUN = {
    "score": ("examples/score.py", {"hyp": "text", "ref": "text"}),
    "translate": ("examples/translate.py", {"--run": "run", "--checkpoint": "checkpoint", "--tokenizer": "tokenizer",
                                            "--input": "text", "--output": "out:out.de"}),
    "recipe": ("experiments/recipe/recipe.py", {"--record": "points", "--baseline": "points", "--plot": "out:recipe.png"}),
    "reproduction": ("experiments/reproduction/reproduction.py", {"--run": "run", "--out": "out:kept"}),
    "tune_decoding": ("examples/tune_decoding.py", {"--run": "run", "--data-dir": "data", "--beam": "arg:2",
                                                    "--average": "arg:1"}),
    "plot_attention": ("examples/plot_attention.py", {"sentence": "arg:A dog runs.", "--run": "run",
                                                      "--out": "out:maps", "--beam": "arg:1"}),
    "bleu_tokens": ("experiments/bleu_tokens/bleu_tokens.py", {"--run": "run", "--data-dir": "data",
                                                               "--record": "out:points.json", "--plot": "out:curve.png",
                                                               "--no-progress": "flag"}),
    "train_wmt": ("examples/train_wmt.py", {"--data-dir": "data", "--out-dir": "out:run", "--vocab-size": "arg:60",
                                            "--d-model": "arg:16", "--layers": "arg:1", "--max-steps": "arg:2",
                                            "--max-tokens": "arg:400", "--limit": "arg:200", "--bleu-sample": "arg:0",
                                            "--no-progress": "flag"}),
    "export_ctranslate2": ("examples/export_ctranslate2.py", {"--run": "run", "--data-dir": "data", "--out": "out:ct2",
                                                              "--limit": "arg:3", "--beam": "arg:2", "--threads": "arg:1"}),
    "trained": ("docs/trained.py", {"--run": "run", "--data-dir": "data", "--out": "out:trained",
                                    "--trained-at": "arg:abc1234", "--samples": "arg:2"}),
    "translate_speed": ("benchmarks/translate_speed.py", {"--run": "run", "--data-dir": "data",
                                                          "--json": "out:speed.json", "--hyps": "out:hyps.txt",
                                                          "--engines": "arg:ours", "--repeats": "arg:1", "--limit": "arg:3"}),
    "bpe_dropout": ("experiments/bpe_dropout/bpe_dropout.py", {"--tokenizer": "tokenizer", "--data-dir": "data",
                                                               "--sentences": "arg:20"}),
    "ablations": ("examples/ablations.py", {"--rows": "arg:base", "--data-dir": "data", "--out-dir": "out:sweep",
                                            "--max-steps": "arg:2", "--d-model": "arg:16", "--d-ff": "arg:32",
                                            "--heads": "arg:2", "--layers": "arg:1", "--vocab-size": "arg:60",
                                            "--max-tokens": "arg:400", "--bleu-sample": "arg:2", "--limit": "arg:200",
                                            "--average-last": "arg:1", "--no-progress": "flag"}),
    "attn": ("benchmarks/attn.py", {"--cpu": "flag", "--seqs": "arg:8", "--head-dims": "arg:8", "--tokens": "arg:16",
                                    "--heads": "arg:1", "--repeats": "arg:1", "--json": "out:attn.json"}),
    "allreduce": ("benchmarks/allreduce.py", {"--min-bytes": "arg:4K", "--max-bytes": "arg:4K", "--iters": "arg:1",
                                              "--warmup": "arg:0", "--json": "out:allreduce.json"}),
}
# What a program writes into a folder it reads: its outputs there (tune_decoding's sweep).
WRITES_INTO_INPUTS = {"tune_decoding": ("decoding_sweep.json", ".hyp", ".tmp-")}
CONTENT_KINDS = ("truncated", "random-bytes", "wrong-json")
RUN_CELLS = [(p, option, kind) for p, (_, spec) in RUN.items() for option, what in spec.items()
             if not what.startswith("arg:") and what != "flag" for kind in ("link-to-file", "dangling-link", "device", "folder",
                          *(() if what.startswith("out:") else CONTENT_KINDS))]  # content: of what is read


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid file or folder of each kind the programs above read."""
    run = tiny_run(tmp_path_factory.mktemp("valid-run"))
    shutil.copy(run / "averaged.npz", run / "ckpt-10.npz")  # a step checkpoint, for tune_decoding
    (run / "bleu.json").write_text(json.dumps({
        "bleu": 12.5, "signature": "nrefs:1|case:mixed", "bleu_lowercased": 13.0,
        "signature_lowercased": "nrefs:1|case:lc", "steps": 40, "beam": 4, "alpha": 0.6, "test_sentences": 12,
        "preset": "multi30k", "train_minutes": 1.0, "averaged": ["averaged.npz"], "parts": []}))
    (run / "test.hyp.de").write_text("Ein Hund.\n" * 12)
    (run / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "start", "command": "train_wmt.py"}, {"kind": "train", "step": 40, "tokens": 300},
        {"kind": "val", "step": 40, "loss": 2.5})))
    corpus = tmp_path_factory.mktemp("valid-data")  # Multi30k-shaped, each split small
    for split, n in (("train", 200), ("val", 6), ("test_2016_flickr", 6)):
        tiny_test_set(corpus, n=n, split=split)
    text = run / "sentences.txt"
    text.write_text("A dog runs.\nTwo men sit on a bench.\n")
    points = run / "points.json"
    points.write_text(json.dumps({"points": [{"split": "val", "steps": 9000, "run": "runs/x", "bleu": 40.0,
                                              "bleu_lowercased": 40.3, "length_ratio": 0.98, "target_tokens": 2e7,
                                              "validation_nll": 1.7, "parts": [{"command": "train_wmt.py"}]}]}))
    return {"run": run, "checkpoint": run / "averaged.npz", "tokenizer": next(run.glob("*.model")), "text": text,
            "points": points, "data": corpus}


def content(kind: str, of: pathlib.Path, where: pathlib.Path) -> pathlib.Path:
    path = where / ("given" + of.suffix)
    if of.is_dir():  # a run folder whose files are damaged
        shutil.copytree(of, path)
        for file in path.iterdir():
            if file.suffix in (".npz", ".json", ".model", ".en", ".de"):
                file.write_bytes(damaged(kind, file.read_bytes()))
        return path
    path.write_bytes(damaged(kind, of.read_bytes()))
    return path


def damaged(kind: str, data: bytes) -> bytes:
    return {"truncated": data[: len(data) // 2], "random-bytes": os.urandom(max(len(data), 64)),
            "wrong-json": b'[1, "two", null]\n'}[kind]


class NoNetwork(AssertionError):
    """A program of the suite tried to open a connection."""


def kept(tree: dict, output: bool, kind: str) -> dict:
    """What a run must leave as it was: all but the program's own output folder; where the
    hostile path is an output, it may be written (a folder's or a file's content; a link's
    target, for a link to a file) but never replaced by another kind of thing."""
    out = {}
    for name, entry in tree.items():
        if name == "out" or name.startswith("out/"):
            continue
        if output and name.startswith("given/"):
            continue
        if output and (name == "given" or (kind == "link-to-file" and name in ("outside", "outside/precious.txt"))):
            entry = entry if entry[0] == "link" else entry[:1]  # its kind alone
        out[name] = entry
    return out


def resident_bytes() -> int:
    """This process's address space now (/proc/self/statm's first field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def run_program(program: str, argv: list[str], monkeypatch, stack: contextlib.ExitStack) -> int:
    """``program`` run to its end through its own entry point in this process, as its command
    line would: with no network, no more than 3 GB more memory, at most 60 s; its exit status."""
    script = RUN[program][0]

    def no_network(*args, **kwargs):
        raise NoNetwork("a program tried the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)  # a name lookup is the network too
    # A runaway read (an endless device read whole) becomes a MemoryError, not the OOM killer.
    limit = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (resident_bytes() + (3 << 30), limit[1]))
    stack.callback(resource.setrlimit, resource.RLIMIT_AS, limit)
    monkeypatch.setattr(sys, "argv", [str(ROOT / script), *argv])
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError(f"{program} hung")))
    signal.alarm(60)
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code not in (None, 0, 1, 2) and not isinstance(e.code, int):
            sys.stderr.write(str(e.code) + "\n")  # SystemExit("error: ...") prints its message
        return e.code if isinstance(e.code, int) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def valid_values(program: str, valid: dict, out: pathlib.Path, given: str | None = None) -> dict:
    """The program's RUN options with valid values, its outputs in ``out`` (``given``: the one
    option --checkpoint or --tokenizer it is also given, which --run gives otherwise)."""
    return {name: str(out / v[4:]) if v.startswith("out:") else v[4:] if v.startswith("arg:") else str(valid[v])
            for name, v in RUN[program][1].items()
            if v != "flag" and (name not in ("--checkpoint", "--tokenizer") or name == given)}


def with_flags(program: str, values: dict) -> list[str]:
    return arguments(program, values) + [name for name, v in RUN[program][1].items() if v == "flag"]


@pytest.mark.slow  # the fault matrix's whole-run cells
@pytest.mark.parametrize("program, option, kind", RUN_CELLS)
def test_a_program_run_on_a_hostile_path_ends_in_at_most_three_lines(program, option, kind, valid, tmp_path,
                                                                      monkeypatch, capsys):
    spec = RUN[program][1]
    out = tmp_path / "out"
    out.mkdir()
    values = valid_values(program, valid, out, given=option)
    with contextlib.ExitStack() as stack:
        if kind in CONTENT_KINDS:
            path = content(kind, valid[spec[option]], tmp_path)
        else:
            path = hostile(kind, tmp_path, stack)
        values[option] = str(path)
        watched = {"the cell's folder": tmp_path, "the valid files": valid["run"], "the valid data": valid["data"]}
        before = {name: snapshot(root) for name, root in watched.items()}
        try:
            status = run_program(program, with_flags(program, values), monkeypatch, stack)
        except NoNetwork:
            # An empty data folder is downloaded into (tests/data/test_download.py covers that
            # offline); anywhere else a connection fails the cell.
            if not (kind == "folder" and dict(path_options(program))[option] is cli.data_folder):
                raise
            status = 0
        after = {name: snapshot(root) for name, root in watched.items() if name != "the cell's folder"}
        own_files = WRITES_INTO_INPUTS.get(program, ())
        for tree in (*before.values(), *after.values()):  # the program's outputs among its inputs
            for name in [n for n in tree if n.endswith(own_files) or n.startswith(own_files)]:
                del tree[name]
        cell = kept(snapshot(tmp_path), spec[option].startswith("out:"), kind)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "EMULATED" not in line]
    assert status in (0, 1, 2), (program, option, kind, status, err)
    assert "Traceback" not in "\n".join(err), (program, option, kind, err)
    errors = [line for line in err if "error" in line.lower()]
    assert len(errors) <= 3, (program, option, kind, err)
    assert cell == kept(before["the cell's folder"], spec[option].startswith("out:"), kind), \
        f"{program} {option} {kind}: something outside its outputs changed"
    for name in ("the valid files", "the valid data"):
        assert after[name] == before[name], f"{program} {option} {kind}: {name} changed"


# Outputs cut short mid-write: a disk with a few pages left, and a file-size limit (ulimit -f).
# attn's benchmark alone takes seconds, and its --json is written as translate_speed's is.
ROOM = 16384
CUT_CELLS = [(p, option, how) for p, (_, spec) in RUN.items() if p != "attn" for option, what in spec.items()
             if what.startswith("out:") for how in ("full-disk", "file-size-limit")]


@pytest.mark.slow  # the fault matrix's whole-run cells
@pytest.mark.parametrize("program, option, how", CUT_CELLS)
def test_an_output_cut_short_mid_write_ends_in_one_line_naming_it_and_leaves_no_temporary(program, option, how,
                                                                                          valid, tmp_path,
                                                                                          monkeypatch, capsys):
    with contextlib.ExitStack() as stack:
        disk = stack.enter_context(tmpfs(tmp_path / "disk", "size=4m"))
        values = valid_values(program, valid, tmp_path)
        values[option] = str(disk / RUN[program][1][option][4:])
        if how == "full-disk":
            fill(disk, leave=ROOM)
        else:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (ROOM, limit[1]))
            stack.callback(resource.setrlimit, resource.RLIMIT_FSIZE, limit)
        status = run_program(program, with_flags(program, values), monkeypatch, stack)
        left = [p.name for p in disk.rglob("*") if p.name.startswith(files.PREFIX)]
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert status in (0, 1), (program, option, how, status, err)
    assert not left, f"{program} {option} {how}: {left} left behind"
    if status:  # the file (or folder) it was writing: on the disk, or (a size limit) any the program writes
        (line,) = err
        assert str(disk) in line if how == "full-disk" else re.search(r": /\S", line), (program, option, how, line)


@pytest.mark.slow  # each program's imports, whole
@pytest.mark.parametrize("program", list(RUN))
def test_an_interrupt_while_a_program_imports_ends_in_its_one_line(program, valid, tmp_path):
    """Ctrl-C lands when the program first imports NumPy (an import hook sends it): held by the
    program's first lines (cli.PREAMBLE) until cli.run, which ends it in one line, status 130,
    having written nothing. (tests/test_cli.py checks that every program has those lines.)"""
    argv = with_flags(program, valid_values(program, valid, tmp_path))
    run = subprocess.run([sys.executable, "-c", INTERRUPTED_AT_IMPORT, "numpy", str(ROOT / RUN[program][0]), *argv],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "MT_EMULATE_CUDA": "0"})
    err = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == cli.INTERRUPTED, run.stderr
    assert len(err) == 1 and err[0].startswith("interrupted") and list(tmp_path.iterdir()) == []


# A program run with a Ctrl-C that lands while it imports ``module``: an import hook sends it.
INTERRUPTED_AT_IMPORT = """
import os, runpy, signal, sys

module, sys.argv = sys.argv[1], sys.argv[2:]

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == module:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as python script.py has it
runpy.run_path(sys.argv[0], run_name="__main__")
"""

INTERRUPTED_IN_SENTENCEPIECE = """
import os, signal, sys, threading
from minitransformer import cli, data

def main(argv):
    # Ctrl-C from outside, while sentencepiece reads the sentences (the first 0.3 s of many)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    data.train_tokenizer((f"sentence {i} of {i % 97} words" for i in range(3_000_000)), sys.argv[1],
                         data.TokenizerConfig(vocab_size=100))

cli.run(main, [])
"""


@pytest.mark.slow  # a tokenizer trained for a second
def test_an_interrupt_inside_sentencepiece_s_training_ends_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-c", INTERRUPTED_IN_SENTENCEPIECE, str(tmp_path / "x.model")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "MT_EMULATE_CUDA": "0"})
    assert run.returncode == cli.INTERRUPTED and run.stderr.strip() == "interrupted", run.stderr
    assert list(tmp_path.iterdir()) == []
