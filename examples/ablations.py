"""The paper's Table 3 at small scale: vary the base model one choice at a time, compare.

    python examples/ablations.py --list                                       # the rows
    python examples/ablations.py --data-dir ../shared/data/multi30k --rows base,A1,E --max-steps 300
    mpiexec -n 2 python examples/ablations.py --data-dir ../shared/data/multi30k --rows A,D --max-steps 300

Table 3 of "Attention Is All You Need" is where the architecture's choices are justified: each
row changes one thing in the base model and reports dev perplexity and BLEU. Here the base row
is the paper's base model scaled to a 2-core CPU (N=3, d_model=256, d_ff=1024, h=4,
d_k=d_v=64, P_drop=0.1, eps_ls=0.1), trained on the corpus, vocabulary, batches and schedule
of train_wmt.py's ``multi30k`` preset, and the paper's variations are scaled to it:

    (A) h in {1, 2, 8, 16} with d_k = d_v = d_model / h: the computation stays the same
        (section 3.2.2), only how it is split into heads changes
    (B) d_k halved and quartered, d_v kept
    (C) N in {2, 4, 6}; d_model x1/2 and x2 (d_k = d_v = d_model / h follow); d_ff x1/2 and x2
    (D) P_drop in {0, 0.2}; eps_ls in {0, 0.2}
    (E) learned positional embeddings instead of sinusoids

``--rows`` takes row names and group letters (``A,D`` or ``base,A1,E``); the base row is always
trained, as the others are read against it. Every row is a train_wmt.py run in
``--out-dir/<row>``, with the same data, BPE vocabulary (trained once, in ``--out-dir``), seed,
budget (``--max-steps``) and checkpoint averaging, then scored as Table 3
is: train steps, dev perplexity per target BPE token, dev BLEU (sacreBLEU, beam 4, alpha 0.6)
of the averaged model, parameters. The dev set is the validation split; no test set is read.

Under ``mpiexec -n N`` every rank trains its share of the rows one after another, alone (no
data parallelism: a row's result does not depend on how many ranks ran the sweep), with an
equal share of the node's cores for its BLAS (``distributed.init``); one process trains them
all. The ranks share ``--out-dir`` (one machine, or a shared filesystem). A row whose
result.json exists is skipped, and an interrupted row resumes from its last checkpoint, so a
stopped sweep continues where it was. Rank 0 writes table.md (laid out as Table 3: the base
row, then only the settings each row changes), table.json and ablations.png.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass

import train_wmt

from minitransformer import cli, distributed, nn
from minitransformer.decoding import ALPHA, BEAM, translate
from minitransformer.files import atomic_write, lock_folder, save_figure
from minitransformer.settings import SettingsError
from minitransformer.train import evaluate_loss

log = logging.getLogger("ablations")
PRESET = train_wmt.PRESETS["multi30k"]  # corpus, vocabulary, batching and schedule
# The base row (the multi30k preset's model until run r8 chose a narrower one for the hour; the
# README's table was measured around it).
BASE = dict(d_model=256, d_ff=1024, h=4, num_encoder_layers=3, num_decoder_layers=3, dropout=0.1,
            label_smoothing=0.1)
GROUPS = {"A": "heads, at constant computation", "B": "smaller key size", "C": "model size",
          "D": "regularisation", "E": "positions"}


@dataclass(frozen=True)
class Row:
    name: str  # "base", "A1", ...
    group: str  # "" for the base row, else one of GROUPS
    changes: dict  # TransformerConfig fields that differ from the base row's


def table_rows(base: dict) -> list[Row]:
    """Table 3's rows, scaled to the ``base`` model (TransformerConfig fields)."""
    d, d_ff, d_k = base["d_model"], base["d_ff"], base["d_model"] // base["h"]

    def layers(n):
        return dict(num_encoder_layers=n, num_decoder_layers=n)

    changes = {
        "A": [dict(h=h) for h in (1, 2, 8, 16)],
        "B": [dict(d_k=d_k // 2, d_v=d_k), dict(d_k=d_k // 4, d_v=d_k)],
        "C": [layers(2), layers(4), layers(6), dict(d_model=d // 2), dict(d_model=2 * d),
              dict(d_ff=d_ff // 2), dict(d_ff=2 * d_ff)],
        "D": [dict(dropout=0.0), dict(dropout=0.2), dict(label_smoothing=0.0), dict(label_smoothing=0.2)],
        "E": [dict(learned_positions=True)],
    }
    return [Row("base", "", {})] + [Row(f"{group}{i}", group, change) for group, rows in changes.items()
                                    for i, change in enumerate(rows, 1)]


def row_config(base: dict, row: Row, vocab_size: int) -> nn.TransformerConfig:
    """The row's model; an impossible one (h not dividing d_model) ends the program with one line."""
    try:
        return nn.TransformerConfig(vocab_size=vocab_size, **{**base, **row.changes})
    except SettingsError as e:
        raise SystemExit(f"ablations.py: row {row.name} ({describe(row)}): {e}") from None


SHORT = {"num_encoder_layers": "N", "dropout": "P_drop", "label_smoothing": "eps_ls",
         "learned_positions": "learned positions"}


def describe(row: Row) -> str:
    """The row's changes in Table 3's names: "N=2", "d_k=32, d_v=64"."""
    return ", ".join(f"{SHORT.get(k, k)}={v}" for k, v in row.changes.items()
                     if k != "num_decoder_layers") or "the base model"


def select(spec: str, rows: list[Row]) -> list[Row]:
    """The rows that ``spec`` names (names or group letters), in table order, the base row first."""
    by_name = {r.name: r for r in rows}
    wanted = {"base"}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item in GROUPS:
            wanted.update(r.name for r in rows if r.group == item)
        elif item in by_name:
            wanted.add(item)
        else:
            raise SystemExit(f"ablations.py: unknown row {item!r}: choose from {', '.join(by_name)} "
                             f"or a group {', '.join(GROUPS)} (--list shows them)")
    return [r for r in rows if r.name in wanted]


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="A,B,C,D,E", help="row names and group letters, comma-separated")
    p.add_argument("--list", action="store_true", help="print the rows and their settings, and exit")
    p.add_argument("--data-dir", type=cli.data_folder, help="Multi30k folder; downloaded there if files are missing (default: data/multi30k)")
    p.add_argument("--out-dir", type=cli.output_folder, default=os.path.join("runs", "ablations"),
                   help="a folder per row, the shared BPE vocabulary, and the table")
    p.add_argument("--max-steps", type=cli.integer(1),
                   help="optimiser steps per row (comparable on a busy machine; needed unless --list)")
    p.add_argument("--eval-every", type=cli.integer(1), help="validate and checkpoint every N steps (default: a "
                   "tenth of --max-steps)")
    p.add_argument("--average-last", type=cli.integer(1), default=4, help="checkpoints averaged for a row's score "
                   "(with the default --eval-every, the last 30%% of training)")
    p.add_argument("--bleu-sample", type=cli.integer(1), default=20, help="validation sentences beam-searched at "
                   "each checkpoint (the row's score always uses them all)")
    p.add_argument("--seed", type=cli.integer(0), default=1, help="the same for every row")
    for flag, field in (("--d-model", "d_model"), ("--d-ff", "d_ff"), ("--heads", "h"),
                        ("--layers", "num_encoder_layers")):
        p.add_argument(flag, type=cli.integer(1), default=BASE[field], help=f"the base row's {field}")
    # As train_wmt.py reads them (not given: the multi30k preset's, or no limit); a BPE vocabulary
    # has the 4 special ids and at least one piece more.
    for flag, kind in (("--warmup", cli.integer(1)), ("--peak-lr", cli.real(0.0, 1.0, low_open=True)),
                       ("--max-tokens", cli.integer(1)), ("--vocab-size", cli.integer(5)), ("--limit", cli.integer(1))):
        p.add_argument(flag, type=kind,
                       help="as in train_wmt.py (every row trains alone: --max-tokens is its whole batch)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    for flag in ("--lr-factor", "--limit-train", "--limit-val"):
        p.add_removed(flag, train_wmt.REMOVED_OPTIONS[flag])
    p.add_removed("--budget-minutes", "removed: each row trains for --max-steps, so that rows compare whatever "
                                      "the machine's load")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if not (args.list or args.max_steps):
        p.error("give each row a budget: --max-steps")
    args.base = {**BASE, "d_model": args.d_model, "d_ff": args.d_ff, "h": args.heads,
                 "num_encoder_layers": args.layers, "num_decoder_layers": args.layers}
    args.preprocess = PRESET.preprocess  # the preset's text, for train_wmt.read_data
    args.subwords = PRESET.subwords  # and its tokenizer, for train_wmt.tokenizer
    args.selected = select(args.rows, table_rows(args.base))
    for row in args.selected:  # refuse an impossible row now, not after hours of the others
        row_config(args.base, row, vocab_size=1)
    return args


def settings(cfg: nn.TransformerConfig) -> dict:
    """A model's Table 3 columns."""
    return dict(N=cfg.num_encoder_layers, d_model=cfg.d_model, d_ff=cfg.d_ff, h=cfg.h,
                d_k=cfg.d_k or cfg.d_model // cfg.h, d_v=cfg.d_v or cfg.d_model // cfg.h, P_drop=cfg.dropout,
                eps_ls=cfg.label_smoothing, positions="learned" if cfg.learned_positions else "sinusoid")


def print_rows(args) -> None:
    for row in table_rows(args.base):
        columns = settings(row_config(args.base, row, vocab_size=1))
        print(f"{row.name:5} {GROUPS.get(row.group, 'base'):31} {describe(row):24} "
              + " ".join(f"{k}={v}" for k, v in columns.items()))


# --------------------------------------------------------------------------- the sweep


def deal(rows: list[Row], cost: dict, world_size: int) -> list[list[Row]]:
    """Each rank's rows: the costliest row first to the least loaded rank (longest processing
    time first), so that the ranks finish together; each rank's share in table order."""
    load, shares = [0.0] * world_size, [[] for _ in range(world_size)]
    for row in sorted(rows, key=lambda r: -cost[r.name]):
        rank = load.index(min(load))
        load[rank] += cost[row.name]
        shares[rank].append(row)
    return [sorted(share, key=rows.index) for share in shares]


def row_run_args(args, row: Row, progress: bool) -> argparse.Namespace:
    """train_wmt.py's settings for one row (its defaults, then the sweep's)."""
    out_dir = os.path.join(args.out_dir, row.name)
    # The paper's beam search for every row (Table 3: section 6.1's beam 4 and alpha 0.6, whatever
    # train_wmt.py's preset chose for its own test figure), so that a resumed sweep stays comparable.
    run_args = train_wmt.parse_args(["--out-dir", out_dir, "--beam", str(BEAM), "--alpha", str(ALPHA),
                                     "--length-penalty", "gnmt"])
    run_args.argv = None  # train.jsonl records the command that runs this sweep (run_folder.command_line)
    vars(run_args).update(
        data_dir=args.data_dir, seed=args.seed, max_steps=args.max_steps,
        eval_every=args.eval_every or max(1, args.max_steps // 10),
        average_last=args.average_last, bleu_sample=args.bleu_sample, warmup=args.warmup,
        peak_lr=args.peak_lr, max_tokens=args.max_tokens, limit=args.limit,
        vocab_size=args.vocab_size, no_progress=not progress, resume=os.path.exists(os.path.join(out_dir, "last.npz")))
    return run_args


def train_row(args, row: Row, corpus, rank: int, progress: bool) -> dict:
    """Train one row alone (or resume it), score its averaged model on the dev set, and write
    result.json, which marks it finished. The row's folder is held while it trains, as
    train_wmt.py holds its --out-dir: a second sweep into the same folder is refused."""
    run_args = row_run_args(args, row, progress)
    with lock_folder(run_args.out_dir):
        train, val, tok = corpus
        preset = dataclasses.replace(PRESET, model={**args.base, **row.changes}, max_steps=None)  # our budget
        alone = distributed.World(0, 1, 0, "cpu", distributed.LocalCommunicator("cpu"))
        run = train_wmt.prepare(run_args, preset, alone, train, val, tok)
        step, history_s = train_wmt.start_or_resume(run)
        budget = train_wmt.training_budget(run_args, preset, run.batcher)
        step, seconds = train_wmt.train_loop(run, step, history_s, budget)
        averaged = train_wmt.average(run, step)
        _, ppl = evaluate_loss(run.model, run.val_batches)
        hyps = translate(run.model, tok, val.src, "cpu", run_args.beam, run_args.alpha, progress=progress)
        bleu, signature, _ = train_wmt.bleu(hyps, val.tgt)
        result = dict(row=row.name, group=row.group, changes=row.changes, **settings(run.model.config), steps=step,
                      params=run.model.num_parameters(), dev_ppl=ppl, dev_bleu=bleu, signature=signature,
                      dev_sentences=len(val), averaged=[os.path.basename(p) for p in averaged],
                      train_minutes=seconds / 60, steps_per_s=step / max(seconds, 1e-9), rank=rank)
        write_json(os.path.join(run_args.out_dir, "result.json"), result)
        log.info("row %s (%s): %d steps, dev perplexity %.2f, dev BLEU %.2f, %.2f steps/s", row.name,
                 describe(row), step, ppl, bleu, result["steps_per_s"])
        return result


def write_json(path: str, obj) -> None:
    """Written whole or not at all: result.json's existence marks a finished row."""
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2)


def result_path(args, row: Row) -> str:
    return os.path.join(args.out_dir, row.name, "result.json")


def main(argv=None) -> list[dict] | None:
    args = parse_args(argv)
    if args.list:
        print_rows(args)
        return None
    world = distributed.init("cpu")
    tag = f" rank {world.rank}" if world.world_size > 1 else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s{tag} %(name)s: %(message)s", stream=sys.stderr)
    os.makedirs(args.out_dir, exist_ok=True)
    train, val, _, tok = train_wmt.load_data(args, PRESET, world, with_test=False)  # one BPE for all rows
    pending = [r for r in args.selected if not os.path.exists(result_path(args, r))]
    world.comm.barrier()  # every rank has seen which rows were finished before any finishes another
    cost = {r.name: nn.expected_num_parameters(row_config(args.base, r, tok.vocab_size)) for r in pending}
    mine = deal(pending, cost, world.world_size)[world.rank]
    if world.is_main:
        log.info("%d rows, %d finished earlier; %d ranks", len(args.selected), len(args.selected) - len(pending),
                 world.world_size)
    bar = None
    if world.is_main and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(args.selected), unit="row", position=0, dynamic_ncols=True)
    for row in mine:
        if bar is not None:  # the rows every rank has finished, and this rank's current one
            bar.n = sum(os.path.exists(result_path(args, r)) for r in args.selected)
            bar.set_description(f"row {row.name}")
        log.info("row %s (%s)%s", row.name, describe(row),
                 ": resuming" if os.path.exists(os.path.join(args.out_dir, row.name, "last.npz")) else "")
        train_row(args, row, (train, val, tok), world.rank, progress=bar is not None)
    world.comm.barrier()
    if bar is not None:
        bar.n = len(args.selected)
        bar.close()
    if not world.is_main:
        return None
    results = [json.load(open(result_path(args, r))) for r in args.selected]
    table = markdown_table(results, args)
    with atomic_write(os.path.join(args.out_dir, "table.md")) as f:
        f.write(table)
    write_json(os.path.join(args.out_dir, "table.json"),
               dict(budget=dict(max_steps=args.max_steps), rows=results))
    plot(results, os.path.join(args.out_dir, "ablations.png"))
    print(table)
    return results


# --------------------------------------------------------------------------- the table and the plot


COLUMNS = [("N", "N"), ("d_model", "d_model"), ("d_ff", "d_ff"), ("h", "h"), ("d_k", "d_k"), ("d_v", "d_v"),
           ("P_drop", "P_drop"), ("eps_ls", "ε_ls"), ("positions", "positions"), ("steps", "train steps")]


def markdown_table(results: list[dict], args) -> str:
    """Table 3's layout: the base row in full, then in each row only the settings it changes."""
    base = results[0]
    lines = ["| | " + " | ".join(title for _, title in COLUMNS) + " | PPL (dev) | BLEU (dev) | params ×10⁶ |",
             "|---" * (len(COLUMNS) + 4) + "|"]
    group = None
    for r in results:
        label = r["row"] if r["group"] in ("", group) else f"({r['group']}) {r['row']}"
        group = r["group"]
        cells = [str(r[k]) if r is base or r[k] != base[k] else "" for k, _ in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) +
                     f" | {r['dev_ppl']:.2f} | {r['dev_bleu']:.1f} | {r['params'] / 1e6:.2f} |")
    return ("\n".join(lines) + "\n\n"
            f"Multi30k EN→DE, dev = the validation split ({base['dev_sentences']} sentences), {args.max_steps} "
            f"steps a row. Perplexity per target BPE token; BLEU by sacreBLEU ({base['signature']}), beam 4, α 0.6, "
            f"of the average of the last {len(base['averaged'])} checkpoints.\n")


def plot(results: list[dict], png_path: str) -> None:
    """Dev BLEU and perplexity per row, grouped by A-E, the base row as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, rows = results[0], results[1:]
    groups = sorted({r["group"] for r in rows})
    x, at = [], 0
    for r in rows:  # a gap between groups
        at += 1.6 if x and r["group"] != rows[len(x) - 1]["group"] else 1.0
        x.append(at)
    colors = [f"C{groups.index(r['group'])}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 0.55 * len(rows) + 3), 4))
    for ax, key, title in ((axes[0], "dev_bleu", "dev BLEU (higher is better)"),
                           (axes[1], "dev_ppl", "dev perplexity (lower is better)")):
        # Points, not bars from zero: the rows differ by a few percent of their values.
        ax.scatter(x, [r[key] for r in rows], c=colors, s=40, zorder=2)
        ax.axhline(base[key], color="k", lw=1, ls="--", zorder=1)
        ax.set_xticks(x, [r["row"] for r in rows], rotation=90 if len(rows) > 12 else 0)
        ax.set_title(f"{title}\ndashed: the base row, {base[key]:.2f}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, png_path, dpi=120)


def interrupted() -> str | bool:
    """An interrupted sweep continues where it was when its command is run again (rank 0 says so)."""
    if distributed.get_world().is_main:
        return "run the same command again: finished rows are kept, and the interrupted ones resume"
    return False


if __name__ == "__main__":
    # One line for an interrupt, an OSError or a user's error; a SystemExit on one rank ends every rank.
    distributed.run_main(cli.run, main, user_errors=train_wmt.USER_ERRORS, on_interrupt=interrupted)
