"""Does sentencepiece's vocabulary cut the text as the literature's subword-nmt BPE does?

    pip install subword-nmt    # the literature's tool, for this comparison only
    python experiments/subwords/subwords.py --data-dir ../shared/data/multi30k --vocab-size 9000,10000

The anchor of the README (Wu et al. 2021) learns a joint subword-nmt BPE of 10,000 merges on the
Multi30k training text, lowercased and Moses-tokenized. The ``multi30k-tiny`` preset trains a
sentencepiece BPE (the project's tokenizer) on the same text instead. This script learns both on
that text (``data.moses.moses_lc`` of both sides) and prints, for each: the vocabulary's types
that the training text uses and the mean pieces per sentence of each side, and how far each of
sentencepiece's figures lies from subword-nmt's.

``--anchor DIR`` reads the anchor's own files instead of guessing them: DIR is the
``data/multi30k-en-de`` folder of their Revisit-MMT repository (``train``, ``valid`` and
``test.2016``, ``.en`` and ``.de``: their text after their BPE). It counts the lines of each split
whose text, the BPE undone (``@@ `` removed), differs from ``moses_lc`` of ours, and adds their
own BPE's figures to the table.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import io
import os
import tempfile
from pathlib import Path

from minitransformer import cli, data


def subword_nmt(sentences: dict[str, list[str]], merges: int) -> dict:
    """Types used and mean pieces per sentence of a joint subword-nmt BPE of ``merges`` merges."""
    from subword_nmt import learn_bpe as learning
    from subword_nmt.apply_bpe import BPE

    # learn_bpe wraps its merges in a tqdm bar, which writes a line per update into a log; tqdm
    # read TQDM_DISABLE when it was first imported, so the bar goes, not the environment.
    learning.tqdm = lambda merges, *args, **kwargs: merges

    codes = io.StringIO()
    learning.learn_bpe(io.StringIO("\n".join(sentences["en"] + sentences["de"]) + "\n"), codes, merges)
    codes.seek(0)
    bpe = BPE(codes)
    return _figures({lang: [bpe.process_line(s).split() for s in lines] for lang, lines in sentences.items()})


def sentencepiece(sentences: dict[str, list[str]], vocab_size: int) -> dict:
    """The same figures for the project's tokenizer (data.train_tokenizer) of ``vocab_size`` pieces."""
    with tempfile.TemporaryDirectory() as folder:
        tok = data.train_tokenizer(sentences["en"] + sentences["de"], Path(folder) / "spm.model",
                                   data.TokenizerConfig(vocab_size=vocab_size))
        return _figures({lang: tok.encode(lines) for lang, lines in sentences.items()})


def _figures(pieces: dict[str, list[list]]) -> dict:
    used = {p for rows in pieces.values() for row in rows for p in row}
    return {"types": len(used), **{f"pieces_{lang}": sum(map(len, rows)) / len(rows) for lang, rows in pieces.items()}}


# Our split names and the anchor's files of the same sentences.
ANCHOR_FILES = {"train": "train", "val": "valid", "test_2016_flickr": "test.2016"}


def against_anchor(data_dir: str, anchor: str) -> tuple[list[dict], dict]:
    """Per split and side, the lines (of how many) whose text differs from the anchor's file of
    it once their BPE is undone; and their BPE's figures on their training files."""
    differ, train = [], {}
    for split, name in ANCHOR_FILES.items():
        corpus = data.moses.preprocess_corpus(data.load_corpus("multi30k", data_dir, split), "moses-lc")
        for lang, ours in (("en", corpus.src), ("de", corpus.tgt)):
            path = os.path.join(anchor, f"{name}.{lang}")
            theirs = data.read_lines(path)
            if len(theirs) != len(ours):
                raise data.CorpusError(f"{path} has {len(theirs)} lines, our {split}.{lang} {len(ours)}: "
                                       f"not the same sentences")
            differ.append(dict(split=split, lang=lang, lines=len(ours),
                               differ=sum(a != b.replace("@@ ", "") for a, b in zip(ours, theirs))))
            if split == "train":
                train[lang] = [line.split() for line in theirs]
    return differ, _figures(train)


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=cli.data_folder, required=True, help="the Multi30k folder")
    p.add_argument("--merges", type=cli.integer(1), default=10000, help="subword-nmt's merges (the anchor's)")
    p.add_argument("--vocab-size", type=cli.comma_list(cli.integer(5)), default=[10000],
                   help="sentencepiece vocabulary sizes to compare, comma-separated")
    p.add_argument("--anchor", type=cli.input_folder,
                   help="the anchor's data/multi30k-en-de folder (Revisit-MMT): compare with their own files")
    return p


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    train = data.moses.preprocess_corpus(data.load_corpus("multi30k", args.data_dir, "train"), "moses-lc")
    sentences = {"en": train.src, "de": train.tgt}
    theirs = dict(tool=f"subword-nmt, {args.merges} merges", **subword_nmt(sentences, args.merges))
    rows = [theirs] + [dict(tool=f"sentencepiece, {v} pieces", **sentencepiece(sentences, v)) for v in args.vocab_size]
    if args.anchor:
        differ, figures = against_anchor(args.data_dir, args.anchor)
        rows.insert(1, dict(tool="the anchor's own BPE'd training files", **figures))
        print("| split | side | lines | differ from the anchor's, their BPE undone |\n|---|---|---|---|")
        for row in differ:
            print(f"| {row['split']} | {row['lang']} | {row['lines']:,} | {row['differ']:,} |")
        print()
    print("| BPE | types used | pieces per sentence, en | de |\n|---|---|---|---|")
    for row in rows:
        cells = [f"{row['types']:,}", f"{row['pieces_en']:.2f}", f"{row['pieces_de']:.2f}"]
        if row is not theirs:
            cells = [f"{c} ({100 * (row[k] / theirs[k] - 1):+.1f}%)"
                     for c, k in zip(cells, ("types", "pieces_en", "pieces_de"))]
        print(f"| {row['tool']} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError,))
