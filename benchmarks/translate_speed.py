"""Decoding speed on the CPU, side by side in one run: our batched beam search against the same
model exported to CTranslate2 (float32 and int8), on the same sentences in the same batches.

    OMP_NUM_THREADS=2 python benchmarks/translate_speed.py --run runs/multi30k --data-dir ../shared/data/multi30k
    ... --beam 8 --alpha 2.0 --profile 25 --hyps ours.ids   # the preset's search, profiled, outputs kept
    ... --engines ours --parts      # ours alone, then where its time goes, part by part

The test set's first ``--limit`` sources are cut into our translate batches (length-sorted,
about ``--max-tokens`` source tokens each); every engine decodes exactly those batches with the
same beam size. Every batch is decoded by every engine in turn, a different one first each time,
so that a machine shared with other work (whose speed here drifts by a third within minutes)
slows them alike, batch by batch. A repeat's seconds are an engine's sum over the batches; the
figures are medians over the repeats, and a speed ratio is the median of the repeats' own
ratios. Threads: NumPy's BLAS and CTranslate2 both get ``OMP_NUM_THREADS`` (default: every core).

Columns: wall seconds for all sentences, target tokens per second (the hypotheses' tokens and
their EOS: one decoder step each), sentences per second, sacreBLEU of the output, and speed
relative to CTranslate2 float32. CTranslate2 searches with its own length penalty (L^alpha), so
its output and BLEU differ a little from ours; ``examples/export_ctranslate2.py`` measures how
little. Without ctranslate2 installed (``pip install -e ".[export]"``) only our row is measured.

``--parts`` decodes once more, ours alone, with a clock around each part of the search (the
encoder, the decoder layers and inside them the Linear layers' products, attention, layer norm
and the cache's appends, the vocabulary projection, its log-softmax, the candidates, the cache
reorder): a profile without a profiler's cost per call, so that its parts add up to the
decoding's real seconds.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from minitransformer import cli, data, decoding, export, files, nn, records  # noqa: E402
from minitransformer.functional.attention import ScaledDotProductAttention  # noqa: E402
from minitransformer.functional.layernorm import LayerNorm  # noqa: E402
from minitransformer.functional.matmul import Linear  # noqa: E402
from minitransformer.decoding import beam_search  # noqa: E402
from minitransformer.checkpoint import CheckpointError  # noqa: E402
from train_wmt import bleu  # noqa: E402
from translate import find_run_files, load_model, refuse_wide_beams  # noqa: E402


def engines(model, tok, folder: str, threads: int, beam: int, alpha: float) -> dict:
    """name -> function(padded batch, its sources without EOS) -> hypotheses (ids)."""
    found = {"ours": lambda batch, src: beam_search(model, batch.src, beam, alpha)}
    try:
        export._ctranslate2()
    except ImportError as e:
        print(f"{e}: the CTranslate2 rows are skipped")
        return found
    pieces = export.Pieces(tok)
    for quantization in ("float32", "int8"):
        path = export.to_ctranslate2(model, tok, os.path.join(folder, quantization),
                                     None if quantization == "float32" else quantization)
        found[f"ct2 {quantization}"] = functools.partial(
            _ctranslate2, export.load_translator(path, threads), pieces, beam, alpha)
    return found


def _ctranslate2(translator, pieces, beam: int, alpha: float, batch, src):
    return export.ctranslate2_translate(translator, pieces, src, beam, alpha)


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=cli.input_folder, required=True, help="a train_wmt.py --out-dir")
    p.add_argument("--data-dir", type=cli.data_folder, default="data/multi30k", help="Multi30k folder (test_2016_flickr)")
    p.add_argument("--limit", type=cli.integer(1), default=1000, help="test sentences")
    p.add_argument("--beam", type=cli.integer(1), default=decoding.BEAM, help="beam size, for every engine")
    p.add_argument("--alpha", type=cli.real(0.0, decoding.ALPHA_MAX), default=decoding.ALPHA, help="length penalty, for every engine")
    p.add_argument("--max-tokens", type=cli.integer(1), default=2048, help="source tokens per batch, as translate.py")
    p.add_argument("--repeats", type=cli.integer(1), default=3, help="runs of every engine; the figures are medians")
    p.add_argument("--json", type=cli.output_file, help="write the figures here")
    p.add_argument("--profile", type=cli.integer(1), metavar="N",
                   help="then decode once more, ours alone, under cProfile, and print its N most costly functions")
    p.add_argument("--parts", action="store_true",
                   help="then decode once more, ours alone, and print the seconds each part of the search took")
    p.add_argument("--engines", choices=("all", "ours"), default="all",
                   help="ours: time our search alone (CTranslate2 is not exported or run)")
    p.add_argument("--hyps", type=cli.output_file, help="write our hypotheses here, one line of token ids per sentence (to compare "
                   "two commits' outputs)")
    p.add_argument("--record", action="store_true", help="append the figures to benchmarks/records/translate_speed.jsonl")
    return p


def record(args, parser, argv: list[str], sentences: int, rows: dict) -> None:
    """The run's line in benchmarks/records/translate_speed.jsonl: each engine's seconds and
    our speed over CTranslate2 float32's (the median of the repeats' ratios, as printed). A
    test set or batches other than the defaults' are part of the configuration."""
    config = {"beam": args.beam, "alpha": args.alpha}
    if args.limit != parser.get_default("limit"):
        config["sentences"] = sentences
    if args.max_tokens != parser.get_default("max_tokens"):
        config["max_tokens"] = args.max_tokens
    names = {"ours": "ours_s", "ct2 float32": "ct2_float32_s", "ct2 int8": "ct2_int8_s"}
    figures = {names[name]: row["seconds"] for name, row in rows.items()}
    if "vs_ct2_float32" in rows["ours"]:
        figures["speed_vs_ct2"] = rows["ours"]["vs_ct2_float32"]
    print(f"recorded in {records.record(__file__, argv, config, figures)}")


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))
    checkpoint, tokenizer = find_run_files(args.run)
    tok = data.Tokenizer(tokenizer)
    refuse_wide_beams(p, [args.beam], tok)
    model = load_model(checkpoint, "cpu", tokenizer=tok)
    test = data.load_multi30k(args.data_dir, "test_2016_flickr")
    n = min(args.limit, len(test))
    src = tok.encode(test.src[:n])
    batcher = data.TokenBatcher(src, max_tokens=args.max_tokens, shuffle=False)
    batches = [batcher.make_batch(indices) for indices in batcher.epoch_batches(0)]

    with tempfile.TemporaryDirectory() as folder:
        runs = engines(model, tok, folder, threads, args.beam, args.alpha)
        if args.engines == "ours":
            runs = {"ours": runs["ours"]}
        names = list(runs)
        seconds = {name: [0.0] * args.repeats for name in names}
        hyps = {name: [None] * n for name in names}
        turn = 0
        for r in range(args.repeats):
            for batch in batches:
                sources = [src[i] for i in batch.indices]
                for j in range(len(names)):
                    name = names[(turn + j) % len(names)]
                    start = time.perf_counter()
                    out = runs[name](batch, sources)
                    seconds[name][r] += time.perf_counter() - start
                    for i, h in zip(batch.indices, out):
                        hyps[name][i] = h
                turn += 1

    print(f"{n} sentences of test_2016_flickr in {len(batches)} batches (max {args.max_tokens} source tokens), "
          f"beam {args.beam}, alpha {args.alpha}, {threads} threads; median of {args.repeats} repeats")
    print(f"{'engine':12s} {'seconds':>8s} {'tokens/s':>9s} {'sents/s':>8s} {'BLEU':>6s} {'vs ct2 fp32':>11s}")
    rows = {}
    for name, times in seconds.items():
        t = statistics.median(times)
        tokens = sum(len(h) + 1 for h in hyps[name])
        rows[name] = dict(seconds=t, all_seconds=times, tokens_per_s=tokens / t, sentences_per_s=n / t,
                          bleu=bleu(tok.decode(hyps[name]), test.tgt[:n])[0])
    base = seconds.get("ct2 float32")
    for name, r in rows.items():
        if base:  # each repeat's ratio: the two engines' sums over the same batches, decoded side by side
            r["vs_ct2_float32"] = statistics.median(b / s for b, s in zip(base, seconds[name]))
        ratio = f"{r['vs_ct2_float32']:.2f}x" if base else "-"
        print(f"{name:12s} {r['seconds']:8.2f} {r['tokens_per_s']:9.0f} {r['sentences_per_s']:8.1f} "
              f"{r['bleu']:6.2f} {ratio:>11s}")
    if args.hyps:
        with files.atomic_write(args.hyps) as f:
            f.writelines(" ".join(map(str, h)) + "\n" for h in hyps["ours"])
    if args.profile:
        profile(runs["ours"], batches, src, args.profile)
    if args.parts:
        result_parts = parts(model, runs["ours"], batches, src)
    result = dict(sentences=n, batches=len(batches), beam=args.beam, alpha=args.alpha, threads=threads,
                  max_tokens=args.max_tokens, repeats=args.repeats, engines=rows)
    if args.parts:
        result["parts"] = result_parts
    if args.json:
        with files.atomic_write(args.json) as f:
            f.write(json.dumps(result, indent=2) + "\n")
    if args.record:
        record(args, p, sys.argv[1:] if argv is None else argv, n, rows)
    return result


