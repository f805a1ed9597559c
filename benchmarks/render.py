"""Render the record into tables: ``benchmarks/records/*.jsonl`` -> ``benchmarks/README.md`` and
the results table of the project's README.

    python benchmarks/render.py          # rewrite the tables between their markers
    python benchmarks/render.py --check  # exit 1 if a committed table is not what the records give

Each benchmark and study run with ``--record`` appends one line to its record (what was run,
where, when, and what it gave: ``minitransformer.records``). The tables show the current
figure of each configuration: its latest line, and for runs that differ only by their seed,
the mean over the seeds' latest lines. Nothing here is typed by hand, so a figure cannot
change in one place and stay behind in another.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import json
import pathlib
import re
import statistics
import sys
from dataclasses import dataclass, field

from minitransformer import cli
from minitransformer.records import RecordError, read_bench

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "records"
END = "<!-- end -->"


@dataclass
class Table:
    """How one record is shown in benchmarks/README.md: its configuration's columns and its
    figures' columns, each a (header, key, format) triple."""
    config: list[tuple[str, str, str]]
    figures: list[tuple[str, str, str]]


TABLES = {
    "multi30k": Table([("recipe", "recipe", "{}")],  # BLEU on test_2016_flickr
                      [("literature", "literature", "{:.2f}"), ("sacreBLEU lowercased", "bleu_lowercased", "{:.2f}"),
                       ("sacreBLEU cased", "bleu", "{:.2f}"), ("updates", "updates", "{:,.0f}"),
                       ("minutes of training", "train_minutes", "{:.1f}")]),
    "translate_speed": Table([("beam", "beam", "{}"), ("α", "alpha", "{}")],
                             [("ours", "ours_s", "{:.2f} s"), ("CTranslate2 float32", "ct2_float32_s", "{:.2f} s"),
                              ("CTranslate2 int8", "ct2_int8_s", "{:.2f} s"), ("our speed / CTranslate2's", "speed_vs_ct2", "{:.2f}×")]),
    "train_step": Table([("device", "device", "{}"), ("setup", "setup", "{}")],
                        [("ours", "ours_ms", "{:.1f} ms"), ("torch.nn.Transformer", "torch_ms", "{:.1f} ms"),
                         ("our time / torch's", "time_vs_torch", "{:.2f}×"), ("our time / its GEMM floor", "vs_gemm_floor", "{:.2f}")]),
    "allreduce": Table([("device", "device", "{}"), ("ranks", "ranks", "{}")],
                       [(f"bus GB/s at {size}", f"GB/s at {size}", "{:.2f}") for size in ("4 KiB", "64 KiB", "1 MiB", "4 MiB", "64 MiB")]),
    "attn": Table([("device", "device", "{}"), ("dtype", "dtype", "{}"), ("causal", "causal", "{}")],
                  [("our speed / PyTorch's SDPA", "speed_vs_torch", "{:.2f}×"), ("best TFLOP/s", "tflops_max", "{:.1f}"),
                   ("NumPy twin's speed / the composite's", "twin_speed_vs_composite", "{:.2f}×"),
                   ("global sectors / fewest", "global_sectors_vs_fewest", "{:.2f}"),
                   ("shared wavefronts / fewest", "shared_wavefronts_vs_fewest", "{:.2f}"), ("cases", "cases", "{}")]),
    "parameters": Table([("preset", "preset", "{}")], [("parameters", "parameters", "{:,}"), ("the paper's", "paper", "{}")]),
    "mutation": Table([("kernel", "kernel", "{}")],
                      [("killed", "killed", "{}"), ("survived", "survived", "{}"), ("equivalent", "equivalent", "{}"),
                       ("identical", "identical", "{}"), ("stillborn", "stillborn", "{}"), ("score", "score", "{:.3f}")]),
    "ci": Table([("tier", "tier", "{}")], [("seconds, cold", "seconds", "{:.0f}"), ("passed", "passed", "{:,}"),
                                           ("skipped", "skipped", "{}")]),
    "gpu_check": Table([("device", "device", "{}"), ("GPUs", "gpus", "{}")],
                       [(f"{stage}, s", f"{stage}_s", "{:.0f}") for stage in
                        ("build", "kernels", "parity", "ddp", "attn", "step", "nccl", "suite", "ncu", "wmt")]
                       + [("all, s", "total_s", "{:.0f}")]),
}


@dataclass
class Result:
    """A row of the README's results table: one figure of one configuration of a record."""
    what: str
    record: str
    config: dict
    figure: str
    fmt: str
    against: str
    reproduce: str = field(default="")


