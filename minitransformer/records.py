"""The records a training run leaves, and how every program reads them back: checked when opened.

    train.jsonl            one JSON object a line: {"kind": "start" | "train" | "val", "step": ...}
    bleu.json              the finished run's test figures (examples/train_wmt.py ``finish``)
    decoding_sweep.json    examples/tune_decoding.py's rows, one per decoding tried
    a study's points       {"points": [...]}: experiments/bleu_tokens/'s curve, the recipe runs
    BLEU against minutes   [...]: experiments/bleu_minutes/'s marks, a point each
    benchmarks/records/    one JSON object a line, a measurement each: {"date", "commit",
                           "machine", "command", "config", "figures"} (``append``, ``read_bench``)

A file that does not fit is refused in one line naming it (and the line, for train.jsonl) and
what is wrong (``RecordError``), before the program does any long work with it. Fields that
only later versions write are optional, so that the runs of earlier versions still read.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import shutil
import subprocess

from .schema import INTEGER_FROM_0, INTEGER_FROM_1, MAX_JSON_BYTES, STRINGS, Schema, load_json, loads


class RecordError(ValueError):
    """A run's record that cannot be read: not JSON, or not the shape its writer gives it."""


_NUMBER_OR_NULL = {"type": ["number", "null"]}

LOG_ROW = Schema({
    "type": "object",
    "required": ["kind"],
    "properties": {"kind": {"type": "string"}, "step": INTEGER_FROM_0, "loss": {"type": "number"},
                   "loss_smoothed": {"type": "number"}, "tokens": INTEGER_FROM_0, "seconds": {"type": "number"}},
    "if": {"properties": {"kind": {"enum": ["train", "val"]}}},
    "then": {"required": ["step"]},
})

RESULT = Schema({
    "type": "object",
    "required": ["bleu", "signature", "bleu_lowercased", "signature_lowercased", "steps", "beam", "alpha",
                 "test_sentences"],
    "properties": {
        "bleu": _NUMBER_OR_NULL, "bleu_lowercased": {"type": "number"}, "literature": {"type": "number"},
        "signature_lowercased": {"type": "string"}, "signature_literature": {"type": "string"},
        "length_ratio": {"type": "number"}, "steps": INTEGER_FROM_0, "beam": INTEGER_FROM_1,
        "alpha": {"type": "number", "minimum": 0}, "test_sentences": INTEGER_FROM_1,
        "signature": {"type": ["string", "null"]}, "preset": {"type": ["string", "null"]},
        "preprocess": {"type": "string"}, "length_penalty": {"type": "string"},
        "parts": {"type": "array", "items": {"type": "object"}},
    },
})

SWEEP = Schema({
    "type": "array",
    "items": {"type": "object", "required": ["first", "last", "average", "beam", "alpha", "sentences"],
              "properties": {"first": {"type": "string"}, "last": {"type": "string"}, "average": INTEGER_FROM_1,
                             "beam": INTEGER_FROM_1, "alpha": {"type": "number"}, "sentences": INTEGER_FROM_1,
                             "bleu": _NUMBER_OR_NULL, "literature": {"type": "number"}}},
})

POINTS = Schema({
    "type": "object",
    "required": ["points"],
    "properties": {"points": {"type": "array", "items": {
        "type": "object",
        "required": ["split", "steps", "run", "bleu", "bleu_lowercased", "length_ratio", "target_tokens"],
        "properties": {"split": {"type": "string"}, "steps": INTEGER_FROM_0, "run": {"type": "string"},
                       "bleu": _NUMBER_OR_NULL, "bleu_lowercased": {"type": "number"},
                       "length_ratio": {"type": "number"}, "target_tokens": {"type": "number", "minimum": 0},
                       "parts": {"type": "array", "items": {"type": "object"}}}}}},
})

MINUTES = Schema({
    "type": "array",
    "items": {"type": "object", "required": ["run", "label", "split", "minutes", "step", "averaged", "literature"],
              "properties": {"run": {"type": "string"}, "label": {"type": "string"}, "split": {"type": "string"},
                             "minutes": {"type": "number", "minimum": 0}, "step": INTEGER_FROM_0,
                             "averaged": STRINGS, "literature": {"type": "number"}, "bleu": _NUMBER_OR_NULL,
                             "length_ratio": {"type": "number"}}},
})


def read_log(path: str | os.PathLike, drop_damaged: bool = False) -> list[dict]:
    """The rows of a run's train.jsonl. A line that is not a row (a line torn by a crash, a
    damaged one) is a ``RecordError`` naming it, or with ``drop_damaged`` (a run resuming,
    which rewrites its log) left out; the caller is told of each dropped line by a warning."""
    import logging

    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_JSON_BYTES + 1), b""), 1):
            where = f"{path}, line {number}"
            if len(line) > MAX_JSON_BYTES:  # an endless stream, not a log
                raise RecordError(f"{where}: longer than {MAX_JSON_BYTES >> 20} MiB: not a line of a run's log")
            try:
                rows.append(LOG_ROW.check(loads(line, where, RecordError), where, RecordError))
            except RecordError as e:
                if not drop_damaged:
                    raise
                logging.getLogger(__name__).warning("dropping a damaged line: %s", e)
    return rows


def read_result(path: str | os.PathLike) -> dict:
    """A finished run's bleu.json."""
    return load_json(path, RESULT, RecordError)


