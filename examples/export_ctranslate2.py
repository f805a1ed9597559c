"""Export a trained run to CTranslate2 (float32 and int8) and check it decodes as we do.

    pip install -e ".[export]"
    python examples/export_ctranslate2.py --run runs/multi30k --data-dir ../shared/data/multi30k

Writes <run>/ctranslate2/float32 and <run>/ctranslate2/int8 (each a model folder that
``ctranslate2.Translator`` loads; the vocabulary is the run's sentencepiece pieces, so give it
``Tokenizer.encode``'s pieces and join its output with sentencepiece), then on the test set:

  * teacher-forced log-probabilities of our beam-search output under both models, the largest
    difference (float32 rounding: a few 1e-6);
  * greedy search: the share of sentences where CTranslate2's output equals ours token for token;
  * beam search: the same share once our length penalty ((5 + L) / 6)^alpha picks among
    CTranslate2's finished hypotheses; and its own beam search (penalty L^alpha), with BLEU,
    for float32 and int8.

Sources are decoded in batches of one length, where CTranslate2's one maximum output length per
batch equals ours per sentence (``export.decode_options``). Where outputs still differ, the
two best scores are compared: a near tie (|difference| < 1e-4) is decided by float32 rounding
in the two engines' different summation orders. Figures go to <run>/ctranslate2/agreement.json.

A run trained on lowercased Moses tokens (``--preprocess moses-lc``) is checked on its test
sources so preprocessed and scored in the literature's metric; agreement.json names the
preprocessing (``"preprocess"``), which a deployment must apply to its input as well
(``minitransformer.data.moses``).
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import json
import os
import sys
from collections import defaultdict

import numpy as np

from minitransformer import cli, data, export, files
from minitransformer.autograd import no_grad
from minitransformer.checkpoint import CheckpointError, load_checkpoint
from minitransformer.decoding import ALPHA_MAX, beam_search, greedy_decode
from minitransformer.functional.softmax import log_softmax_array
from train_wmt import bleu, bleu_literature
from translate import beam_and_alpha, find_run_files, model_from, refuse_wide_beams, text_settings

NEAR_TIE = 1e-4


def same_length_batches(src: list[list[int]], size: int) -> list[list[int]]:
    """Sentence indices grouped by source length, at most ``size`` a group."""
    groups = defaultdict(list)
    for i, ids in enumerate(src):
        groups[len(ids)].append(i)
    return [idx[lo: lo + size] for _, idx in sorted(groups.items()) for lo in range(0, len(idx), size)]


def compare(model, tok, src, score, batches, translators, beam: int, alpha: float) -> dict:
    """The agreement figures; ``score(hyps)`` is the BLEU of detokenized-by-sentencepiece output."""
    pieces = export.Pieces(tok)
    n = len(src)
    ours_greedy, ours_beam = [None] * n, [None] * n
    theirs = {name: {"greedy": [None] * n, "rescored": [None] * n, "native": [None] * n} for name in translators}
    for idx in batches:
        batch = [src[i] for i in idx]
        padded = data.collate(batch).src
        beams = beam_search(model, padded, beam, alpha, return_scores=True)
        for i, g, b in zip(idx, greedy_decode(model, padded), beams):
            ours_greedy[i], ours_beam[i] = g, b
        for name, tr in translators.items():
            greedy = export.ctranslate2_translate(tr, pieces, batch, beam_size=1)
            rescored = export.ctranslate2_beam_search(tr, pieces, batch, beam, alpha)
            native = export.ctranslate2_translate(tr, pieces, batch, beam, alpha)
            for i, g, r, v in zip(idx, greedy, rescored, native):
                theirs[name]["greedy"][i], theirs[name]["rescored"][i], theirs[name]["native"][i] = g, r, v

    figures = {"sentences": n, "beam": beam, "alpha": alpha,
               "ours_bleu": score(tok.decode([h for h, _ in ours_beam]))}
    for name, out in theirs.items():
        differ = [i for i in range(n) if out["rescored"][i][0] != ours_beam[i][0]]
        gaps = [abs(out["rescored"][i][1] - ours_beam[i][1]) for i in differ]
        figures[name] = {
            "greedy_equal": sum(a == b for a, b in zip(ours_greedy, out["greedy"])) / n,
            "beam_equal_rescored": 1 - len(differ) / n,
            "beam_differ_near_ties": sum(g < NEAR_TIE for g in gaps),
            "beam_differ": len(differ),
            "native_beam_bleu": score(tok.decode(out["native"])),
            "native_beam_equal": sum(a == b for a, (b, _) in zip(out["native"], ours_beam)) / n,
        }
    return figures


def teacher_forced_gap(model, tok, translator, src, hyps, size: int = 64) -> float:
    """Largest |log P_ours - log P_ct2| over every token (and EOS) of ``hyps``."""
    pieces, worst = export.Pieces(tok), 0.0
    for lo in range(0, len(src), size):
        s, h = src[lo: lo + size], hyps[lo: lo + size]
        batch = data.collate(s, h, start_id=model.config.start_id)
        with no_grad():
            logp = log_softmax_array(model(batch.src, batch.tgt_in).numpy())
        for row, (ids, theirs) in enumerate(zip(h, export.ctranslate2_log_probs(translator, pieces, s, h))):
            ours = logp[row, np.arange(len(ids) + 1), ids + [data.EOS_ID]]
            worst = max(worst, float(np.abs(ours - theirs).max()))
    return worst


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=cli.input_folder, required=True, help="a train_wmt.py --out-dir")
    p.add_argument("--data-dir", type=cli.data_folder, default="data/multi30k", help="Multi30k folder (test_2016_flickr)")
    p.add_argument("--out", type=cli.output_folder, help="export folder (default: <run>/ctranslate2); an earlier export there is "
                   "replaced as a whole")
    p.add_argument("--limit", type=cli.integer(1), help="check only the first N test sentences")
    p.add_argument("--beam", type=cli.integer(1), help="beam size of the agreement check (default: the run's, "
                   "as translate.py decodes)")
    p.add_argument("--alpha", type=cli.real(0.0, ALPHA_MAX), help="length penalty of the agreement check (default: the "
                   "run's)")
    p.add_argument("--batch-size", type=cli.integer(1), default=64, help="sentences per batch (of one source "
                   "length)")
    p.add_argument("--threads", type=cli.integer(0, os.cpu_count()), default=0,
                   help="CTranslate2's threads, at most the machine's cores (0: its default)")
    p.add_debug()
    return p


EXPORT = ("float32", "int8", "agreement.json")  # what an export folder holds
# The most the float32 export's teacher-forced log-probabilities may differ from ours (float32
# rounding in two engines' summation orders gives a few 1e-6; a wrong export, whole units).
TOLERANCE = 1e-3


class ExportError(Exception):
    """The export does not decode as the model does: it is not put in place."""


def check_out(p: cli.ArgumentParser, out: str) -> None:
    """Refuse, before anything is read or written, an --out folder that holds more than an
    earlier export (which would be deleted with it)."""
    if os.path.isdir(out):
        other = sorted(set(os.listdir(out)) - set(EXPORT))
        if other:
            p.error(f"--out {out} holds other files than an export ({', '.join(other[:3])}): choose another "
                    f"folder, or empty it")


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    if not export.available():
        p.error(export.NEEDS)
    out = args.out or os.path.join(args.run, "ctranslate2")
    check_out(p, out)
    checkpoint, tokenizer = find_run_files(args.run)
    tok = data.open_tokenizer(tokenizer)
    ckpt = load_checkpoint(checkpoint)
    model = model_from(ckpt, checkpoint, "cpu", tokenizer=tok)  # refuses non-finite weights
    beam, alpha = beam_and_alpha(ckpt, args.beam, args.alpha)
    refuse_wide_beams(p, [beam], tok)
    test = data.load_multi30k(args.data_dir, "test_2016_flickr")  # a wrong --data-dir is found before the export
    n = min(args.limit or len(test), len(test))
    _, preprocess = text_settings(ckpt, None)
    src = tok.encode(data.moses.preprocess(test.src[:n], "en", preprocess))
    if preprocess == "moses-lc":  # Moses tokens out: the literature's metric, on tokens as they are
        refs = data.moses.moses_lc(test.tgt[:n], "de")
        metric, score = "literature", lambda hyps: bleu_literature(hyps, refs, tokenized=True)[0]
    else:
        metric, score = "sacreBLEU", lambda hyps: bleu(hyps, test.tgt[:n])[0]

    # The export is built and checked beside --out, and takes its place only once it agrees with
    # the model: a failure or an interrupt leaves an earlier export there whole, its record too.
    with files.atomic_folder(out) as staged:
        folders = {q: os.path.join(staged, q) for q in ("float32", "int8")}
        for q, folder in folders.items():
            export.to_ctranslate2(model, tok, folder, None if q == "float32" else q)
        translators = {q: export.load_translator(f, args.threads) for q, f in folders.items()}
        batches = same_length_batches(src, args.batch_size)
        figures = compare(model, tok, src, score, batches, translators, beam, alpha)
        figures.update(metric=metric, preprocess=preprocess)
        ours = beam_search(model, data.collate(src[:64]).src, beam, alpha)
        gap = teacher_forced_gap(model, tok, translators["float32"], src[:64], ours)
        figures["teacher_forced_max_abs_diff"] = gap
        if not gap <= TOLERANCE:  # NaN too
            raise ExportError(f"the float32 export of {checkpoint} gives log-probabilities up to {gap:.3g} away from "
                              f"the model's (more than {TOLERANCE:g}): not written to {out}")
        with files.atomic_write(os.path.join(staged, "agreement.json")) as fh:
            json.dump(figures, fh, indent=2)
        if os.path.isdir(out):
            print(f"replacing the earlier export in {out}", file=sys.stderr)
    print(f"exported {checkpoint} to {', '.join(os.path.join(out, q) for q in folders)}")
    print(f"teacher-forced log-probabilities (64 sentences, float32): max |difference| {gap:.2e}")
    print(f"{n} test sentences, beam {beam}, alpha {alpha} (the run's unless given); our BLEU "
          f"{figures['ours_bleu']:.2f} ({metric}{'' if preprocess == 'raw' else f'; input text {preprocess}'})")
    for q in folders:
        f = figures[q]
        print(f"  {q:8s} greedy equal {100 * f['greedy_equal']:.1f}%   beam equal with our penalty "
              f"{100 * f['beam_equal_rescored']:.1f}% ({f['beam_differ']} differ, {f['beam_differ_near_ties']} of "
              f"them near ties)   own beam search: BLEU {f['native_beam_bleu']:.2f}, equal "
              f"{100 * f['native_beam_equal']:.1f}%")
    return figures


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError, CheckpointError, ExportError))
