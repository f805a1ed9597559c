"""How finely does a BPE-dropout rate split the text? The paper's sampling against sentencepiece's.

    python experiments/bpe_dropout/bpe_dropout.py --tokenizer runs/multi30k/spm-bpe8000-<hash>.model \
        --data-dir ../shared/data/multi30k

BPE-dropout (Provilkov et al., 2020) trains on a new segmentation of the training side each
epoch; a train_wmt.py option once did so, and its 0.1 scored 33.51 BLEU on Multi30k against
39.91 without it, so it left the package with this study. ``sampling.py`` here samples as the
paper's Algorithm 1: at every merge step each possible merge is removed with probability p afresh. sentencepiece's own sampler (``encode(enable_sampling=True, alpha=p)``)
draws once for each pair as it leaves its queue (src/bpe_model.cc): a pair it skips stays
unmerged unless a neighbour's merge forms it again, so the same p splits its words more finely.
This script measures how much: pieces per sentence of the training side (both languages)
under each rate, relative to the deterministic segmentation, for both samplers over the same
vocabulary; a number read off it translates a rate tuned with sentencepiece into ours. At rate
0 the paper's sampler must give sentencepiece's own segmentation: checked on the same sentences
before anything is measured.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import sys
from pathlib import Path

import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sampling.py, beside this script

from minitransformer import cli, data  # noqa: E402
from sampling import BPEDropout  # noqa: E402


def measure(tokenizer: data.Tokenizer, sentences: list[str], rates: list[float], seed: int) -> dict:
    """Relative lengths {rate: {"paper": r, "sentencepiece": r}}."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer.path))  # its own sampler, which Tokenizer hides
    plain = sp.encode(sentences)
    paper = BPEDropout(sp)
    if paper.encode(sentences, 0.0, seed) != plain:  # else the lengths below measure a bug, not the sampling
        raise SystemExit(f"error: sampling.py at rate 0 does not give {tokenizer.path}'s own segmentation")
    total = sum(map(len, plain))
    result = {}
    for rate in rates:
        spm.set_random_generator_seed(seed)
        sampled = sp.encode(sentences, enable_sampling=True, alpha=rate)
        result[rate] = {"paper": sum(map(len, paper.encode(sentences, rate, seed))) / total,
                        "sentencepiece": sum(map(len, sampled)) / total}
    return result


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=cli.input_file, required=True, help="a sentencepiece BPE model (a run folder's spm-*.model)")
    p.add_argument("--data-dir", type=cli.data_folder, default="data/multi30k", help="Multi30k folder (its train split is measured)")
    p.add_argument("--sentences", type=cli.integer(1), default=3000,
                   help="the first N training pairs (both sides are measured)")
    p.add_argument("--rates", type=cli.comma_list(cli.real(0.0, 1.0, low_open=True, high_open=True)),
                   default=[0.025, 0.05, 0.1, 0.2], help="dropout rates, comma-separated")
    p.add_argument("--seed", type=cli.integer(0), default=1, help="seeds both samplers")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    tokenizer = data.Tokenizer(args.tokenizer)  # a damaged model or other special ids: one line, before the corpus
    train = data.load_multi30k(args.data_dir, "train")
    n = min(args.sentences, len(train))
    result = measure(tokenizer, list(train.src[:n]) + list(train.tgt[:n]), args.rates, args.seed)
    print(f"pieces per sentence relative to the deterministic BPE, {n} training pairs, both sides")
    print(f"{'rate':>6}  {'paper (ours)':>12}  {'sentencepiece':>13}")
    for rate, row in result.items():
        print(f"{rate:>6}  {row['paper']:>12.3f}  {row['sentencepiece']:>13.3f}")
    return result


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError,))