RESULTS = [
    Result("Multi30k EN→DE BLEU, the one-hour main job (literature's metric)", "multi30k", {"recipe": "main job"},
           "literature", "{:.2f}", "41.02 (Wu et al. 2021, on GPUs)", "multi30k"),
    Result("the same, cased sacreBLEU", "multi30k", {"recipe": "main job"}, "bleu", "{:.2f}", "", "multi30k"),
    Result("the anchor's recipe reproduced, `--preset multi30k-tiny` (3-4 h)", "multi30k",
           {"recipe": "multi30k-tiny (the anchor's)"}, "literature", "{:.2f}", "41.02 (Wu et al. 2021)", "multi30k"),
    Result("beam search speed, beam 4, 1,000 sentences", "translate_speed", {"beam": 4, "alpha": 0.6},
           "speed_vs_ct2", "{:.2f}×", "CTranslate2 float32 (1.00×)", "translate-speed"),
    Result("training step time, d_model 256, 3+3 layers", "train_step", {"device": "cpu", "setup": "benchmark batch, one process"},
           "time_vs_torch", "{:.2f}×", "torch.nn.Transformer (1.00×)", "train-step"),
    Result("parameters, base", "parameters", {"preset": "base"}, "parameters", "{:,}", "65M (the paper's Table 3)", "parameters"),
    Result("parameters, big", "parameters", {"preset": "big"}, "parameters", "{:,}", "213M (the paper's Table 3)", "parameters"),
    Result("fused attention, forward + backward, bf16, causal, on a GPU", "attn",
           {"device": "cuda", "dtype": "bf16", "causal": "yes"}, "speed_vs_torch", "{:.2f}×",
           "PyTorch's scaled_dot_product_attention", "attention-kernels"),
    Result("training step time on a GPU", "train_step", {"device": "cuda"}, "time_vs_torch", "{:.2f}×",
           "torch.nn.Transformer", "train-step"),
]


# The README's reading order of the source, each file with its length counted when rendered.
READING = [
    ("minitransformer/tensor.py", "`Tensor`: an array, its gradient, and the op that made it"),
    ("minitransformer/autograd.py", "the backward walk: topological order, the chain rule, accumulation"),
    ("minitransformer/functional/attention.py", "scaled dot-product attention (section 3.2.1), its backward equation by equation"),
    ("minitransformer/functional/loss.py", "cross-entropy with label smoothing (section 5.4)"),
    ("minitransformer/nn/attention.py", "multi-head attention (section 3.2.2)"),
    ("minitransformer/nn/transformer.py", "the encoder, the decoder and the model (section 3.1)"),
    ("minitransformer/optim/adam.py", "Adam (section 5.3)"),
    ("minitransformer/train.py", "the training step: the textbook one, then the robust one"),
    ("minitransformer/decoding.py", "beam search with the KV cache"),
    ("minitransformer/kernels/reference/attention.py", "the fused attention kernel's NumPy twin: tiles and the online softmax"),
    ("csrc/attention.cu", "the CUDA kernel itself"),
    ("examples/train_wmt.py", "the main job, from raw text to BLEU"),
]


def reading_order() -> str:
    rows = []
    for path, what in READING:
        with open(ROOT / path, encoding="utf-8") as f:
            rows.append([f"[`{path}`]({path})", f"{sum(1 for _ in f):,}", what])
    return markdown(["file", "lines", "what it holds"], rows)


def load(name: str) -> list[dict]:
    path = RECORDS / f"{name}.jsonl"
    return read_bench(path) if path.exists() else []


def groups(rows: list[dict]) -> list[list[dict]]:
    """The current measurements, grouped: the latest line of each configuration, and the
    configurations that differ only by ``seed`` together, in the order they first appear."""
    latest: dict[str, dict] = {}
    for row in rows:
        latest[json.dumps(row["config"], sort_keys=True)] = row
    grouped: dict[str, list[dict]] = {}
    for row in latest.values():
        key = json.dumps({k: v for k, v in row["config"].items() if k != "seed"}, sort_keys=True)
        grouped.setdefault(key, []).append(row)
    return list(grouped.values())


def figure(group: list[dict], key: str, fmt: str) -> str:
    """A figure of a group: the mean over its seeds (the seeds' own figures after it)."""
    values = [row["figures"][key] for row in group if key in row["figures"]]
    if not values:
        return ""
    if not all(isinstance(v, (int, float)) for v in values):  # a range as measured: "1.5-1.6"
        return ", ".join(dict.fromkeys(map(str, values)))
    if len(set(values)) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ({', '.join(fmt.format(v) for v in values)})"


def dates(group: list[dict]) -> str:
    first, last = min(r["date"] for r in group), max(r["date"] for r in group)
    return first if first == last else f"{first} to {last[5:]}"


def where(group: list[dict]) -> str:
    commits = ", ".join(dict.fromkeys(r["commit"] for r in group))
    return f"{dates(group)}, {commits}, {' / '.join(dict.fromkeys(r['machine'] for r in group))}"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows])


