"""The WMT14 pipeline at WMT14's size, without the download: a generated corpus of its shape,
then every stage the main job runs before its first step, timed, with its peak memory.

    python experiments/wmt_scale/wmt_scale.py --json runs/wmt_scale/result.json   # 0.5M, 1M, 2M, 4.5M pairs
    python experiments/wmt_scale/wmt_scale.py --pairs 20000 40000 --vocab-size 2000  # a smoke test

The corpus (``write_corpus``) is drawn from a seed, so that every run sees the same text. Each
side draws words from a Zipfian vocabulary of its own, 1,000,000 word types (rank r with
probability proportional to 1 / r^1.05), each a string of 2 to 14 letters. Sentence lengths
in words are log-normal, mean about 23 and a long tail (WMT14 EN-DE's training text: 4.5M
pairs, some 23 words a sentence), at most 250; a German sentence's length is its English
one's times a factor around 0.95. The --json holds the statistics drawn (mean, median and
99th percentile of the lengths, word types seen per side).

The stages, each in a process of its own, so that its peak memory (ru_maxrss) is its own and
includes what the main job holds at that point (the text, then the ids):

    generate    write train.en.gz and train.de.gz
    read        data.read_parallel: the text into memory
    tokenizer   sentencepiece BPE at the wmt14 preset's 37,000 pieces, trained on its sample
                of 4,000,000 sentences (TokenizerConfig.input_sentence_size)
    encode      encode_packed, both sides
    plan        TokenBatcher: one epoch's batches (the preset's 25,000 tokens, max_len 256)
    draw        every batch of that epoch collated
    checkpoint  the base and big presets' checkpoints written, read, and two averaged (once:
                they do not grow with the corpus)
    step        one CPU training step (forward, backward, Adam) of the base and the big model
                at the largest token budget that fits in --memory-gb: the paper's 25,000
                tokens a step, else half of it, and so on (sentences of 32 tokens a side, a
                37,000-piece vocabulary); its seconds (median of --steps) and peak memory (once)

and for each stage the growth exponent: the slope of log seconds (and of log peak memory)
against log pairs, fitted over the sizes run.

With --json the results are written after each size, and a run given the same --json goes on
from the first size it does not hold.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import functools
import gzip
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import minitransformer as mt
from minitransformer import cli, data, nn
from minitransformer.checkpoint import average_checkpoints, load_checkpoint, save_checkpoint
from minitransformer.files import atomic_write
from minitransformer.optim import Adam
from minitransformer.train import accumulated_step

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import train_step as step_benchmark  # noqa: E402 - benchmarks/train_step.py, for its random batches

STAGES = ("generate", "read", "tokenizer", "encode", "plan", "draw")
WORD_TYPES = 1_000_000
ZIPF_EXPONENT = 1.05
MAX_WORDS = 250
LETTERS = {"en": "abcdefghijklmnopqrstuvwxyz", "de": "abcdefghijklmnopqrstuvwxyzäöüß"}
PRESETS = {"base": nn.TransformerConfig.base, "big": nn.TransformerConfig.big}  # Table 3, 37,000 pieces
STEP_TOKENS = 25_000  # the paper's batch: about 25,000 source and 25,000 target tokens (section 5.1)
STEP_LEN = 32


# --------------------------------------------------------------------------- the corpus


@functools.cache
def vocabulary(lang: str, seed: int) -> np.ndarray:
    """WORD_TYPES distinct letter strings of 2 to 14 letters, in rank order."""
    rng = np.random.default_rng([seed, len(lang), ord(lang[0])])
    letters = np.array(list(LETTERS[lang]))
    words: dict[str, None] = {}
    while len(words) < WORD_TYPES:
        ends = np.cumsum(np.clip(rng.poisson(5.5, WORD_TYPES), 2, 14))
        text = "".join(letters[rng.integers(0, len(letters), int(ends[-1]))])
        words.update(dict.fromkeys(text[a:b] for a, b in zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist())))
    return np.array(list(words)[:WORD_TYPES])


def sentence_lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """English and German lengths in words of ``n`` pairs."""
    en = np.clip(np.round(rng.lognormal(np.log(19.0), 0.62, n)), 1, MAX_WORDS).astype(np.int64)
    de = np.clip(np.round(en * rng.lognormal(np.log(0.95), 0.15, n)), 1, MAX_WORDS).astype(np.int64)
    return en, de


def zipf_ranks(count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` word ranks in [0, WORD_TYPES), P(r) proportional to 1 / (r + 1)^ZIPF_EXPONENT."""
    cdf = np.cumsum(1.0 / np.arange(1, WORD_TYPES + 1) ** ZIPF_EXPONENT)
    return np.searchsorted(cdf, rng.random(count) * cdf[-1])


