"""BLEU against target tokens seen: a training run scored on the validation split as it goes on,
each score a point of a record, and the record's curve.

    python experiments/bleu_tokens/bleu_tokens.py --run runs/multi30k --data-dir ../shared/data/multi30k
    python experiments/bleu_tokens/bleu_tokens.py --run runs/multi30k --test   # the run's own test figure
    python experiments/bleu_tokens/bleu_tokens.py                               # only redraw the curve

With --run, the run's averaged model (averaged.npz: the last checkpoints, averaged when
train_wmt.py finished) translates the whole validation split with the run's beam and alpha
(its bleu.json), and sacreBLEU scores it, cased and lowercased; the point (steps, target
tokens seen, both scores with their signatures, the date, the commit that scored it) goes
into --record. With --test, no decoding: the test figure that train_wmt.py printed at the
run's end (bleu.json) goes in instead, as a point of its own; read it once, for the final
figure. Then the curve is drawn from the whole record into --plot.

Target tokens seen: the mean target tokens of the steps train.jsonl logs (every --log-every
steps), times the steps.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import datetime
import json
import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "experiments" / "reproduction")]  # train_wmt, reproduction's anchor

import train_wmt  # noqa: E402
from minitransformer import cli, data, files, records, run_folder  # noqa: E402
from minitransformer.bleu import bleu_scores  # noqa: E402
from reproduction import ANCHOR  # noqa: E402 - the anchor's printed figures

RECORD = HERE / "bleu_tokens.json"
PLOT = HERE / "bleu_tokens.png"
# The literature's text-only Transformer-tiny on Multi30k: lowercased BLEU on test_2016_flickr
# after some 65M target tokens (8,000 updates of about 8,192 tokens on 2 GPUs).
LITERATURE = {"bleu_lowercased": ANCHOR["score"], "target_tokens": 65e6}


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=cli.input_folder, help="a train_wmt.py output folder whose training has "
                   "finished (it has averaged.npz and bleu.json); without it, only the curve is drawn")
    p.add_argument("--data-dir", type=cli.data_folder, help="the corpus folder (default: train_wmt.py's)")
    p.add_argument("--test", action="store_true", help="record the run's test figure from its bleu.json "
                   "instead of scoring the validation split")
    p.add_argument("--record", type=cli.output_file, default=str(RECORD), help="the points (JSON)")
    p.add_argument("--plot", type=cli.output_file, default=str(PLOT), help="the curve (PNG)")
    p.add_argument("--note", default="", help="the machine's state while the run trained, kept with the point")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def logged(run: Path, steps: int) -> dict[str, list[dict]]:
    """What train.jsonl logged at or before ``steps``, by kind ("train", "val")."""
    out = {"train": [], "val": []}
    for r in records.read_log(run / "train.jsonl"):
        if r.get("kind") in out and r["step"] <= steps:
            out[r["kind"]].append(r)
    return out


def target_tokens(train_log: list[dict], steps: int) -> float:
    return sum(r["tokens"] for r in train_log) / len(train_log) * steps


def validation_nll(val_log: list[dict]) -> float | None:
    """The last logged validation NLL: the model of that step, not the average; it varies less
    between seeds than BLEU does."""
    return round(val_log[-1]["loss"], 4) if val_log else None


def score_validation(run: Path, result: dict, data_dir: str | None, progress: bool) -> dict:
    import translate as translate_cli

    from minitransformer.decoding import translate

    checkpoint, tokenizer_path = translate_cli.find_run_files(str(run))
    if not checkpoint.endswith("averaged.npz"):
        raise SystemExit(f"{run} has no averaged.npz: let its training finish first")
    tokenizer = data.Tokenizer(tokenizer_path)
    model = translate_cli.load_model(checkpoint, "cpu", tokenizer=tokenizer)
    preset = train_wmt.PRESETS[result["preset"]]
    val = data.load_corpus(preset.corpus, data_dir or os.path.join("data", preset.corpus), "val")
    preprocess = result.get("preprocess", "raw")  # a moses-lc run reads and writes Moses tokens
    out = translate(model, tokenizer, data.moses.preprocess(val.src, "en", preprocess), "cpu", result["beam"],
                    result["alpha"], progress=progress, length_penalty=result.get("length_penalty", "gnmt"))
    tokenized = preprocess == "moses-lc"
    hyps = data.moses.detokenize(out, "de") if tokenized else out
    return dict(split="val", sentences=len(val), **bleu_scores(hyps, val.tgt, "de", tokens=out if tokenized else None))


def add_point(args) -> dict:
    run = Path(args.run)
    if not run.is_dir():
        raise SystemExit(f"--run {run}: no such folder")
    if not (run / "bleu.json").exists():
        raise SystemExit(f"{run} has no bleu.json: let its training finish first")
    result = records.read_result(run / "bleu.json")
    if args.test:
        point = dict(split="test", sentences=result["test_sentences"], bleu=result["bleu"],
                     signature=result["signature"], bleu_lowercased=result["bleu_lowercased"],
                     signature_lowercased=result["signature_lowercased"], length_ratio=result["length_ratio"])
    else:
        point = score_validation(run, result, args.data_dir, not args.no_progress)
    log = logged(run, result["steps"])
    if not log["train"]:
        raise SystemExit(f"{run / 'train.jsonl'} logs no training step")
    point.update(steps=result["steps"], target_tokens=round(target_tokens(log["train"], result["steps"])),
                 validation_nll=validation_nll(log["val"]),
                 beam=result["beam"], alpha=result["alpha"], averaged=result["averaged"], run=str(run),
                 parts=result.get("parts", []),  # each part's command, commit and start (train_wmt.py)
                 date=datetime.date.today().isoformat(), scored_at=run_folder.code_commit(), note=args.note)
    return point


def plot(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), layout="constrained")
    for split, marker, style in (("val", "o", "-"), ("test", "s", "none")):
        chosen = sorted((p for p in points if p["split"] == split), key=lambda p: p["target_tokens"])
        if not chosen:
            continue
        x = [p["target_tokens"] / 1e6 for p in chosen]
        ax.plot(x, [p["bleu"] for p in chosen], marker=marker, ls=style, color="#2f5f9f", label=f"{split}, cased")
        ax.plot(x, [p["bleu_lowercased"] for p in chosen], marker=marker, ls=style, color="#c0392b",
                label=f"{split}, lowercased")
        for p, xi in zip(chosen, x):
            ax.annotate(f"{p['bleu_lowercased']:.2f}", (xi, p["bleu_lowercased"]), textcoords="offset points",
                        xytext=(-6, 5) if split == "val" else (0, -13), ha="right" if split == "val" else "center",
                        fontsize=8, color="#c0392b")
    ax.plot([LITERATURE["target_tokens"] / 1e6], [LITERATURE["bleu_lowercased"]], marker="*", ms=12, ls="none",
            color="#444", label="literature's Transformer-tiny, test, lowercased")
    ax.annotate(f"{LITERATURE['bleu_lowercased']:.2f}", (LITERATURE["target_tokens"] / 1e6, LITERATURE["bleu_lowercased"]),
                textcoords="offset points", xytext=(10, 0), ha="left", va="center", fontsize=8, color="#444")
    ax.set_xlabel("target tokens seen (millions)")
    ax.set_ylabel("sacreBLEU (13a)")
    ax.set_title("The multi30k preset, one run continued: BLEU against target tokens seen")
    ax.set_xlim(left=0, right=max(p["target_tokens"] for p in points) / 1e6 * 1.1)
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    files.save_figure(fig, path)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    record = records.read_points(args.record)
    if args.test and not args.run:
        raise SystemExit("--test needs --run")
    if args.run:
        point = add_point(args)
        record["points"] = [p for p in record["points"] if (p["split"], p["steps"], p["run"]) !=
                            (point["split"], point["steps"], point["run"])] + [point]
        with files.atomic_write(args.record) as f:
            json.dump(record, f, indent=1)
        print(f"{point['split']} BLEU {point['bleu']:.2f} ({point['signature']}), lowercased "
              f"{point['bleu_lowercased']:.2f} ({point['signature_lowercased']}), after {point['steps']} steps, "
              f"{point['target_tokens'] / 1e6:.1f}M target tokens")
    if record["points"]:
        plot(record["points"], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, user_errors=(data.CorpusError, records.RecordError)))