def profile(decode, batches, src, top: int) -> None:
    """Our decoding of every batch under cProfile: the ``top`` functions by their own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for batch in batches:
        decode(batch, [src[i] for i in batch.indices])
    profiler.disable()
    print(f"\nours under cProfile, the {top} functions that cost most time of their own:")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)


# The parts of a beam search step that --parts times: (label, owner, attribute, enclosing part);
# "name()": the function that calling the attribute returns (the search's projection). Inner
# parts are counted only inside their enclosing one (the vocabulary projection is a Linear too,
# but not one of the decoder layers').
PARTS = (
    ("encoder", "model", "encode", None),
    ("decoder layers", "model", "decode", None),
    ("  of which the Linear layers' products", Linear, "forward", "decoder layers"),
    ("  of which attention", ScaledDotProductAttention, "forward", "decoder layers"),
    ("  of which layer norm", LayerNorm, "forward", "decoder layers"),
    ("  of which the cache's appends", nn.KVCache, "append", "decoder layers"),
    ("vocabulary projection", "model", "projector()", None),
    ("log-softmax over the vocabulary", decoding, "log_softmax_parts_", None),
    ("candidates (bound, survivors, sort)", decoding, "_score_candidates", None),
    ("cache reorder", decoding, "_reorder", None),
)


def parts(model, decode, batches, src) -> dict:
    """Our decoding of every batch with a clock around each of ``PARTS``: label -> seconds, and
    what the parts leave (the search's own bookkeeping) as "the rest"."""
    seconds = {label: 0.0 for label, *_ in PARTS}
    inside = set()  # the top-level parts running now

    def timed(label, fn, parent):
        def run(*args, **kwargs):
            if parent is not None and parent not in inside:
                return fn(*args, **kwargs)
            inside.add(label)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start
                inside.discard(label)
        return run

    def timed_made(label, make):  # time the function that make() returns
        return lambda *args, **kwargs: timed(label, make(*args, **kwargs), None)

    patched = []
    for label, owner, name, parent in PARTS:
        owner = model if owner == "model" else owner
        made = name.endswith("()")
        name = name.removesuffix("()")
        original = vars(owner).get(name)  # None: the model's method, which lives on its class
        fn = getattr(owner, name)
        wrapper = timed_made(label, fn) if made else timed(label, fn, parent)
        setattr(owner, name, staticmethod(wrapper) if isinstance(original, staticmethod) else wrapper)
        patched.append((owner, name, original))
    try:
        start = time.perf_counter()
        for batch in batches:
            decode(batch, [src[i] for i in batch.indices])
        total = time.perf_counter() - start
    finally:
        for owner, name, original in reversed(patched):
            if original is not None:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the model's own wrapper goes; its class's method shows again
    seconds["the rest (the search's bookkeeping)"] = total - sum(
        s for (label, *_, parent), s in zip(PARTS, seconds.values()) if parent is None)
    seconds["total"] = total
    print("\nours, each part of the search timed around its calls:")
    for label, s in seconds.items():
        print(f"  {label:42s} {s:7.2f} s")
    return seconds


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError, CheckpointError))
