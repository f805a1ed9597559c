"""Moses preprocessing: the text the Multi30k literature trains on and is scored on.

The Multi30k papers train on, and score against, the task's official ``lc.norm.tok`` files:
each line lowercased, its punctuation normalized and its words split off by the Moses scripts
(``lowercase.perl``, ``normalize-punctuation.perl``, ``tokenizer.perl`` with its default
escaping, so ``"`` becomes ``&quot;`` and ``t-shirt`` stays one word). Their BLEU is computed on
those tokens, as they are, with no tokenization of its own. sacremoses is a faithful port of
the Moses scripts (the official files are its output byte for byte), used here rather than a
second copy of their rules:

    moses_lc(["A man's T-shirt..."], "en")  ->  ["a man &apos;s t-shirt ..."]
    detokenize(["a man &apos;s t-shirt ..."], "en")  ->  ["a man's t-shirt..."]

``PREPROCESSING`` names what a run may do to its text before BPE: ``raw`` (nothing: cased text,
detokenized output, scored by sacreBLEU's own tokenizer) or ``moses-lc`` (the above: the model
reads and writes lowercased Moses tokens; ``detokenize`` makes its output readable again).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .corpus import ParallelCorpus

PREPROCESSING = ("raw", "moses-lc")


@functools.lru_cache(maxsize=None)
def languages() -> tuple[str, ...]:
    """The language codes whose rules (non-breaking prefixes) sacremoses has: another code
    would be tokenized silently by no language's rules."""
    from sacremoses.corpus import NonbreakingPrefixes

    return tuple(sorted(set(NonbreakingPrefixes().available_langs.values())))


@functools.lru_cache(maxsize=None)
def _tools(lang: str):
    from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer

    return MosesPunctNormalizer(lang), MosesTokenizer(lang), MosesDetokenizer(lang)


def moses_lc(lines: Sequence[str], lang: str) -> list[str]:
    """Each line lowercased, punctuation-normalized and Moses-tokenized (escaped), in that
    order: the Multi30k ``lc.norm.tok`` text."""
    normalizer, tokenizer, _ = _tools(lang)
    return [tokenizer.tokenize(normalizer.normalize(line.lower()), escape=True, return_str=True)
            for line in lines]


def detokenize(lines: Sequence[str], lang: str) -> list[str]:
    """Moses tokens back to text (``&apos;`` to ``'``, ``word ,`` to ``word,``); the case
    stays lowered."""
    _, _, detokenizer = _tools(lang)
    return [detokenizer.detokenize(line.split(), unescape=True) for line in lines]


def preprocess(lines: Sequence[str], lang: str, how: str) -> list[str]:
    """``lines`` as a run with ``--preprocess how`` reads them."""
    if how == "raw":
        return list(lines)
    if how == "moses-lc":
        return moses_lc(lines, lang)
    raise ValueError(f"unknown preprocessing {how!r}; expected one of {PREPROCESSING}")


def preprocess_corpus(corpus: ParallelCorpus, how: str, src_lang: str = "en", tgt_lang: str = "de") -> ParallelCorpus:
    """``corpus`` with both sides preprocessed (``how``: one of PREPROCESSING); the same object
    for ``raw``."""
    if how == "raw":
        return corpus
    return ParallelCorpus(preprocess(corpus.src, src_lang, how), preprocess(corpus.tgt, tgt_lang, how),
                          corpus.src_paths, corpus.tgt_paths)