def write_corpus(folder: Path, pairs: int, seed: int, chunk: int = 200_000) -> dict:
    """train.en.gz and train.de.gz of ``pairs`` pairs; returns the statistics drawn."""
    folder.mkdir(parents=True, exist_ok=True)
    stats = {}
    for lang, side in (("en", 0), ("de", 1)):
        words = vocabulary(lang, seed)
        rng = np.random.default_rng([seed, pairs, side])
        lengths, seen = [], np.zeros(WORD_TYPES, bool)
        with (atomic_write(folder / f"train.{lang}.gz", "wb") as raw,  # no name or time in the header:
              gzip.GzipFile("", "wb", compresslevel=1, fileobj=raw, mtime=0) as f):  # the same bytes each time
            for start in range(0, pairs, chunk):
                n = min(chunk, pairs - start)
                en, de = sentence_lengths(n, np.random.default_rng([seed, start]))  # the pair's lengths agree
                counts = (en, de)[side]
                ranks = zipf_ranks(int(counts.sum()), rng)
                seen[ranks] = True
                text = words[ranks]
                lines = [" ".join(s) for s in np.split(text, np.cumsum(counts)[:-1])]
                f.write(("\n".join(lines) + "\n").encode("utf-8"))
                lengths.append(counts)
        lengths = np.concatenate(lengths)
        stats[lang] = {"mean_words": round(float(lengths.mean()), 2), "median_words": float(np.median(lengths)),
                       "p99_words": round(float(np.percentile(lengths, 99)), 1), "max_words": int(lengths.max()),
                       "word_types_seen": int(seen.sum())}
    return stats


# --------------------------------------------------------------------------- the stages


