"""Does sentencepiece's vocabulary cut the text as the literature's subword-nmt BPE does?

    pip install subword-nmt    # the literature's tool, for this comparison only
    python benchmarks/subwords.py --data-dir ../shared/data/multi30k --vocab-size 9000,10000

The anchor of the README (Wu et al. 2021) learns a joint subword-nmt BPE of 10,000 merges on the
Multi30k training text, lowercased and Moses-tokenized. The ``multi30k-tiny`` preset trains a
sentencepiece BPE (the project's tokenizer) on the same text instead. This script learns both on
that text (``data.moses.moses_lc`` of both sides) and prints, for each: the vocabulary's types
that the training text uses and the mean pieces per sentence of each side, and how far each of
sentencepiece's figures lies from subword-nmt's.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

from minitransformer import cli, data


def subword_nmt(sentences: dict[str, list[str]], merges: int) -> dict:
    """Types used and mean pieces per sentence of a joint subword-nmt BPE of ``merges`` merges."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # learn_bpe's bar, a line per merge in a log
    from subword_nmt.apply_bpe import BPE
    from subword_nmt.learn_bpe import learn_bpe

    codes = io.StringIO()
    learn_bpe(io.StringIO("\n".join(sentences["en"] + sentences["de"]) + "\n"), codes, merges)
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


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=cli.data_folder, required=True, help="the Multi30k folder")
    p.add_argument("--merges", type=cli.integer(1), default=10000, help="subword-nmt's merges (the anchor's)")
    p.add_argument("--vocab-size", type=cli.comma_list(cli.integer(5)), default=[10000],
                   help="sentencepiece vocabulary sizes to compare, comma-separated")
    return p


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    train = data.moses.preprocess_corpus(data.load_corpus("multi30k", args.data_dir, "train"), "moses-lc")
    sentences = {"en": train.src, "de": train.tgt}
    theirs = dict(tool=f"subword-nmt, {args.merges} merges", **subword_nmt(sentences, args.merges))
    rows = [theirs] + [dict(tool=f"sentencepiece, {v} pieces", **sentencepiece(sentences, v)) for v in args.vocab_size]
    print("| BPE | types used | pieces per sentence, en | de |\n|---|---|---|---|")
    for row in rows:
        cells = [f"{row['types']:,}", f"{row['pieces_en']:.2f}", f"{row['pieces_de']:.2f}"]
        if row is not theirs:
            cells = [f"{c} ({100 * (row[k] / theirs[k] - 1):+.1f}%)"
                     for c, k in zip(cells, ("types", "pieces_en", "pieces_de"))]
        print(f"| {row['tool']} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