def seeds(group: list[dict]) -> str:
    found = [str(r["config"]["seed"]) for r in group if "seed" in r["config"]]
    return ", ".join(found)


def table(name: str, rows: list[dict]) -> str:
    """benchmarks/README.md's table of one record, and the commands behind it."""
    spec = TABLES[name]
    current = groups(rows)
    figures = [f for f in spec.figures if any(f[1] in r["figures"] for g in current for r in g)]
    with_seeds = any(seeds(g) for g in current)
    header = [h for h, _, _ in spec.config] + (["seeds"] if with_seeds else []) + [h for h, _, _ in figures] + ["when, commit, machine"]
    body = []
    for g in current:
        cells = [fmt.format(g[0]["config"].get(key, "")) for _, key, fmt in spec.config]
        cells += [seeds(g)] if with_seeds else []
        cells += [figure(g, key, fmt) for _, key, fmt in figures]
        body.append(cells + [where(g)])
    # runs that differ by their seed differ by --seed alone: one command for them all
    commands = "\n".join(dict.fromkeys(f"    {re.sub(r'--seed [0-9]+', '--seed S', r['command'])}"
                                        for g in current for r in g))
    notes = {}  # note -> the rows it is about
    for g in current:
        for r in g:
            if r.get("note"):
                row = ", ".join(fmt.format(r["config"].get(k, "")) for _, k, fmt in spec.config)
                notes.setdefault(r["note"], []).append(row + (f" seed {r['config']['seed']}" if "seed" in r["config"] else ""))
    text = markdown(header, body) + "\n\nRun as:\n\n" + commands
    if notes:
        every = sum(len(g) for g in current)
        text += "\n\n" + "\n".join(f"- {note}" if len(rows) == every else f"- {'; '.join(rows)}: {note}"
                                    for note, rows in notes.items())
    return text


def short_machine(machine: str) -> str:
    """"2-core x86_64, no GPU" -> "2 CPU cores"; a GPU's name as it is."""
    cores, _, rest = machine.partition("-core ")
    return f"{cores} CPU cores" if rest.endswith("no GPU") else machine


def results() -> str:
    """The README's results table: each row's current figure, or "not yet measured"."""
    body = []
    for r in RESULTS:
        match = [g for g in groups(load(r.record)) if all(g[0]["config"].get(k) == v for k, v in r.config.items())]
        if match:
            g = match[-1]
            mean, _, each = figure(g, r.figure, r.fmt).partition(" (")
            cell = f"**{mean}**" + (f", mean of {len(g)} seeds" if each else "")
            when = f"{max(row['date'] for row in g)}, {short_machine(g[0]['machine'])}"
        else:
            cell, when = "not yet measured", ""
        body.append([r.what, cell, r.against, when, f"[how](benchmarks/README.md#{r.reproduce})"])
    return markdown(["", "ours", "against", "measured", "reproduce"], body)


def rendered() -> dict[pathlib.Path, dict[str, str]]:
    """For each file, the text due between each of its markers."""
    names = sorted(p.stem for p in RECORDS.glob("*.jsonl"))
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise RecordError(f"{RECORDS / (unknown[0] + '.jsonl')}: no table for this record in render.py's TABLES")
    return {ROOT / "benchmarks" / "README.md": {n: table(n, load(n)) for n in names},
            ROOT / "README.md": {"results": results(), "reading-order": reading_order()}}


def fill(path: pathlib.Path, blocks: dict[str, str]) -> tuple[str, str]:
    """``path``'s text, and that text with each ``<!-- render.py: NAME -->`` ... ``<!-- end -->``
    block refilled. A page is a regular file (a link to one is followed): a FIFO or a device,
    read once, could not be compared and written back."""
    if not path.is_file():
        raise RecordError(f"{path}: not a regular file: a page to refill must be one")
    text = old = path.read_text(encoding="utf-8")
    for name, block in blocks.items():
        start = f"<!-- render.py: {name} -->"
        if text.count(start) != 1:
            raise RecordError(f"{path}: needs the marker {start} once, followed by {END} (found {text.count(start)})")
        head, rest = text.split(start, 1)
        if END not in rest:
            raise RecordError(f"{path}: {start} has no {END} after it")
        text = f"{head}{start}\n{block}\n{END}{rest.split(END, 1)[1]}"
    return old, text


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from the records")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        due = {path: fill(path, blocks) for path, blocks in rendered().items()}
    except RecordError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 2
    stale = [path for path, (old, new) in due.items() if old != new]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)}: its tables differ from benchmarks/records/: run python benchmarks/render.py",
                  file=sys.stderr)
        return 1 if stale else 0
    from minitransformer.files import atomic_write

    for path in stale:
        with atomic_write(path) as f:
            f.write(due[path][1])
        print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
