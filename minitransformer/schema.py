"""What a file the programs read must hold, checked when it is opened, before any long work.

A checkpoint's metadata, a run's ``train.jsonl``, its ``bleu.json``, a decoding sweep's record:
each has a JSON Schema beside the code that reads it, and ``check`` (or ``load_json``, which
reads the file first) refuses what does not fit in one line naming the file, where in it, and
what is wrong:

    runs/x/last.npz: extra.step must be integer (got 'abc')

instead of a ``TypeError`` minutes later, deep in the program. JSON's non-standard ``NaN`` and
``Infinity`` are refused as they are read: no figure or setting of ours is one. The schemas are
compiled to Python once, on first use, by fastjsonschema (a few milliseconds to import).
"""

from __future__ import annotations

import json
import os
from typing import Any


class Schema:
    """A JSON Schema (a dict), compiled on first use."""

    def __init__(self, schema: dict) -> None:
        self.schema = schema
        self._validate = None

    def check(self, value: Any, where: str, error: type[Exception] = ValueError) -> Any:
        """``value`` if it fits, else ``error("<where>: <what is wrong>")``."""
        import fastjsonschema

        if self._validate is None:
            self._validate = fastjsonschema.compile(self.schema)
        try:
            self._validate(value)
        except fastjsonschema.JsonSchemaValueException as e:
            # fastjsonschema calls the value "data": data.extra.step, data[0].beam, data itself
            what = e.message.removeprefix("data.").removeprefix("data")
            what = f"the content{what}" if what.startswith(" ") else what
            got = repr(e.value)
            raise error(f"{where}: {what} (got {got if len(got) <= 60 else got[:57] + '...'})") from None
        return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def loads(text: str | bytes, where: str, error: type[Exception] = ValueError) -> Any:
    """JSON from ``text`` (``where`` names it in the error), without NaN or Infinity."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (ValueError, UnicodeDecodeError) as e:  # a constant refused, bytes that are not text
        raise error(f"{where}: not JSON ({e})") from None


# No record of ours comes near this; a larger "file" (an endless device) is refused unread.
MAX_JSON_BYTES = 64 << 20


def load_json(path: str | os.PathLike, schema: Schema, error: type[Exception] = ValueError) -> Any:
    """The JSON file at ``path``, checked against ``schema``; ``error`` for what is wrong."""
    with open(path, "rb") as f:
        text = f.read(MAX_JSON_BYTES + 1)
    if len(text) > MAX_JSON_BYTES:
        raise error(f"{path}: larger than {MAX_JSON_BYTES >> 20} MiB: not a record of ours")
    return schema.check(loads(text, str(path), error), str(path), error)


# Pieces the schemas share.
INTEGER_FROM_0 = {"type": "integer", "minimum": 0}
INTEGER_FROM_1 = {"type": "integer", "minimum": 1}
NUMBER = {"type": "number"}
STRINGS = {"type": "array", "items": {"type": "string"}}
