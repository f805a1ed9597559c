"""Checkpoints: everything needed to resume training exactly, in one file, written atomically.

A checkpoint is a NumPy ``.npz`` archive (no pickle: loading one never runs code) holding

    model/<name>         every parameter and buffer (``Module.state_dict``)
    optim/m/<i>, v/<i>   Adam's moments
    __meta__             JSON: format tag, model config, optimiser scalars, schedule state,
                         the loss scaler's state (float16 training), the random generators'
                         state and any caller data (epoch, data position)

In mixed-precision training the parameters saved are the float32 master weights (see ``amp``),
so one checkpoint serves resuming in any precision, decoding and averaging.

``save_checkpoint`` writes through ``files.atomic_write`` (a temporary file in the same folder,
fsynced and renamed over the target): a crash mid-write leaves the previous checkpoint intact. ``load_checkpoint``
turns a truncated, foreign or corrupt file into a ``CheckpointError`` that names it.

``average_checkpoints`` averages the parameters of several checkpoints, as the paper does for
its final models (section 6.1: the last 5 checkpoints for base models, the last 20 for big).
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field

import numpy as np

from . import backend
from .files import atomic_write
from .schema import INTEGER_FROM_0, INTEGER_FROM_1, STRINGS, Schema, loads

FORMAT = "minitransformer-checkpoint"
VERSION = 1

# What the programs read from a checkpoint's metadata (beside what restore() hands to each
# object's own load_state_dict, which checks its part): checked when it is opened.
_DECODING = {"beam": {"type": ["integer", "null"], "minimum": 1}, "alpha": {"type": ["number", "null"], "minimum": 0},
             "length_penalty": {"type": ["string", "null"]}, "preprocess": {"type": ["string", "null"]},
             "subwords": {"type": ["string", "null"]}}
META = Schema({
    "type": "object",
    "required": ["format", "version", "config", "schedule", "rng", "extra", "optimizer"],
    "properties": {
        "config": {"type": ["object", "null"]},  # its fields: nn.TransformerConfig.from_dict
        "schedule": {"type": ["object", "null"]},
        "scaler": {"type": ["object", "null"]},
        "rng": {"type": ["object", "null"]},
        "optimizer": {"type": ["object", "null"], "required": ["num_params"],
                      "properties": {"num_params": INTEGER_FROM_0}},
        "extra": {"type": "object", "properties": {
            "step": INTEGER_FROM_0, "epoch": INTEGER_FROM_0, "train_seconds": {"type": "number", "minimum": 0},
            "tokenizer": {"type": "string"}, "averaged_from": STRINGS, "batcher": {"type": "object"},
            "divergence": {"type": "object"}, "early_stopping": {"type": "object"},
            "args": {"type": "object", "properties": _DECODING}, **_DECODING}},
    },
})


class CheckpointError(RuntimeError):
    """A file that is not a readable checkpoint of this format (truncated, corrupt, foreign)."""


@dataclass
class Checkpoint:
    model: dict
    config: dict | None = None
    optimizer: dict | None = None
    schedule: dict | None = None
    rng: dict | None = None
    extra: dict = field(default_factory=dict)
    scaler: dict | None = None

    def require_finite(self, name: str, dtype=np.float32) -> None:
        """Refuse a model with a NaN or infinite weight in ``dtype``, the one it will be used in
        (a float64 1e39 is finite until it becomes float32; ``name``: the checkpoint, for the
        message): it decodes to garbage with finite scores, and an export would deploy it.
        Training never saves one (train.py's guards); a damaged or foreign file can hold one."""
        for key, value in self.model.items():
            with np.errstate(over="ignore"):  # the overflow is what is counted
                bad = np.size(value) - int(np.isfinite(np.asarray(value).astype(dtype)).sum())
            if bad:
                raise CheckpointError(f"{name}: the weight {key} is not finite in {np.dtype(dtype)} ({bad} of "
                                      f"{np.size(value)} values NaN, infinite or beyond its range); refusing to use it")


def save_checkpoint(path: str, model, optimizer=None, schedule=None, extra: dict | None = None,
                    scaler=None) -> None:
    """Write model, optimiser, schedule, loss scaler, RNG state, config and ``extra`` to
    ``path`` atomically."""
    arrays = {f"model/{k}": v for k, v in model.state_dict().items()}
    meta = {
        "format": FORMAT, "version": VERSION,
        "config": model.config.to_dict() if hasattr(model, "config") else None,
        "schedule": schedule.state_dict() if schedule is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": backend.get_rng_state(),
        "extra": extra or {},
        "optimizer": None,
    }
    if optimizer is not None:
        state = optimizer.state_dict()
        for name in ("m", "v"):
            for i, a in enumerate(state.pop(name)):
                if a is not None:
                    arrays[f"optim/{name}/{i}"] = a
        state["num_params"] = len(optimizer.params)
        meta["optimizer"] = state
    # Strict JSON, as load_checkpoint reads it: a NaN in the metadata is a bug, found here.
    arrays["__meta__"] = np.frombuffer(json.dumps(meta, allow_nan=False).encode(), dtype=np.uint8)

    with atomic_write(path, "wb") as f:
        np.savez(f, **arrays)


def load_checkpoint(path: str, metadata_only: bool = False) -> Checkpoint:
    """Read a checkpoint; ``metadata_only`` reads only its config, schedule and extra (npz
    members are read on access), leaving ``model`` empty and the optimiser's moments None."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "__meta__" not in archive.files:
                raise CheckpointError(f"{path} is an .npz archive but not a minitransformer checkpoint "
                                      f"(no __meta__ entry)")
            meta = loads(archive["__meta__"].tobytes(), f"{path}: its metadata", CheckpointError)
            arrays = {} if metadata_only else {k: archive[k] for k in archive.files if k != "__meta__"}
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, UnicodeDecodeError) as e:
        size = os.path.getsize(path)
        raise CheckpointError(
            f"{path} ({size} bytes) is not a readable minitransformer checkpoint: truncated, "
            f"corrupt or another kind of file ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        what = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path} is not a minitransformer checkpoint (format {what!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {meta.get('version')}, "
                              f"this code reads version {VERSION}")
    META.check(meta, str(path), CheckpointError)
    for key, value in arrays.items():  # numbers only: an array of strings is no weight or moment
        if value.dtype.kind not in "fiu":
            raise CheckpointError(f"{path}: {key} holds {value.dtype} values, not numbers")

    model = {k[len("model/"):]: v for k, v in arrays.items() if k.startswith("model/")}
    optimizer = meta["optimizer"]
    if optimizer is not None:
        n = optimizer.pop("num_params")
        for name in ("m", "v"):
            optimizer[name] = [arrays.get(f"optim/{name}/{i}") for i in range(n)]
    return Checkpoint(model=model, config=meta["config"], optimizer=optimizer,
                      schedule=meta["schedule"], rng=meta["rng"], extra=meta["extra"],
                      scaler=meta.get("scaler"))


def verify_checkpoint(path: str) -> None:
    """Raise ``CheckpointError`` unless ``path`` is a checkpoint whose every member reads back
    intact (the zip CRCs), without keeping its arrays in memory: for checking checkpoints long
    before they are loaded (those a run will average when it ends)."""
    load_checkpoint(path, metadata_only=True)  # a minitransformer checkpoint of this version
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from e
    if bad is not None:
        raise CheckpointError(f"{path} is corrupt: its member {bad} does not match its checksum")


def restore(ckpt: Checkpoint, model, optimizer=None, schedule=None, rng: bool = True,
            scaler=None) -> None:
    """Load a checkpoint's state into live objects, so training continues where it stopped."""
    model.load_state_dict(ckpt.model)
    if optimizer is not None and ckpt.optimizer is not None:
        optimizer.load_state_dict(ckpt.optimizer)
    if schedule is not None and ckpt.schedule is not None:
        schedule.load_state_dict(ckpt.schedule)
    if scaler is not None and ckpt.scaler is not None:
        scaler.load_state_dict(ckpt.scaler)
    if rng and ckpt.rng is not None:
        backend.set_rng_state(ckpt.rng)


def average_checkpoints(paths) -> Checkpoint:
    """A checkpoint whose parameters are the mean of those in ``paths`` (config of the last)."""
    paths = list(paths)
    if not paths:
        raise ValueError("average_checkpoints needs at least one path")
    total, last = None, None
    for p in paths:
        last = load_checkpoint(p)
        if total is None:
            total = {k: v.astype(np.float64) for k, v in last.model.items()}
            continue
        if set(last.model) != set(total):
            raise CheckpointError(f"{p} holds different parameters than {paths[0]}")
        for k, v in last.model.items():
            if v.shape != total[k].shape:
                raise CheckpointError(f"{p}: {k} has shape {v.shape}, {paths[0]} has {total[k].shape}")
            total[k] += v
    model = {k: (v / len(paths)).astype(last.model[k].dtype) for k, v in total.items()}
    return Checkpoint(model=model, config=last.config, extra={"averaged_from": paths})
