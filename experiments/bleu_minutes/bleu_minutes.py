"""BLEU against minutes of training: where a recipe's curve crosses the literature's figure.

    mpiexec -n 2 python examples/train_wmt.py ... --keep-checkpoints 0   # every checkpoint kept
    python experiments/bleu_minutes/bleu_minutes.py --run runs/X --data-dir ../shared/data/multi30k --every 15

At each mark (every --every minutes of training, and the run's last checkpoint), the last
checkpoints written by then are averaged, as train_wmt.py averages at its end (the run's
--average-last of them), and the average translates the validation split with the run's own
decoding (beam, alpha, length penalty; a ``moses-lc`` run's Moses tokens as they are). Each
point, scored three ways (minitransformer.bleu), goes into --record with its minutes, step and
checkpoints; a mark scored already is skipped, so that a record grows as a run goes on. The
curve of every run in the record, in the literature's metric, is drawn into --plot beside the
anchor's 41.02 (Wu et al. 2021, on test), with the first minute where each run reaches it.

Minutes are the run's own clock: the training time a checkpoint records (``train_seconds``,
its validations included), which a resume carries on. ``--split test`` scores the test split
instead: for a final figure, read once; nothing is to be chosen by it.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import datetime
import json
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "experiments" / "reproduction")]  # train_wmt, reproduction's anchor

import train_wmt  # noqa: E402
from reproduction import ANCHOR as ANCHOR_LINE  # noqa: E402 - the anchor's printed figures
from translate import find_run_files, model_from, text_settings  # noqa: E402

from minitransformer import cli, data, files, records, run_folder  # noqa: E402
from minitransformer.bleu import bleu_scores  # noqa: E402
from minitransformer.checkpoint import CheckpointError, average_checkpoints, load_checkpoint  # noqa: E402
from minitransformer.decoding import translate  # noqa: E402

RECORD = HERE / "bleu_minutes.json"
PLOT = HERE / "bleu_minutes.png"
ANCHOR = ANCHOR_LINE["score"]  # Wu et al. (2021), test_2016_flickr, the literature's metric


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=cli.input_folder, help="a train_wmt.py output folder that kept its checkpoints "
                   "(--keep-checkpoints 0); without it, only the curve is drawn")
    p.add_argument("--data-dir", type=cli.data_folder, help="the corpus folder (default: train_wmt.py's)")
    p.add_argument("--every", type=cli.real(0.1, 10_000.0), default=15.0, help="minutes of training between marks")
    p.add_argument("--split", choices=("val", "test"), default="val", help="what the points translate")
    p.add_argument("--label", help="the run's name in the plot (default: its folder's)")
    p.add_argument("--record", type=cli.output_file, default=str(RECORD), help="the points (JSON)")
    p.add_argument("--plot", type=cli.output_file, default=str(PLOT), help="the curves (PNG)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def timeline(run: str) -> list[tuple[float, int, str]]:
    """(minutes trained, step, path) of each step checkpoint the run kept, oldest first."""
    out = []
    for path in run_folder.checkpoints(run):
        extra = load_checkpoint(path, metadata_only=True).extra
        if "train_seconds" not in extra:
            raise CheckpointError(f"{path} does not say when it was written (no train_seconds): not train_wmt.py's")
        out.append((extra["train_seconds"] / 60, int(extra["step"]), path))
    if not out:
        raise SystemExit(f"error: {run} keeps no ckpt-<step>.npz")
    return out


def marks(times: list[float], every: float) -> list[float]:
    """Every ``every`` minutes up to the last checkpoint's time, and that time."""
    end = times[-1]
    return [every * k for k in range(1, math.floor(end / every) + 1) if every * k < end] + [end]


def averaged_at(line: list[tuple[float, int, str]], minutes: float, average: int) -> list[tuple[float, int, str]]:
    """The last ``average`` checkpoints written by ``minutes`` (fewer early on; none before the first)."""
    return [c for c in line if c[0] <= minutes + 1e-9][-average:]


