"""BLEU three ways (minitransformer.bleu): known answers, computed by hand where they can be."""

import math

import pytest

from minitransformer.bleu import bleu, bleu_literature, bleu_lowercased, bleu_scores, literature_parts
from minitransformer.data.moses import detokenize
from minitransformer.data.moses import moses_lc

REFS = ["Ein Mann fährt mit dem Fahrrad.", 'Zwei Kinder sagen "Hallo".']


def test_a_translation_equal_to_its_reference_scores_100_every_way():
    assert bleu(REFS, REFS)[0] == pytest.approx(100.0)
    assert bleu_lowercased(REFS, REFS)[0] == pytest.approx(100.0)
    assert bleu_literature(REFS, REFS)[0] == pytest.approx(100.0)
    assert bleu_literature(moses_lc(REFS, "de"), moses_lc(REFS, "de"), tokenized=True)[0] == pytest.approx(100.0)


def test_the_literature_s_figure_computed_by_hand():
    """One pair, lowercased and Moses-tokenized: 'ein mann fährt mit einem fahrrad .' against
    'ein mann fährt mit dem fahrrad .', 7 tokens each (no brevity penalty). Matched n-grams:
    6 of 7 words, 4 of 6 bigrams (ein mann, mann fährt, fährt mit, fahrrad .), 2 of 5 trigrams,
    1 of 4 four-grams; BLEU is their geometric mean. The case differs from the reference's
    at the first word, which the cased figure counts and the literature's does not."""
    hyp, ref = ["ein Mann fährt mit einem Fahrrad."], ["Ein Mann fährt mit dem Fahrrad."]
    by_hand = 100 * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25
    score, signature, ratio = bleu_literature(hyp, ref)
    assert score == pytest.approx(by_hand, rel=1e-9) and ratio == 1.0
    assert "tok:none" in signature and "sacremoses" in signature
    assert bleu(hyp, ref)[0] < score  # 'ein' is not 'Ein' for the cased figure


def test_the_literature_s_metric_counts_moses_tokens_not_13a_s():
    """Moses splits 'ist's' into 'ist &apos; s' and counts each '&quot;' as a word; 13a keeps
    the apostrophe inside the word. One hypothesis, two figures."""
    hyp, ref = ["Das ist's, sagt er."], ["Das ist es, sagt er."]
    literature, lowercased = bleu_literature(hyp, ref)[0], bleu_lowercased(hyp, ref)[0]
    assert literature != pytest.approx(lowercased)
    # By hand, on 'das ist &apos; s , sagt er .' (8 tokens) against 'das ist es , sagt er .' (7):
    # unigrams 6/8, bigrams 4/7 (das ist, ', sagt', sagt er, er .), trigrams 2/6, four-grams 1/5.
    assert literature == pytest.approx(100 * (6 / 8 * 4 / 7 * 2 / 6 * 1 / 5) ** 0.25, rel=1e-9)


def test_all_three_at_once_are_the_three_functions_keyed_as_bleu_json():
    hyps = ["ein Mann fährt mit einem Fahrrad.", "Zwei Kinder sagen hallo."]
    got = bleu_scores(hyps, REFS)
    cased, signature, ratio = bleu(hyps, REFS)
    literature, signature_lit, _ = bleu_literature(hyps, REFS)
    assert got == dict(bleu=cased, signature=signature, bleu_lowercased=bleu_lowercased(hyps, REFS)[0],
                       signature_lowercased=bleu_lowercased(hyps, REFS)[1], literature=literature,
                       signature_literature=signature_lit, length_ratio=ratio)


def test_a_lowercased_model_s_tokens_are_scored_as_they_are_with_no_cased_figure():
    """'&quot;' escaped once by the model's preprocessing must not be escaped again."""
    tokens = moses_lc(['Zwei Kinder sagen "Hallo".', "ein Mann fährt mit einem Fahrrad."], "de")
    assert "&quot;" in tokens[0]
    text = detokenize(tokens, "de")
    got = bleu_scores(text, REFS[::-1], tokens=tokens)
    literature, _, ratio = bleu_literature(tokens, moses_lc(REFS[::-1], "de"), tokenized=True)
    assert got["bleu"] is None and got["signature"] is None
    assert (got["literature"], got["length_ratio"]) == (literature, ratio)
    assert got["bleu_lowercased"] == bleu_lowercased(text, REFS[::-1])[0]
    given = bleu_scores(text, REFS[::-1], tokens=tokens, refs_tokens=moses_lc(REFS[::-1], "de"))
    assert given == got


def test_the_literature_s_figure_is_its_brevity_penalty_times_its_precisions_by_hand():
    """'ein mann fährt .' (4 tokens) against 'ein mann fährt mit dem fahrrad .' (7): every n-gram
    of the hypothesis but the ones spanning 'fährt .' matches: 4/4, 2/3, 1/2 and 0/1, which
    sacreBLEU's default 'exp' smoothing turns into 1/(2 * 1) for the four-gram (its first zero).
    The hypothesis is shorter: BP = exp(1 - 7/4)."""
    got = literature_parts(["ein mann fährt ."], ["ein mann fährt mit dem fahrrad ."])
    precisions = [4 / 4, 2 / 3, 1 / 2, 1 / 2]
    assert got["precisions"] == pytest.approx([100 * p for p in precisions])  # as smoothed
    assert got["bp"] == pytest.approx(math.exp(1 - 7 / 4)) and (got["sys_len"], got["ref_len"]) == (4, 7)
    by_hand = 100 * math.exp(1 - 7 / 4) * math.prod(precisions) ** 0.25
    assert got["score"] == pytest.approx(by_hand, rel=1e-9)
    assert got["score"] == pytest.approx(bleu_literature(["ein mann fährt ."], ["ein mann fährt mit dem fahrrad ."],
                                                         tokenized=True)[0], rel=1e-12)
