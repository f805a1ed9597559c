"""A training run's folder (``examples/train_wmt.py``'s ``--out-dir``), and how a run takes it back up.

What the folder holds: ``train.jsonl`` (a line for each logged step, validation and start of a
part of the run), ``last.npz`` (the checkpoint ``--resume`` continues from, with Adam's moments)
and ``ckpt-<step>.npz`` (those averaged when training ends). Each checkpoint's extra keeps the
run's options as parsed, ``"args"`` (by their dest: ``max_tokens`` for ``--max-tokens``): the
resume record.

    hold(out_dir, world)        the run's lock on its folder, from its first moment to its end
    checkpoints(out_dir)        ckpt-<step>.npz, oldest first
    open_record(args, ...)      --resume's checks from the options alone, before any data is read
    check_data / check_resume   the checks that need the data, then the checkpoint itself
    resume_hint(...)            the line an interrupted run ends with: the command that continues it

``--resume`` continues a run exactly where its last checkpoint left it, so it must be the same
run: the checks refuse, in one line naming the option and what to do, settings that the
checkpoint would silently override or contradict (the model's shape, the precision, the
optimiser, the data, the schedule, a shorter patience), before anything is written. A record
that names an option removed since it was written (``REMOVED``) is read with it mapped to its
replacement, or refused, saying why.

Signals: ``cli.run`` turns Ctrl-C, SIGTERM and SIGHUP into one line and a status; for a run,
that line is ``resume_hint``'s, the command that continues it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable

from minitransformer import distributed, files, records
from minitransformer.checkpoint import CheckpointError, load_checkpoint, verify_checkpoint
from minitransformer.optim import noam_lr

log = logging.getLogger(__name__)


class ResumeError(Exception):
    """A ``--resume`` that cannot continue the run the folder holds; the message says what to do."""


# --------------------------------------------------------------------------- the folder


@contextlib.contextmanager
def hold(out_dir: str, world):
    """The run's hold on ``out_dir``, from its first moment to its end (rank 0 takes it for all
    ranks): a second run started into it is refused, and so is a --resume while it runs."""
    if not world.is_main:
        yield
        return
    with files.lock_folder(out_dir) as left:
        if left:
            log.warning("%s was held by a run that ended without releasing it (%s): taking it over", out_dir, left)
        yield


def checkpoint_step(path: str) -> int | None:
    """The step of ckpt-<step>.npz; None for another ckpt-*.npz (a user's ckpt-best.npz)."""
    stem = os.path.basename(path)[len("ckpt-"):-len(".npz")]
    return int(stem) if stem.isdigit() else None


def checkpoints(out_dir: str) -> list[str]:
    """Step checkpoints ckpt-<step>.npz, oldest first."""
    steps = {p: checkpoint_step(p) for p in glob.glob(os.path.join(out_dir, "ckpt-*.npz"))}
    return sorted((p for p, s in steps.items() if s is not None), key=steps.get)


def remove_unfinished_writes(out_dir: str) -> None:
    """Delete the temporary files that a kill left of the run's writes (checkpoints, the log,
    the tokenizer, results)."""
    stale = files.remove_unfinished_writes(out_dir)
    if stale:
        log.warning("removed %d unfinished write(s) left in %s by an interrupted run: %s",
                    len(stale), out_dir, ", ".join(stale))


def truncate_log(log_path: str, step: int) -> None:
    """Keep the log lines of steps up to ``step`` (those after it will be run again), dropping a
    line torn by a crash; rewritten atomically."""
    rows = records.read_log(log_path, drop_damaged=True) if os.path.exists(log_path) else []
    with files.atomic_write(log_path) as f:
        f.writelines(json.dumps(row) + "\n" for row in rows if row.get("step", math.inf) <= step)


# --------------------------------------------------------------------------- the command


def command_line(script: str, argv: list[str] | None, world) -> list[str]:
    """The command that started this process as a user types it: mpiexec and its ranks, the
    script (called in-process, ``argv`` given: by its path from here if that is shorter) and its
    arguments (``argv``, or ``sys.argv``'s)."""
    if argv is None:
        script, argv = sys.argv[0], sys.argv[1:]
    else:
        script, argv = min(os.path.relpath(script), os.path.abspath(script), key=len), list(argv)
    ranks = ["mpiexec", "-n", str(world.world_size)] if world is not None and world.world_size > 1 else []
    return ranks + ["python", script] + argv


def code_commit() -> str | None:
    """The commit of the code that runs (the checkout this package is in), "+" marking
    uncommitted changes to tracked files; None outside a git checkout (an installed copy)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True)
    except OSError:  # no git
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def resume_hint(out_dir: str, script: str, argv: list[str] | None) -> str | bool:
    """What an interrupted run says last (``cli.run``'s ``on_interrupt``): the command that
    continues it, or that there is nothing to continue yet. Rank 0 alone speaks (False: the
    others end quietly)."""
    try:
        world = distributed.get_world()
    except RuntimeError:  # interrupted before distributed.init
        world = None
    if world is not None and not world.is_main:
        return False
    if not os.path.exists(os.path.join(out_dir, "last.npz")):
        return "no checkpoint was written yet, so there is nothing to resume: run the command again to start over"
    command = command_line(script, argv, world)
    return f"continue with: {shlex.join(command + ([] if '--resume' in command else ['--resume']))}"


# --------------------------------------------------------------------------- the resume record

# Options that a run's record may name but train_wmt.py no longer has (by dest), each with what
# it becomes: a dest of today's (the same setting, renamed), None (it changed nothing that
# --resume checks), or a reason the run cannot be continued by this code.
REMOVED = {
    "limit_train": "limit",  # --limit N takes N training pairs, as --limit-train N did
    "limit_val": None,  # validation and test sets, never part of what a resume must match
    "limit_test": None,
    "lr_factor": None,  # the schedule itself is in the checkpoint, and a resume keeps it
    "time_budget": None,  # runs end by their steps or epochs now (see upgrade)
    "bpe_dropout": "its training side was segmented anew each epoch by BPE-dropout, which train_wmt.py no "
                   "longer does (a study now, experiments/bpe_dropout/)",
}


def upgrade(record: dict, path: str) -> dict:
    """The resume record ``record`` (a checkpoint's ``"args"``) in today's options: each removed
    option mapped to its replacement (``REMOVED``), or a ResumeError saying why the run cannot
    go on. A time budget is dropped with a warning: the run now ends at its steps or epochs."""
    flags = {k: v for k, v in record.items() if k not in REMOVED}
    for key, becomes in REMOVED.items():
        value = record.get(key)
        if value is None or (key == "bpe_dropout" and value == 0):  # not given, or off
            continue
        if becomes is not None and " " in becomes:
            raise ResumeError(f"{path} was trained with --{key.replace('_', '-')} {value}: {becomes}. Finish it "
                              f"with the code that started it, or start a new run")
        if becomes is not None:
            flags[becomes] = value
        elif key == "time_budget":
            log.warning("%s was trained with --time-budget %s, which train_wmt.py no longer has: it trains on to "
                        "its --max-steps or --epochs", path, value)
    return flags


def _with(flag: str, value) -> str:
    """How a run was trained as to ``flag``: "with --x 3", or "without --x" when it was not given."""
    return f"without {flag}" if value is None else f"with {flag} {value}"


def patience_extends(before: int, now: int) -> bool:
    """Whether --patience ``now`` stops a run no earlier than ``before`` does, wherever it is (0: never)."""
    return now == before or now == 0 or (before != 0 and now > before)


def open_record(args, model_config: Callable[[int], object]) -> dict:
    """What --resume can check from the options alone, before minutes of reading, vocabulary
    training and encoding: that ``args.out_dir`` holds a run, that ``model_config(vocab_size)``
    builds the model it holds, and that the options that make the run the same run (precision,
    optimiser, patience, accumulation) are the run's. Returns the last checkpoint's extra, its
    ``"args"`` upgraded (``upgrade``)."""
    path = os.path.join(args.out_dir, "last.npz")
    if not os.path.exists(path):
        raise ResumeError(f"--resume: {path} does not exist, so {args.out_dir} holds no run to continue; "
                          f"drop --resume to start one there")
    meta = load_checkpoint(path, metadata_only=True)
    saved = meta.config or {}
    now = vars(model_config(saved.get("vocab_size", 1)))
    for flag, key in (("--d-model", "d_model"), ("--d-ff", "d_ff"), ("--layers", "num_encoder_layers"),
                      ("--layers", "num_decoder_layers"), ("--dropout", "dropout"),
                      ("--label-smoothing", "label_smoothing"), ("--init", "init"),
                      ("--decoder-start", "decoder_start")):
        if key in saved and saved[key] != now[key]:
            raise ResumeError(f"{path} holds a model with {flag} {saved[key]}, but these settings give "
                              f"{now[key]}: resume with {flag} {saved[key]}, or start a new run")
    differ = [f"{k} {saved[k]} (now {now[k]})" for k in saved if k in now and saved[k] != now[k]]
    if differ:
        raise ResumeError(f"{path} holds a model with {', '.join(differ)}: resume with the run's "
                          f"--preset and model flags, or start a new run")
    extra = dict(meta.extra)
    flags = extra["args"] = upgrade(extra.get("args", {}), path)
    # Another precision would train on from a loss scale and rounding the run never had, another
    # --accumulate on steps of another size, and from other batches; another optimiser would
    # make the run's figure one of no recipe.
    for flag, key, default in (("--precision", "precision", None), ("--adam-eps", "adam_eps", None),
                               ("--clip-norm", "clip_norm", None), ("--accumulate", "accumulate", 1)):
        was = flags.get(key, default)
        if was is not None and was != getattr(args, key):
            raise ResumeError(f"{path} was trained with {flag} {was}, not {getattr(args, key)}: resume with "
                              f"{flag} {was}, or start a new run")
    # The stopping rule decides only where a run ends, never what it trains on, so a longer
    # patience (or none, 0) continues the very run it would have been from the start; a shorter
    # one might have stopped it earlier than where it is.
    if "patience" in flags and not patience_extends(flags["patience"], args.patience):
        raise ResumeError(f"{path} was trained with --patience {flags['patience']}, not {args.patience}: a shorter "
                          f"patience might have stopped it before now; resume with --patience {flags['patience']} "
                          f"or longer (0: never), or start a new run")
    return extra


def check_data(args, saved: dict, train, where: str) -> None:
    """Refuse, naming the option or the data, to resume on other training data than the run's
    (``saved``: ``open_record``'s; ``train``: the corpus read from ``where``, as the options
    give it). Runs from before the corpus fingerprint have only the tokenizer's check."""
    path = os.path.join(args.out_dir, "last.npz")
    flags = saved.get("args", {})
    for flag, key in (("--limit", "limit"), ("--vocab-size", "vocab_size"), ("--preprocess", "preprocess"),
                      ("--subwords", "subwords")):
        if key in flags and flags[key] != getattr(args, key):
            raise ResumeError(f"{path} was trained {_with(flag, flags[key])}, not {_with(flag, getattr(args, key))}: "
                              f"resume {_with(flag, flags[key])}, or start a new run")
    corpus = saved.get("corpus")
    if corpus is not None and corpus["fingerprint"] != train.fingerprint:
        raise ResumeError(f"{path} was trained on other data than {len(train)} pairs of {where} give now "
                          f"({corpus['pairs']} pairs, fingerprint {corpus['fingerprint']}, now {train.fingerprint}): "
                          f"resume with the run's training data, or start a new run")


def check_resume(args, ckpt, tokenizer: str, averaged: list[str]) -> None:
    """Refuse, in one line naming the option, to resume with a tokenizer (file name) or a
    schedule other than the checkpoint's, which it would silently override; and check the
    checkpoints ``averaged`` when training ends, so that a bad one is found now, not after
    training."""
    path = os.path.join(args.out_dir, "last.npz")
    saved_tok = ckpt.extra.get("tokenizer")
    if saved_tok is not None and saved_tok != tokenizer:
        raise ResumeError(f"{path} was trained with the tokenizer {saved_tok}, but these settings give {tokenizer}: "
                          f"resume with the run's --limit, --vocab-size and --subwords")
    sched = ckpt.schedule or {}
    if args.warmup is not None and "warmup" in sched and sched["warmup"] != args.warmup:
        raise ResumeError(f"{path} was trained with --warmup {sched['warmup']}, not {args.warmup}: a resumed run "
                          f"keeps its schedule; drop --warmup or start a new run")
    if args.peak_lr and "factor" in sched:
        peak = noam_lr(sched["warmup"], sched["d_model"], sched["warmup"], sched["factor"])
        if not math.isclose(peak, args.peak_lr, rel_tol=1e-12):
            raise ResumeError(f"{path} was trained to a peak rate of {peak:.6g}, not --peak-lr {args.peak_lr}: a "
                              f"resumed run keeps its schedule; drop --peak-lr or start a new run")
    for p in averaged:
        try:
            verify_checkpoint(p)
        except CheckpointError as e:
            raise CheckpointError(f"{e}. It is one of the checkpoints averaged when training ends: "
                                  f"delete it (the others are averaged) and resume again") from e
