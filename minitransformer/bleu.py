"""BLEU (Papineni et al., 2002) three ways: what each figure of a translation means.

    bleu(hyps, refs)             sacreBLEU on detokenized text, cased, with its own 13a
                                 tokenizer: the figure to compare across papers (Post, 2018)
    bleu_lowercased(hyps, refs)  the same, lowercased
    bleu_literature(hyps, refs)  the Multi30k papers' own metric: hypotheses and references
                                 lowercased, punctuation-normalized and Moses-tokenized
                                 (``data.moses.moses_lc``), then BLEU on those tokens as they
                                 are (sacreBLEU with ``tokenize="none"``), as fairseq's
                                 scorer counts them

The literature's figure is the one a Multi30k paper's number is comparable with: Moses splits
``man's`` into ``man &apos;s`` and counts ``&quot;`` as a word where 13a does neither, so the
two tokenizations can give different figures for one translation. A model trained on
``moses-lc`` text writes Moses tokens already: its output is scored as it comes
(``tokenized=True``, with references made so), as fairseq scores it, with no round trip through detokenized text; it
has no cased figure.

Each function returns the score and a signature that says how it was computed, to print
beside it (sacreBLEU's own, and for the literature's figure what was done to the text first).
``literature_parts`` splits the literature's figure into its n-gram precisions and brevity
penalty. ``bleu_scores`` gives all three of one translation at once, keyed as a run's ``bleu.json``
keeps them: the one place where training, decoding sweeps and ``examples/score.py`` score.
"""

from __future__ import annotations

from collections.abc import Sequence

from .data.moses import moses_lc

# What bleu_literature does to the text before sacreBLEU counts n-grams, for its signature.
LITERATURE_TEXT = "lowercased+normalized+tokenized by sacremoses (Moses, {lang}, escaped)"


def bleu(hyps: Sequence[str], refs: Sequence[str]) -> tuple[float, str, float]:
    """Corpus sacreBLEU (cased, 13a tokenization of detokenized text), its signature, and the
    hypotheses' length over the references' (below 1, the brevity penalty exp(1 - 1/ratio)
    applies)."""
    from sacrebleu.metrics import BLEU

    metric = BLEU()
    score = metric.corpus_score(list(hyps), [list(refs)])
    return score.score, str(metric.get_signature()), score.sys_len / max(score.ref_len, 1)


def bleu_lowercased(hyps: Sequence[str], refs: Sequence[str]) -> tuple[float, str]:
    """sacreBLEU on lowercased text (13a tokens), and its signature (case:lc)."""
    from sacrebleu.metrics import BLEU

    metric = BLEU(lowercase=True)
    return metric.corpus_score(list(hyps), [list(refs)]).score, str(metric.get_signature())


def bleu_literature(hyps: Sequence[str], refs: Sequence[str], lang: str = "de",
                    tokenized: bool = False) -> tuple[float, str, float]:
    """The Multi30k literature's BLEU, its signature and the length ratio: ``hyps`` and ``refs``
    (raw text) made lowercased Moses tokens of ``lang`` and scored on those tokens.
    ``tokenized``: both are such tokens already (a ``moses-lc`` model's output and references),
    and are scored as they are (the tokenizer's escaping is not idempotent: ``&quot;`` would
    become ``&amp;quot;``)."""
    from sacrebleu.metrics import BLEU

    metric = BLEU(tokenize="none", force=True)  # tokenized text is what this metric scores: no warning
    if not tokenized:
        hyps, refs = moses_lc(hyps, lang), moses_lc(refs, lang)
    score = metric.corpus_score(list(hyps), [list(refs)])
    return (score.score, f"{LITERATURE_TEXT.format(lang=lang)} | {metric.get_signature()}",
            score.sys_len / max(score.ref_len, 1))


def literature_parts(tokens: Sequence[str], refs_tokens: Sequence[str]) -> dict:
    """What the literature's figure of lowercased Moses ``tokens`` against ``refs_tokens`` is made
    of: the n-gram precisions (1 to 4, in percent), the brevity penalty and the two lengths, so
    that ``score = bp * geometric mean of the precisions``. Two translations of one score can
    differ in either part: one matches fewer n-grams, the other is shorter."""
    from sacrebleu.metrics import BLEU

    score = BLEU(tokenize="none", force=True).corpus_score(list(tokens), [list(refs_tokens)])
    return dict(score=score.score, precisions=list(score.precisions), bp=score.bp, sys_len=score.sys_len,
                ref_len=score.ref_len)


def bleu_scores(hyps: Sequence[str], refs: Sequence[str], lang: str = "de",
                tokens: Sequence[str] | None = None, refs_tokens: Sequence[str] | None = None) -> dict:
    """The three figures of one translation and their signatures, keyed as ``bleu.json`` keeps
    them (``bleu``, ``bleu_lowercased``, ``literature``, each with its ``signature...``), and
    ``length_ratio``: the hypotheses' length over the references' in the cased figure's tokens
    (the literature's where there is no cased figure).

    ``hyps`` is readable text. ``tokens``: the lowercased Moses tokens a ``moses-lc`` model wrote,
    of which ``hyps`` is the detokenized form; the literature's figure scores them as they are,
    and there is no cased figure (``None``). ``refs_tokens``: ``moses_lc(refs)``, when the caller
    scores many translations of one set and tokenizes its references once."""
    refs_tokens = moses_lc(refs, lang) if refs_tokens is None else refs_tokens
    literature, signature_lit, ratio = bleu_literature(
        moses_lc(hyps, lang) if tokens is None else tokens, refs_tokens, lang, tokenized=True)
    cased = signature = None  # a model of lowercased text has no cased figure
    if tokens is None:
        cased, signature, ratio = bleu(hyps, refs)
    lowercased, signature_lc = bleu_lowercased(hyps, refs)
    return dict(bleu=cased, signature=signature, bleu_lowercased=lowercased, signature_lowercased=signature_lc,
                literature=literature, signature_literature=signature_lit, length_ratio=ratio)
