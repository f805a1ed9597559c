"""The multi30k preset against the literature's recipe, one change at a time, on validation:
each run's BLEU (averaged checkpoints, the preset's beam and alpha) and NLL beside the
preset's own at the same target tokens seen.

    python experiments/bleu_tokens/bleu_tokens.py --run runs/recipe-dropout03 \\
        --record experiments/recipe/recipe.json --plot /tmp/unused.png \\
        --data-dir ../shared/data/multi30k                  # score a finished run
    python experiments/recipe/recipe.py                     # the table and the chart

The preset's points come from bleu_tokens.py's record (the README's run, validation split);
a change is named by the options its run's first command adds to the README's. One run a
change, seed 1: two trainings of one configuration differ by up to a point of validation BLEU
(experiments/README.md), so a difference smaller than that is not a finding; the NLL varies less.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import json
import shlex
import sys
import textwrap
from pathlib import Path

from minitransformer import cli, files, records

HERE = Path(__file__).resolve().parent
RECORD = HERE / "recipe.json"
BASELINE = HERE.parent / "bleu_tokens" / "bleu_tokens.json"
PLOT = HERE / "recipe.png"
WHERE = {"--data-dir", "--out-dir"}  # where a run reads and writes, not what it trains (each takes a value)
HOW = {"--no-progress", "--resume"}


def change(point: dict) -> str:
    """The options the run's first command gives beyond the README's, e.g. "--dropout 0.3"."""
    words = shlex.split(point["parts"][0]["command"])
    words = words[next(i for i, w in enumerate(words) if w.endswith("train_wmt.py")) + 1:]  # any path to it
    kept, words = [], iter(words)
    for word in words:
        if word in WHERE:
            next(words, None)  # its value
        elif word not in HOW:
            kept.append(word)
    return " ".join(kept) or "the preset"


def rows(record: dict, baseline: dict) -> list[dict]:
    """The preset's validation point nearest in target tokens, then each change."""
    changes = [p for p in record["points"] if p["split"] == "val"]
    preset = [p for p in baseline["points"] if p["split"] == "val"]
    if not changes or not preset:
        raise SystemExit("no validation points to compare: score the runs with bleu_tokens.py first")
    tokens = min(p["target_tokens"] for p in changes)
    reference = min(preset, key=lambda p: abs(p["target_tokens"] - tokens))
    out = []
    for p in [reference, *changes]:
        parts = p.get("parts") or [{}]  # the preset's earliest points predate the record of parts
        out.append(dict(change="the preset" if p is reference else change(p), steps=p["steps"], target_tokens=p["target_tokens"], bleu=p["bleu"],
                        bleu_lowercased=p["bleu_lowercased"], length_ratio=p["length_ratio"],
                        validation_nll=p.get("validation_nll"), run=p["run"], commit=parts[0].get("commit")))
    for r in out:
        r["delta_lowercased"] = r["bleu_lowercased"] - out[0]["bleu_lowercased"]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| change | steps | target tokens | val BLEU | lowercased | Δ lowercased | length ratio | val NLL | run, commit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        nll = f"{r['validation_nll']:.3f}" if r["validation_nll"] is not None else "n/a"
        lines.append(f"| {r['change']} | {r['steps']:,} | {r['target_tokens'] / 1e6:.1f}M | {r['bleu']:.2f} | "
                     f"{r['bleu_lowercased']:.2f} | {r['delta_lowercased']:+.2f} | {r['length_ratio']:.3f} | {nll} | "
                     f"{r['run']}{', ' + r['commit'] if r['commit'] else ''} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [textwrap.fill(r["change"], 36, break_on_hyphens=False) for r in rows][::-1]  # several changes at once run long
    lines = sum(name.count("\n") + 1 for name in names)
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.3 * len(rows) + 0.25 * lines), layout="constrained")
    values = [r["bleu_lowercased"] for r in rows][::-1]
    colors = ["#888" if r["change"] == "the preset" else "#2f5f9f" for r in rows][::-1]
    ax.scatter(values, names, s=80, color=colors, zorder=3)  # dots, not bars: the axis does not start at 0
    low = min(values) - 2
    for y, v in enumerate(values):
        ax.annotate(f"{v:.2f}", (v, y), textcoords="offset points", xytext=(9, 0), va="center", fontsize=9)
    ax.axvspan(values[-1] - 1, values[-1] + 1, color="#888", alpha=0.15,
               label="the preset ± 1 point: two seeds of one configuration differ by up to this")
    ax.set_xlim(low, max(values) + 1.5)
    ax.margins(y=0.3)
    ax.set_xlabel("validation BLEU, lowercased (sacreBLEU 13a); averaged checkpoints, beam 8, α 2.0")
    ax.set_title(f"The multi30k preset against the literature's recipe: {rows[0]['target_tokens'] / 1e6:.0f}M target tokens, seed 1")
    fig.legend(fontsize=8, loc="outside lower center")
    ax.grid(axis="x", alpha=0.3)
    files.save_figure(fig, path)


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record", type=cli.input_file, default=str(RECORD), help="the changes' points (default: %(default)s)")
    p.add_argument("--baseline", type=cli.input_file, default=str(BASELINE), help="the preset's points (default: %(default)s)")
    p.add_argument("--plot", type=cli.output_file, default=str(PLOT), help="the chart (default: %(default)s)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    comparison = rows(records.read_points(args.record), records.read_points(args.baseline))
    print(table(comparison))
    plot(comparison, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, user_errors=(records.RecordError,)))
