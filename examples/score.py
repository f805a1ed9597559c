"""Score a file of translations against its references: BLEU three ways, a line each.

    python examples/score.py runs/multi30k/test.hyp.de ../shared/data/multi30k/test_2016_flickr.de.gz
    python examples/score.py --tokenized runs/multi30k-tiny/test.tok.de ../shared/data/multi30k/test_2016_flickr.de.gz

prints

    cased: 39.31
    lowercased: 39.72
    literature: 39.72

and then each figure's signature. ``cased`` and ``lowercased`` are sacreBLEU's on detokenized
text; ``literature`` is the Multi30k papers' metric: both sides lowercased, punctuation-normalized
and Moses-tokenized, then BLEU on those tokens (minitransformer.bleu). ``--tokenized``: HYP holds
lowercased Moses tokens already, as a ``--preset multi30k-tiny`` model writes them (test.tok.de):
they are scored as they are in the literature's metric, detokenized for the lowercased figure,
and the cased figure is n/a. REF is raw text, plain or gzipped, one reference a line.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

from minitransformer import cli, data
from minitransformer.bleu import bleu_scores


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hyp", type=cli.input_file, help="translations, one a line (plain or .gz)")
    p.add_argument("ref", type=cli.input_file, help="references, raw text, one a line (plain or .gz)")
    p.add_argument("--lang", default="de", help="the language of both files, for the Moses tokenizer's rules")
    p.add_argument("--tokenized", action="store_true",
                   help="HYP is lowercased Moses tokens already (a moses-lc model's output)")
    p.add_debug()
    return p


def score(hyps: list[str], refs: list[str], lang: str = "de", tokenized: bool = False) -> dict:
    """The three figures (None for the cased one of tokenized hypotheses) and their signatures,
    keyed as a run's bleu.json keeps them."""
    if tokenized:
        return bleu_scores(data.moses.detokenize(hyps, lang), refs, lang, tokens=hyps)
    return bleu_scores(hyps, refs, lang)


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    if args.lang not in data.moses.languages():  # checked here: the list costs sacremoses' import
        p.error(f"argument --lang: {args.lang!r} is not a language the Moses rules know "
                f"({', '.join(data.moses.languages())})")
    hyps, refs = data.read_lines(args.hyp), data.read_lines(args.ref)
    if len(hyps) != len(refs):
        raise data.CorpusError(f"{args.hyp} has {len(hyps)} lines but {args.ref} has {len(refs)}: "
                               f"one translation a reference, line by line")
    result = score(hyps, refs, args.lang, args.tokenized)
    figures = dict(cased=("bleu", "signature"), lowercased=("bleu_lowercased", "signature_lowercased"),
                   literature=("literature", "signature_literature"))
    for name, (key, _) in figures.items():
        print(f"{name}: {'n/a' if result[key] is None else format(result[key], '.2f')}")
    for name, (_, signature) in figures.items():
        if result[signature] is not None:
            print(f"{name} signature: {result[signature]}")
    return result


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError,))
