"""Choose the decoding settings of a trained run on the validation set: how many of its last
checkpoints to average, the beam size and the length penalty alpha.

    python examples/tune_decoding.py --run runs/multi30k --data-dir ../shared/data/multi30k \
        --average 1,5,10 --beam 4,8 --alpha 0.6,1.0,1.4

Every combination beam-searches the whole validation split and is scored with sacreBLEU (and in
the Multi30k literature's metric, by which a ``moses-lc`` run's settings are chosen); the
table also gives the length ratio (hypotheses over references), since a ratio below 1 costs
the brevity penalty exp(1 - 1/ratio). The test split is never read here: settings are chosen
on validation, and the test set gives the final figure once (train_wmt.py's --beam, --alpha
and --average-last apply them). The table goes to stdout and into <run>/decoding_sweep.json,
which keeps the rows of earlier sweeps of the run (a setting swept again replaces its row), so
that a grid built over several calls stays in one file.

Each row's translations go to <run>/val-avg<N>-beam<B>-alpha<A>[-fairseq].hyp, one sentence a line, so
that two runs (or two settings) can be compared on the same sentences with sacreBLEU's paired
bootstrap, which says whether a difference is larger than the split's sampling noise:

    sacrebleu <(gunzip -c ../shared/data/multi30k/val.de.gz) --paired-bs \
        -i runs/baseline/val-avg5-beam8-alpha2.hyp runs/candidate/val-avg5-beam8-alpha2.hyp

That noise is not the only one: two trainings of one configuration with different seeds can
differ by more (about a BLEU point on Multi30k, docs/guide/reproducing.md).

The run folder must still hold the checkpoints to average: train_wmt.py keeps the last
--average-last of them, so train with an --average-last at least as large as the largest --average here. A finished run
takes the chosen settings with ``train_wmt.py --resume --average-last N --beam B --alpha A``: it
trains no more, and averages and scores the test set again.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import json
import os
import time

from train_wmt import PRESETS, checkpoints
from translate import find_run_files, model_from, refuse_wide_beams, text_settings

from minitransformer import backend, cli, data, decoding, records
from minitransformer.bleu import bleu_scores
from minitransformer.checkpoint import CheckpointError, average_checkpoints, load_checkpoint
from minitransformer.files import atomic_write
from minitransformer.decoding import translate


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=cli.input_folder, required=True, help="a train_wmt.py --out-dir with its ckpt-<step>.npz files")
    p.add_argument("--data-dir", type=cli.data_folder, required=True, help="the corpus folder")
    p.add_argument("--preset", choices=sorted(PRESETS), default="multi30k", help="names the corpus")
    p.add_argument("--average", type=cli.comma_list(cli.integer(1)), default=[5],
                   help="numbers of last checkpoints to average, comma-separated")
    p.add_argument("--beam", type=cli.comma_list(cli.integer(1)), default=[4], help="beam sizes, comma-separated")
    p.add_argument("--alpha", type=cli.comma_list(cli.real(0.0, decoding.ALPHA_MAX)), default=[0.6],
                   help="length penalties, comma-separated")
    p.add_argument("--length-penalty", choices=decoding.LENGTH_PENALTIES,
                   help="what alpha shapes: gnmt or fairseq (default: the run's)")
    p.add_argument("--limit", type=cli.integer(1), help="a toy size: the first N validation pairs (none: all)")
    p.add_argument("--device", default="cpu", type=cli.device, choices=backend.DEVICES, help="where the model decodes")
    p.add_removed("--limit-val", "--limit N (the first N validation pairs)")
    return p


def main(argv=None) -> list[dict]:
    p = build_parser()
    args = p.parse_args(argv)
    checkpoint, tokenizer = find_run_files(args.run)
    records.read_sweep(os.path.join(args.run, "decoding_sweep.json"))  # damaged: said now, not after the decoding
    # A moses-lc run reads and writes lowercased Moses tokens: it is scored on them in the
    # literature's metric, and chosen by that figure (it has no cased one).
    length_penalty, preprocess = text_settings(load_checkpoint(checkpoint, metadata_only=True), args.length_penalty)
    tokenized = preprocess == "moses-lc"
    tok = data.open_tokenizer(tokenizer)
    refuse_wide_beams(p, args.beam, tok)
    val = data.load_corpus(PRESETS[args.preset].corpus, args.data_dir, "val")
    split = "val"
    if args.limit:
        val = val.subset(range(min(args.limit, len(val))))
        split = f"val{len(val)}"
    src = data.moses.preprocess(val.src, "en", preprocess)
    refs_tok = data.moses.moses_lc(val.tgt, "de")  # once for the sweep, not once a row
    saved = checkpoints(args.run)
    if max(args.average) > len(saved):
        raise SystemExit(f"error: --average {max(args.average)}, but {args.run} keeps {len(saved)} step "
                         f"checkpoints (train with a larger --average-last)")
    rows = []
    for n in args.average:
        paths = saved[-n:]
        model = model_from(average_checkpoints(paths), f"the average of {paths}", args.device, tokenizer=tok)
        for beam in args.beam:
            for alpha in args.alpha:
                start = time.perf_counter()
                out = translate(model, tok, src, args.device, beam, alpha, length_penalty=length_penalty)
                hyps = data.moses.detokenize(out, "de") if tokenized else out
                scores = bleu_scores(hyps, val.tgt, "de", tokens=out if tokenized else None, refs_tokens=refs_tok)
                seconds = time.perf_counter() - start
                penalty = "" if length_penalty == "gnmt" else f"-{length_penalty}"
                name = f"{split}-avg{n}-beam{beam}-alpha{alpha:g}{penalty}.hyp"
                with atomic_write(os.path.join(args.run, name)) as f:
                    f.writelines(h + "\n" for h in hyps)
                rows.append(dict(average=n, first=os.path.basename(paths[0]), last=os.path.basename(paths[-1]),
                                 beam=beam, alpha=alpha, length_penalty=length_penalty, **scores,
                                 seconds=seconds, sentences=len(val), hypotheses=name))
                cased = "n/a" if scores["bleu"] is None else f"{scores['bleu']:6.2f}"
                print(f"average {n:2d}  beam {beam:2d}  alpha {alpha:4.2f}:  BLEU {cased:>6}  "
                      f"(lowercased {scores['bleu_lowercased']:6.2f}, literature {scores['literature']:6.2f})  "
                      f"length ratio {scores['length_ratio']:.3f}  "
                      f"({seconds:.1f} s)", flush=True)
    figure = "literature" if tokenized else "bleu"
    best = max(rows, key=lambda r: r[figure])
    signature = best["signature_literature"] if tokenized else best["signature"]
    print(f"\nbest on {len(val)} validation sentences: average {best['average']}, beam {best['beam']}, "
          f"alpha {best['alpha']} ({length_penalty}): {'literature' if tokenized else 'BLEU'} {best[figure]:.2f}"
          f"\nsignature: {signature}")
    save_rows(os.path.join(args.run, "decoding_sweep.json"), rows)
    return rows


def save_rows(path: str, rows: list[dict]) -> None:
    """Merge ``rows`` into the sweep file at ``path``: a row of the same checkpoints, beam, alpha,
    length penalty and sentence count replaces the earlier one; the others stay, in their order."""
    def key(row):
        # Rows from before the length penalty was a choice were GNMT's.
        return tuple(row[k] for k in ("first", "last", "average", "beam", "alpha", "sentences")) + (
            row.get("length_penalty", "gnmt"),)

    kept = {key(r): r for r in records.read_sweep(path)}
    kept.update((key(r), r) for r in rows)
    with atomic_write(path) as f:
        json.dump(list(kept.values()), f, indent=2)


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError, CheckpointError, records.RecordError))