def score_marks(args, record: list[dict]) -> list[dict]:
    """The run's points not in ``record`` yet, scored."""
    run = os.path.normpath(args.run)
    line = timeline(run)
    _, tokenizer_path = find_run_files(run)
    last = load_checkpoint(line[-1][2], metadata_only=True)  # its flags: the run's, as resumed last
    run_args = last.extra.get("args", {})
    preset = train_wmt.PRESETS[run_args.get("preset", "multi30k")]
    average = run_args.get("average_last") or preset.average_last
    length_penalty, preprocess = text_settings(last, None)
    beam = run_args.get("beam") or preset.beam
    alpha = preset.alpha if run_args.get("alpha") is None else run_args["alpha"]
    tok = data.Tokenizer(tokenizer_path)
    split = "test_2016_flickr" if args.split == "test" and preset.corpus == "multi30k" else args.split
    corpus = data.load_corpus(preset.corpus, args.data_dir or os.path.join("data", preset.corpus), split)
    src = data.moses.preprocess(corpus.src, "en", preprocess)
    refs_tokens = data.moses.moses_lc(corpus.tgt, "de")
    tokenized = preprocess == "moses-lc"
    done = {(p["run"], p["split"], tuple(p["averaged"])) for p in record}
    label = args.label or os.path.basename(run)
    points = []
    for minutes in marks([c[0] for c in line], args.every):
        chosen = averaged_at(line, minutes, average)
        names = [os.path.basename(c[2]) for c in chosen]
        if not chosen or (run, args.split, tuple(names)) in done:
            continue
        done.add((run, args.split, tuple(names)))
        paths = [c[2] for c in chosen]
        model = model_from(average_checkpoints(paths), f"the average of {names}", "cpu", tokenizer=tok)
        out = translate(model, tok, src, "cpu", beam, alpha, progress=not args.no_progress,
                        length_penalty=length_penalty)
        hyps = data.moses.detokenize(out, "de") if tokenized else out
        scores = bleu_scores(hyps, corpus.tgt, "de", tokens=out if tokenized else None, refs_tokens=refs_tokens)
        point = dict(run=run, label=label, split=args.split, sentences=len(corpus), mark=round(minutes, 2),
                     minutes=round(chosen[-1][0], 2), step=chosen[-1][1], averaged=names, beam=beam, alpha=alpha,
                     length_penalty=length_penalty, **scores, date=datetime.date.today().isoformat(),
                     scored_at=run_folder.code_commit())
        print(f"{label}: {point['minutes']:7.1f} min, step {point['step']:6d}, {len(names)} averaged: literature "
              f"{scores['literature']:.2f}, length ratio {scores['length_ratio']:.3f}", flush=True)
        points.append(point)
    return points


def crossing(points: list[dict], level: float = ANCHOR) -> float | None:
    """The first minute at which a curve (points in time order) reaches ``level``, between two
    points by a straight line; None if it never does."""
    before = None
    for p in points:
        if p["literature"] >= level:
            if before is None:
                return p["minutes"]
            (x0, y0), (x1, y1) = (before["minutes"], before["literature"]), (p["minutes"], p["literature"])
            return x0 + (level - y0) / (y1 - y0) * (x1 - x0)
        before = p
    return None


def plot(record: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.4), layout="constrained")
    for (label, split), points in sorted(_curves(record).items()):
        x = [p["minutes"] for p in points]
        (drawn,) = ax.plot(x, [p["literature"] for p in points], marker="o", ms=3,
                           ls="-" if split == "val" else "--", label=f"{label} ({split})")
        at = crossing(points)
        if at is not None:
            ax.annotate(f"{at:.0f} min", (at, ANCHOR), textcoords="offset points", xytext=(0, 6), ha="center",
                        fontsize=8, color=drawn.get_color())
    ax.axhline(ANCHOR, color="#444", lw=1, ls=":", label=f"the anchor's {ANCHOR} (Wu et al. 2021, test)")
    ax.axvline(60, color="#999", lw=1, ls="--", label="an hour")
    ax.set_xlabel("minutes of training (2 ranks, validations included)")
    ax.set_ylabel("BLEU, literature's metric\n(lowercased Moses tokens)")
    ax.set_title("BLEU against minutes of training: the last checkpoints by then, averaged")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    with files.atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


def _curves(record: list[dict]) -> dict[tuple[str, str], list[dict]]:
    curves: dict[tuple[str, str], list[dict]] = {}
    for p in record:
        curves.setdefault((p["label"], p["split"]), []).append(p)
    return {k: sorted(v, key=lambda p: p["minutes"]) for k, v in curves.items()}


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    record = records.read_minutes(args.record)
    if args.run:
        record += score_marks(args, record)
        with files.atomic_write(args.record) as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    if not record:
        raise SystemExit(f"error: {args.record} holds no point yet: give --run")
    plot(record, args.plot)
    for (label, split), points in sorted(_curves(record).items()):
        at = crossing(points)
        print(f"{label} ({split}): {points[-1]['literature']:.2f} after {points[-1]['minutes']:.0f} min; "
              + (f"reaches {ANCHOR} at {at:.0f} min" if at is not None else f"never reaches {ANCHOR}"))
    return record


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError, CheckpointError, records.RecordError))