def read_sweep(path: str | os.PathLike) -> list[dict]:
    """A run's decoding_sweep.json (an empty sweep where there is none yet)."""
    return load_json(path, SWEEP, RecordError) if os.path.exists(path) else []


def read_minutes(path: str | os.PathLike) -> list[dict]:
    """experiments/bleu_minutes/bleu_minutes.py's record of points (none where there is none yet)."""
    return load_json(path, MINUTES, RecordError) if os.path.exists(path) else []


def read_points(path: str | os.PathLike) -> dict:
    """A benchmark's record of points (an empty one where there is none yet)."""
    return load_json(path, POINTS, RecordError) if os.path.exists(path) else {"points": []}


# A benchmark's or study's measurement: what was run (command, and the config that names its row
# in a table), where and when (machine, date, commit), and what it gave (figures).
BENCH_ROW = Schema({
    "type": "object",
    "required": ["date", "commit", "machine", "command", "config", "figures"],
    "additionalProperties": False,
    "properties": {
        "date": {"type": "string", "pattern": r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "commit": {"type": "string", "pattern": r"^[0-9a-f]{7,40}(\+dirty)?$"},
        "machine": {"type": "string", "minLength": 1},
        "command": {"type": "string", "minLength": 1},
        "config": {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}},
        "figures": {"type": "object", "minProperties": 1, "additionalProperties": {"type": ["number", "string"]}},
        "note": {"type": "string"},
    },
})


def read_bench(path: str | os.PathLike) -> list[dict]:
    """The measurements of a ``benchmarks/records/<name>.jsonl``, oldest first; a line that is
    not one is a ``RecordError`` naming the file and the line."""
    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            where = f"{path}, line {number}"
            rows.append(BENCH_ROW.check(loads(line, where, RecordError), where, RecordError))
    return rows


def machine() -> str:
    """The machine a measurement ran on, as the records name it: the GPU if there is one, else
    the CPU's cores (a benchmark that ran on the CPU of a GPU machine says so in its config)."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False).stdout.split("\n")[0].strip()
        if out:
            return out
    return f"{os.cpu_count()}-core {platform.machine()}, no GPU"


def _commit(folder: str) -> str:
    """The checkout's commit, ``+dirty`` when its tracked files differ from it. A copy of a
    checkout without its .git (what a lent GPU machine is sent) is named by MT_RECORD_COMMIT,
    which the sender sets to ``git rev-parse --short HEAD`` (+dirty where so)."""
    git = lambda *a: subprocess.run(["git", "-C", folder, *a], capture_output=True, text=True, check=False)  # noqa: E731
    head = git("rev-parse", "--short=7", "HEAD")
    if head.returncode and os.environ.get("MT_RECORD_COMMIT"):
        return os.environ["MT_RECORD_COMMIT"]  # checked against the record's schema by append
    if head.returncode:
        raise RecordError(f"{folder}: not a git checkout (and no MT_RECORD_COMMIT): a record names the commit it "
                          f"measured")
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def append(path: str | os.PathLike, command: str, config: dict, figures: dict, note: str | None = None,
           checkout: str | os.PathLike | None = None) -> dict:
    """Add one measurement to the record at ``path`` (a ``--record`` run of a benchmark), dated
    today (UTC) at the commit of ``checkout``, the code measured (by default the checkout that
    holds the record); the file is rewritten whole or not at all."""
    from .files import atomic_write

    row = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "commit": _commit(os.path.abspath(checkout or os.path.dirname(os.path.abspath(path)))),
           "machine": machine(), "command": command, "config": config, "figures": figures}
    if note:
        row["note"] = note
    BENCH_ROW.check(row, f"{path}: the new line", RecordError)
    unwritable = [k for k, v in figures.items() if isinstance(v, float) and not math.isfinite(v)]
    if unwritable:  # JSON has no NaN or infinity: the line would make the whole record unreadable
        raise RecordError(f"{path}: the new line's figure {unwritable[0]!r} is {figures[unwritable[0]]}, not a number")
    old = read_bench(path) if os.path.exists(path) else []
    with atomic_write(path) as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in [*old, row])
    return row


def record(script: str | os.PathLike, argv: list[str], config: dict, figures: dict, ranks: int = 1,
           note: str | None = None) -> pathlib.Path:
    """A benchmark's ``--record``: one line for ``records/<script's name>.jsonl`` beside the
    script (``$MT_RECORDS_DIR`` instead, where a test points it), naming the command as run
    (``argv``, under ``mpiexec -n ranks``, with the ``OMP_NUM_THREADS`` it ran under) and the
    commit of the script's checkout. Each float figure keeps 4 significant digits, more than a
    timing repeats to. Returns the record's path."""
    script = pathlib.Path(script).resolve()
    path = pathlib.Path(os.environ.get("MT_RECORDS_DIR") or script.parent / "records") / f"{script.stem}.jsonl"
    threads = os.environ.get("OMP_NUM_THREADS")
    command = " ".join([*([f"OMP_NUM_THREADS={shlex.quote(threads)}"] if threads else []),
                        *(["mpiexec", "-n", str(ranks)] if ranks > 1 else []),
                        "python", f"{script.parent.name}/{script.name}", *map(shlex.quote, argv)])
    figures = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in figures.items()}
    append(path, command, config, figures, note, checkout=script.parent)
    return path