def run_stage(stage: str, folder: Path, pairs: int, seed: int, vocab_size: int) -> dict:
    """One stage in this process: {"seconds", "peak_mb", ...}. What it needs of the stages
    before it is read from their files, or done again, outside the clock."""
    def done(out: dict, start: float) -> dict:
        return out | {"seconds": round(time.perf_counter() - start, 2),
                      "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}

    start = time.perf_counter()
    if stage == "generate":
        return done({"corpus": write_corpus(folder, pairs, seed)}, start)
    corpus = data.read_parallel(folder / "train.en.gz", folder / "train.de.gz")
    if stage == "read":
        return done({}, start)
    model = folder / f"spm-{vocab_size}.model"
    if stage == "tokenizer":
        config = data.TokenizerConfig(vocab_size=vocab_size, input_sentence_size=data.PRESETS["wmt14"].input_sentence_size)
        start = time.perf_counter()
        data.train_tokenizer(itertools.chain(corpus.src, corpus.tgt), model, config)
        return done({}, start)
    tok = data.Tokenizer(model)
    start = time.perf_counter()
    src, tgt = (data.encode_packed(tok, texts) for texts in (corpus.src, corpus.tgt))
    if stage == "encode":
        return done({"pieces": int(len(src.data) + len(tgt.data))}, start)
    del corpus  # the main job keeps the ids, not the text
    start = time.perf_counter()
    batcher = data.TokenBatcher(src, tgt, max_tokens=25_000, max_len=256, seed=seed)
    steps = batcher.steps_per_epoch(0)
    if stage == "plan":
        return done({"steps": steps}, start)
    start = time.perf_counter()
    tokens = sum(batch.num_tgt_tokens for batch in batcher.iter_epoch(0))
    return done({"steps": steps, "target_tokens": tokens}, start)


def checkpoints(folder: Path) -> dict:
    """The base and big presets' checkpoints (37,000-piece vocabulary) written, read and two
    averaged, in this process."""
    out = {}
    for name in PRESETS:
        model = nn.Transformer(PRESETS[name]())
        paths = [str(folder / f"{name}-{i}.npz") for i in range(2)]
        start = time.perf_counter()
        for p in paths:
            save_checkpoint(p, model)
        written = time.perf_counter()
        load_checkpoint(paths[0])
        loaded = time.perf_counter()
        average_checkpoints(paths)
        out[name] = {"write_s": round(written - start, 2), "read_s": round(loaded - written, 2),
                     "average_s": round(time.perf_counter() - loaded, 2),
                     "megabytes": round(os.path.getsize(paths[0]) / 2**20)}
        for p in paths:
            os.remove(p)
    out["peak_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


def training_step(preset: str, tokens: int, steps: int) -> dict:
    """``steps`` timed training steps of ``preset`` (after one untimed) on random batches of
    ``tokens`` target tokens, in this process: {"seconds" (median), "peak_mb"}."""
    mt.manual_seed(0)
    model = nn.Transformer(PRESETS[preset]())
    opt = Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    rng = np.random.default_rng(0)
    b, vocab = max(1, tokens // STEP_LEN), model.config.vocab_size
    times = []
    for _ in range(1 + steps):
        src, tgt_in, tgt_out = map(mt.tensor, step_benchmark.batch(rng, b, STEP_LEN, vocab))
        start = time.perf_counter()
        accumulated_step(model, opt, None, [(src, tgt_in, tgt_out)], label_smoothing=0.1)
        times.append(time.perf_counter() - start)
    return {"sentences": b, "tokens": b * STEP_LEN, "seconds": round(float(np.median(times[1:])), 1),
            "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def largest_step_that_fits(preset: str, memory_gb: float, steps: int) -> dict:
    """The training step at STEP_TOKENS, halved until it runs in ``memory_gb`` of address space
    (RLIMIT_AS: a budget past it fails its allocation, and nothing else on the machine is
    pushed out of memory): its result, and the budgets that did not fit."""
    tokens, too_large = STEP_TOKENS, []
    limit = int(memory_gb * 2**30)
    while tokens >= STEP_LEN:
        try:
            row = in_subprocess("--stage", "step", "--preset", preset, "--step-tokens", str(tokens),
                                "--steps", str(steps), address_space=limit)
            return row | {"too_large": too_large}
        except MemoryError:
            too_large.append(tokens)
            tokens //= 2
    raise RuntimeError(f"the {preset} model's training step does not fit in {memory_gb} GB at {STEP_LEN} tokens")


def exponent(sizes, values) -> float | None:
    """The slope of log value against log size (least squares), or None under two sizes."""
    if len(sizes) < 2:
        return None
    return round(float(np.polyfit(np.log(sizes), np.log(np.maximum(values, 1e-3)), 1)[0]), 2)


def table(results: dict) -> str:
    """The results as a Markdown table: each stage's seconds and peak MB at every size, and
    their growth exponents."""
    sizes = sorted(results["sizes"], key=int)
    head = " / ".join(f"{int(n) / 1e6:g}M" for n in sizes)
    lines = [f"| stage | seconds at {head} pairs | exponent | peak MB at {head} | exponent |",
             "|---|---|---|---|---|"]
    for stage in STAGES:
        cells = [results["sizes"][n][stage] for n in sizes]
        seconds = " / ".join(f"{c['seconds']:g}" for c in cells)
        memory = " / ".join(f"{c['peak_mb']:,}" for c in cells)
        growth = results["exponents"][stage]
        lines.append(f"| {stage} | {seconds} | {growth['seconds']} | {memory} | {growth['peak_mb']} |")
    return "\n".join(lines)


def in_subprocess(*args: str, address_space: int | None = None) -> dict:
    """This script's --stage ``args`` in a process of its own, with at most ``address_space``
    bytes of it (MemoryError when they are not enough)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         preexec_fn=None if address_space is None else limit)
    if run.returncode and address_space is not None and "out of memory" in run.stderr:  # cli.run's line
        raise MemoryError(f"wmt_scale.py {' '.join(args)}: over {address_space / 2**30:.0f} GB")
    if run.returncode:
        raise RuntimeError(f"wmt_scale.py {' '.join(args)} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def build_parser() -> cli.ArgumentParser:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=cli.integer(1000), nargs="+", default=[500_000, 1_000_000, 2_000_000, 4_500_000],
                        help="corpus sizes to run, in pairs (default: %(default)s)")
    parser.add_argument("--vocab-size", type=cli.integer(5), default=37_000,
                        help="BPE pieces (default: the wmt14 preset's %(default)s)")
    parser.add_argument("--seed", type=cli.integer(0), default=0)
    parser.add_argument("--work-dir", type=cli.output_folder, default=None,
                        help="where the corpora are written (default: a temporary folder, removed after)")
    parser.add_argument("--json", type=cli.output_file, default=None,
                        help="write the results here, after each size; a run given one it wrote goes on from there")
    parser.add_argument("--memory-gb", type=cli.real(0, 1e6, low_open=True), default=22.0,
                        help="the address space a training step may take (default: %(default)s, of 24 GB)")
    parser.add_argument("--steps", type=cli.integer(1), default=3,
                        help="timed training steps of each model, after one untimed (default: %(default)s)")
    parser.add_argument("--no-step", action="store_true", help="leave out the training steps")
    parser.add_argument("--stage", choices=[*STAGES, "checkpoint", "step"], help=argparse.SUPPRESS)  # internal
    parser.add_argument("--corpus", type=cli.input_folder, help=argparse.SUPPRESS)
    parser.add_argument("--preset", choices=list(PRESETS), help=argparse.SUPPRESS)
    parser.add_argument("--step-tokens", type=cli.integer(1), help=argparse.SUPPRESS)
    return parser


def earlier_results(parser: argparse.ArgumentParser, args) -> dict:
    """What a run with the same --json, seed and vocabulary already measured, else nothing."""
    fresh = {"sizes": {}, "vocab_size": args.vocab_size, "seed": args.seed}
    if args.json is None or not Path(args.json).exists():
        return fresh
    try:
        results = json.loads(Path(args.json).read_text())
        known = (results["vocab_size"], results["seed"], results["sizes"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        parser.error(f"--json {args.json}: not a result this script wrote ({type(e).__name__}: {e})")
    if known[:2] != (args.vocab_size, args.seed):
        parser.error(f"--json {args.json} holds a run at --vocab-size {known[0]} --seed {known[1]}: "
                     f"give another file to start a new one")
    return results


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stage == "checkpoint":
        print(json.dumps(checkpoints(Path(args.corpus))))
        return 0
    if args.stage == "step":
        print(json.dumps(training_step(args.preset, args.step_tokens, args.steps)))
        return 0
    if args.stage:
        print(json.dumps(run_stage(args.stage, Path(args.corpus), args.pairs[0], args.seed, args.vocab_size)))
        return 0
    results = earlier_results(parser, args)

    def save():
        if args.json:
            with atomic_write(args.json) as f:
                json.dump(results, f, indent=1)

    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        for pairs in args.pairs:
            if str(pairs) in results["sizes"]:
                print(f"{pairs:>9,} pairs  measured already, in {args.json}", flush=True)
                continue
            folder = Path(work) / str(pairs)
            folder.mkdir()  # --corpus names a folder that exists, the one "generate" writes into too
            row = {}
            for stage in STAGES:
                row[stage] = in_subprocess("--stage", stage, "--corpus", str(folder), "--pairs", str(pairs),
                                           "--seed", str(args.seed), "--vocab-size", str(args.vocab_size))
                print(f"{pairs:>9,} pairs  {stage:<10} {row[stage]['seconds']:8.1f} s  {row[stage]['peak_mb']:6,} MB",
                      flush=True)
            results["sizes"][str(pairs)] = row
            save()
            if folder.exists():  # the next size's corpus needs the disk
                shutil.rmtree(folder)
        if "checkpoint" not in results:
            results["checkpoint"] = in_subprocess("--stage", "checkpoint", "--corpus", work)
            save()
    for preset in [] if args.no_step else PRESETS:
        if preset not in results.setdefault("step", {}):
            results["step"][preset] = largest_step_that_fits(preset, args.memory_gb, args.steps)
            print(f"{preset} training step: {results['step'][preset]}", flush=True)
            save()
    sizes = sorted(results["sizes"], key=int)
    results["exponents"] = {stage: {key: exponent([int(n) for n in sizes], [results["sizes"][n][stage][key] for n in sizes])
                                    for key in ("seconds", "peak_mb")} for stage in STAGES}
    save()
    print(table(results))
    print(json.dumps({key: results[key] for key in ("checkpoint", "step") if key in results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
