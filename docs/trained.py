"""The trained model on the page: its attention on a real sentence, its translations beside the
references, and its BLEU, rendered once from a run of the README's main job into docs/trained/.

    python docs/trained.py --run runs/multi30k --trained-at <commit> --seed 1

runs/ is not in git, so what this writes is committed, and the reading shows the committed
copy: the three attention maps of plot_attention.py (the last layer, head by head) for the
first validation sentence, and trained.json (the run's test BLEU with its sacreBLEU
signatures, a few validation sentences translated beside their references, the first one's
walk from text to BLEU, and the caption: the command that trained it, its seed and the commit
it ran at). Every translation here, the maps' included, is the run's own beam search (its
beam, alpha and length penalty, read from the run): the maps are of the translation the walk
follows, or none is written. Validation sentences only: the test set gives the run's one
figure and nothing else.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import json
import os
import sys
import tempfile

import numpy as np

import minitransformer as mt
from minitransformer import cli, data, files, records
from minitransformer.checkpoint import CheckpointError, load_checkpoint
from minitransformer.decoding import beam_search, translate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import plot_attention  # noqa: E402 - examples/, for its maps
from translate import Search, beam_and_alpha, find_run_files, model_from, text_settings  # noqa: E402

COMMAND = "mpiexec -n 2 python examples/train_wmt.py --data-dir ../shared/data/multi30k"  # the README's


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=cli.input_folder, required=True, help="the folder of a finished train_wmt.py run (with bleu.json)")
    p.add_argument("--trained-at", required=True, help="the commit the run was trained at, for the caption")
    p.add_argument("--seed", type=cli.integer(0), default=1, help="the run's --seed, for the caption")
    p.add_argument("--command", default=COMMAND, help="the command that trained it, for the caption")
    p.add_argument("--data-dir", type=cli.data_folder, default=os.path.join(ROOT, "..", "shared", "data", "multi30k"),
                   help="the Multi30k folder, for the validation sentences")
    p.add_argument("--samples", type=cli.integer(1), default=6, help="validation sentences to show")
    p.add_argument("--out", type=cli.output_folder, default=os.path.join(ROOT, "docs", "trained"),
                   help="where to write (default: docs/trained, committed)")
    return p


def walk(model, tok, source: str, reference: str, other: str, search: Search) -> dict:
    """One sentence from text to BLEU, each stage as the page shows it: its pieces and ids, a
    batch with a second sentence (for the padding), the encoder's output, every step of beam
    search with the beams it keeps, the detokenized translation and its sentence BLEU."""
    from sacrebleu.metrics import BLEU

    ids, other_ids = tok.encode([source, other])
    batch = data.collate([ids, other_ids])
    own = ids + [data.EOS_ID]  # the sentence as the model reads it, alone: no padding
    src = mt.tensor(np.array([own]))
    with mt.no_grad():
        memory = model.encode(src).numpy()[0]
    steps = []

    def observe(step) -> None:  # one sentence: slot 0, until it finishes
        kept = zip(step.kept_rows[0], step.kept_words[0], step.kept_scores[0]) if len(step.kept_sentences) else []
        beams = [{"pieces": tok.id_to_piece([*step.prefixes[row], word]), "log_prob": float(score)}
                 for row, word, score in kept if score > -float("inf")]
        ended = [{"pieces": tok.id_to_piece(tokens), "log_prob": float(lp), "score": float(sc)}
                 for sentence, tokens, lp, sc in step.finished if sentence == 0]
        steps.append({"t": int(step.t), "beams": beams, "finished": ended})

    (hypothesis,) = beam_search(model, src, search.beam, search.alpha, observer=observe,
                                length_penalty=search.length_penalty)
    translation = tok.decode([hypothesis])[0]
    metric = BLEU(effective_order=True)
    finished = [f for step in steps for f in step["finished"]]
    return {
        "source": source, "reference": reference, "pieces": tok.id_to_piece(own),
        "ids": own, "batch": batch.src.tolist(), "pad_id": data.PAD_ID,
        "memory_shape": [1, *memory.shape], "memory_norms": [round(float(n), 2) for n in (memory ** 2).sum(-1) ** 0.5],
        "steps": steps, "hypothesis_ids": list(map(int, hypothesis)),
        "hypothesis_pieces": tok.id_to_piece(hypothesis), "translation": translation,
        "sentence_bleu": metric.sentence_score(translation, [reference]).score,
        "sentence_signature": str(metric.get_signature()),
        # the finished hypotheses the page compares: the most probable, and the best scored (the winner)
        "likeliest": max(finished, key=lambda f: f["log_prob"], default=None),
        "winner": max(finished, key=lambda f: f["score"], default=None),
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    checkpoint, tokenizer = find_run_files(args.run)
    bleu_path = os.path.join(args.run, "bleu.json")
    if not os.path.isfile(bleu_path):
        raise CheckpointError(f"{bleu_path}: no such file; the run has not finished (train_wmt.py writes it last)")
    bleu = records.read_result(bleu_path)
    if bleu["bleu"] is None:
        raise records.RecordError(f"{bleu_path}: no cased BLEU (a {bleu.get('preprocess', 'lowercased')} run); "
                                  "the page shows a run of the README's main job, which is cased")
    tok = data.Tokenizer(tokenizer)
    ckpt = load_checkpoint(checkpoint)
    model = model_from(ckpt, checkpoint, "cpu", tokenizer=tok)
    search = Search(*beam_and_alpha(ckpt, None, None), *text_settings(ckpt, None))  # as the run decodes
    val = data.load_multi30k(args.data_dir, "val")
    sources, references = val.src[:args.samples], val.tgt[:args.samples]
    hypotheses = translate(model, tok, sources, "cpu", search.beam, search.alpha, progress=False,
                           length_penalty=search.length_penalty)
    first = walk(model, tok, sources[0], references[0], sources[1 % len(sources)], search)
    os.makedirs(args.out, exist_ok=True)
    (ids,) = tok.encode(sources[:1])
    with tempfile.TemporaryDirectory(dir=args.out, prefix=".maps.") as staged:  # kept only if they are the walk's
        drawn = plot_attention.draw_part(model, tok, ids, search, staged, layers="last")  # the page reads the last layer
        if drawn != first["translation"]:
            raise AssertionError(f"the maps are of {drawn!r}, the walk's translation is {first['translation']!r}")
        for name in plot_attention.MAPS:
            os.replace(os.path.join(staged, name), os.path.join(args.out, name))
    record = {
        "command": args.command, "seed": args.seed, "commit": args.trained_at,
        "steps": bleu["steps"], "beam": search.beam, "alpha": search.alpha, "length_penalty": search.length_penalty,
        "bleu": bleu["bleu"], "signature": bleu["signature"],
        "bleu_lowercased": bleu["bleu_lowercased"], "signature_lowercased": bleu["signature_lowercased"],
        "test_sentences": bleu["test_sentences"],
        "samples": [{"source": s, "translation": h, "reference": r} for s, h, r in zip(sources, hypotheses, references)],
        "walk": first,
    }
    with files.atomic_write(os.path.join(args.out, "trained.json")) as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote the attention maps of {sources[0]!r} and trained.json ({len(sources)} samples) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, user_errors=(data.CorpusError, CheckpointError, records.RecordError)))
