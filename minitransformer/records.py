"""The records a training run leaves, and how every program reads them back: checked when opened.

    train.jsonl            one JSON object a line: {"kind": "start" | "train" | "val", "step": ...}
    bleu.json              the finished run's test figures (examples/train_wmt.py ``finish``)
    decoding_sweep.json    examples/tune_decoding.py's rows, one per decoding tried
    a benchmark's points   {"points": [...]}: benchmarks/bleu_tokens.py's curve, its recipe runs
    BLEU against minutes   [...]: benchmarks/bleu_minutes.py's marks, a point each

A file that does not fit is refused in one line naming it (and the line, for train.jsonl) and
what is wrong (``RecordError``), before the program does any long work with it. Fields that
only later versions write are optional, so that the runs of earlier versions still read.
"""

from __future__ import annotations

import os

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
    """benchmarks/bleu_minutes.py's record of points (none where there is none yet)."""
    return load_json(path, MINUTES, RecordError) if os.path.exists(path) else []


def read_points(path: str | os.PathLike) -> dict:
    """A benchmark's record of points (an empty one where there is none yet)."""
    return load_json(path, POINTS, RecordError) if os.path.exists(path) else {"points": []}
