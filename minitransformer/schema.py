"""What a file the programs read must hold, checked when it is opened, before any long work.

A checkpoint's metadata, a run's ``train.jsonl``, its ``bleu.json``, a decoding sweep's record:
each has a JSON Schema beside the code that reads it, and ``check`` (or ``load_json``, which
reads the file first) refuses what does not fit in one line naming the file, where in it, and
what is wrong:

    runs/x/last.npz: extra.step must be integer (got 'abc')

instead of a ``TypeError`` minutes later, deep in the program. JSON's non-standard ``NaN`` and
``Infinity`` are refused as they are read: no figure or setting of ours is one. The schemas are
compiled to Python once, on first use, by fastjsonschema (a few milliseconds to import).

The checks of single values at the bottom (``check_int``, ``check_number``, ``check_keys``) are
what constructors and ``load_state_dict`` methods share: a loader refuses what its constructor
refuses, in the same words, naming the field. A value refused is a ``SettingsError`` (a
``ValueError``), which the programs tell in one line.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any

from .settings import SettingsError


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


# --------------------------------------------------------------------------- single values


def check_int(owner: str, name: str, value, low: int = 1) -> None:
    """Refuse a size, count or step that is not an integer >= ``low``, which NumPy would take as
    an empty layer, or fail on later with a raw error. Bools and floats (even 128.0) are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise SettingsError(f"{owner}: {name} must be an integer >= {low}, got {value!r}")


def check_number(owner: str, name: str, value, low=-math.inf, high=math.inf, *, open_low: bool = False,
                 open_high: bool = False) -> None:
    """Refuse what is not a finite real number (bools are not numbers here) in the interval from
    ``low`` to ``high``, each end closed unless ``open_low``/``open_high``; nan is in none."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if real and math.isfinite(value) and (low < value or low == value and not open_low) and (
            value < high or value == high and not open_high):
        return
    if math.isinf(high):
        bound = "" if math.isinf(low) else f" {'>' if open_low else '>='} {low}"
        what = f"a finite number{bound}"
    else:
        what = f"a number in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    raise SettingsError(f"{owner}: {name} must be {what}, got {value!r}")


def check_keys(owner: str, state, keys) -> None:
    """Refuse a state that is not a dict of exactly ``keys`` (what the owner's ``state_dict()``
    gives), naming what is missing and what is extra."""
    if not isinstance(state, dict):
        raise ValueError(f"{owner}: expected a dict (a state_dict()), got {type(state).__name__}")
    missing, extra = [k for k in keys if k not in state], [k for k in state if k not in keys]
    if missing or extra:
        raise ValueError(f"{owner}: missing keys {missing}, unexpected keys {extra}")
