import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minitransformer as mt
from minitransformer import nn
from minitransformer import decoding
from minitransformer.decoding import beam_search, greedy_decode, length_penalty, translate
from minitransformer.functional.softmax import log_softmax_array, log_softmax_parts
from tests.helpers import sharp_model as model
from tests.helpers import DECODING_CFG, sources

@pytest.mark.parametrize("sizes", [{}, {"d_k": 3, "d_v": 5}])
def test_incremental_logits_equal_full_recompute(device, sizes):
    m = model(device, **sizes)
    src = mt.tensor(sources(), device=device)
    prefix = np.random.default_rng(1).integers(4, 13, (4, 6))
    prefix[:, 0] = 2
    full = m(src, mt.tensor(prefix, device=device)).numpy()
    src_mask = m.src_key_mask(src)
    memory = m.encode(src, src_mask)
    cache = m.new_cache()
    with mt.no_grad():
        for t in range(prefix.shape[1]):
            step = m.project(m.decode(mt.tensor(prefix[:, t: t + 1], device=device), memory, src_mask, cache,
                                      offset=t))
            np.testing.assert_allclose(step.numpy()[:, 0], full[:, t], rtol=1e-4, atol=1e-5)
    d_k, d_v = sizes.get("d_k", 8), sizes.get("d_v", 8)
    assert cache[0]["self"].k.shape == (4, 2, 6, d_k)  # (B, h, T, d_k): the prefix was cached
    assert cache[0]["self"].v.shape == (4, 2, 6, d_v)


def test_beams_attend_to_their_sentence_s_one_source(device):
    """Beam search gives the decoder one memory row per sentence for width beams each: the
    same logits as the memory repeated for every beam."""
    m = model(device)
    src = mt.tensor(sources(n=3), device=device)
    width, steps = 4, 5
    tokens = np.random.default_rng(2).integers(4, 13, (3 * width, steps))
    tokens[:, 0] = 2
    src_mask = m.src_key_mask(src)
    memory = m.encode(src, src_mask)
    rows = np.repeat(np.arange(3), width)
    repeated = (mt.Tensor(memory.data[rows]), src_mask.select(rows))
    caches = m.new_cache(), m.new_cache()
    with mt.no_grad():
        for t in range(steps):
            step = mt.tensor(tokens[:, t: t + 1], device=device)
            shared = m.project(m.decode(step, memory, src_mask, caches[0], offset=t)).numpy()
            each = m.project(m.decode(step, *repeated, caches[1], offset=t)).numpy()
            np.testing.assert_allclose(shared, each, rtol=1e-5, atol=1e-5)  # float32 rounding
        with pytest.raises(ValueError, match=r"11 rows of 1 positions for a memory of 3 sentences"):
            m.decode(mt.tensor(tokens[:11, :1], device=device), memory, src_mask, m.new_cache())


def test_greedy_takes_the_argmax_of_a_full_recompute():
    m = model()
    src = sources(n=2)
    out = greedy_decode(m, src, max_len_extra=3)
    for i, hyp in enumerate(out):
        prefix = [2]
        for tok in hyp:
            logits = m(src[i: i + 1], np.array([prefix])).numpy()[0, -1]
            logits[[0, 2]] = -np.inf  # PAD and BOS are never produced
            assert int(logits.argmax()) == tok
            prefix.append(tok)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_beam_size_one_equals_greedy(device, alpha):
    m = model(device)
    src = mt.tensor(sources(n=6), device=device)
    assert beam_search(m, src, beam_size=1, alpha=alpha, max_len_extra=8) == greedy_decode(m, src, max_len_extra=8)


def test_each_sentence_decodes_as_if_alone(device):
    m = model(device, seed=2)
    src = sources(seed=3, n=5)
    together = beam_search(m, mt.tensor(src, device=device), beam_size=3, max_len_extra=6, return_scores=True)
    for i in range(len(src)):
        alone_src = src[i: i + 1, : max(1, int((src[i] != 0).sum()))]  # no padding at all
        alone = beam_search(m, mt.tensor(alone_src, device=device), beam_size=3, max_len_extra=6, return_scores=True)
        assert alone[0][0] == together[i][0]
        assert alone[0][1] == pytest.approx(together[i][1], rel=1e-4)


# The score's denominator, written out: GNMT's lp and fairseq's --lenpen, of |Y| with EOS.
PENALTIES = {"gnmt": lambda n, alpha: ((5 + n) / 6) ** alpha, "fairseq": lambda n, alpha: n ** alpha}


@pytest.mark.parametrize("kind", sorted(PENALTIES))
def test_beam_respects_max_length_and_reports_its_score(kind):
    m = model(seed=4)
    src = sources(seed=5, n=3)
    results = beam_search(m, src, beam_size=4, alpha=0.6, max_len_extra=2, return_scores=True, length_penalty=kind)
    for i, (hyp, score) in enumerate(results):
        n = int((src[i] != 0).sum())
        assert len(hyp) <= n + 2 - 1  # the limit counts EOS
        assert not {0, 2, 3} & set(hyp)  # no PAD, BOS or EOS inside a hypothesis
        # The score is log P(hyp + EOS | src) / lp(|hyp| + 1), recomputed here from scratch.
        prefix, logp = [2], 0.0
        for tok in hyp + [3]:
            logits = m(src[i: i + 1], np.array([prefix])).numpy()[0, -1].astype(np.float64)
            logits[[0, 2]] = -np.inf
            logp += float(log_softmax_array(logits)[tok])
            prefix.append(tok)
        assert score == pytest.approx(logp / PENALTIES[kind](len(hyp) + 1, 0.6), rel=1e-4)


@given(st.integers(1, 300), st.floats(0.0, 3.0))
def test_length_penalties_are_their_formulas(length, alpha):
    for kind, formula in PENALTIES.items():
        assert length_penalty(length, alpha, kind) == pytest.approx(formula(length, alpha), rel=1e-12)


@pytest.mark.parametrize("kind", sorted(PENALTIES))
def test_the_largest_alpha_the_programs_take_decodes_with_finite_scores(kind):
    """ALPHA_MAX bounds every --alpha: lp stays finite and the scores nonzero at the longest
    hypothesis the decoder can write (a source of max_len positions, plus max_len_extra)."""
    longest = nn.TransformerConfig().max_len + decoding.MAX_LEN_EXTRA
    assert 1.0 <= length_penalty(longest, decoding.ALPHA_MAX, kind) < 1e35  # -1e3 / lp is no float32 zero
    for hyp, score in beam_search(model(seed=4), sources(seed=5, n=3), beam_size=4, alpha=decoding.ALPHA_MAX,
                                  max_len_extra=4, return_scores=True, length_penalty=kind):
        assert math.isfinite(score) and score < 0


def test_fairseq_s_penalty_ranks_by_the_mean_log_probability_per_token():
    """alpha = 1: the winner has the best log P / |Y| among the finished hypotheses, which may
    differ from GNMT's choice; an unknown penalty is refused before anything is decoded."""
    m = model(seed=4)
    src = sources(seed=5, n=6)
    seen = []
    beam_search(m, src, beam_size=4, alpha=1.0, max_len_extra=4, length_penalty="fairseq",
                observer=lambda step: seen.extend(step.finished))
    best = beam_search(m, src, beam_size=4, alpha=1.0, max_len_extra=4, length_penalty="fairseq", return_scores=True)
    for sid, (hyp, score) in enumerate(best):
        means = [logp / (len(tokens) + 1) for s_, tokens, logp, _ in seen if s_ == sid]
        assert score == pytest.approx(max(means), rel=1e-6)
    with pytest.raises(ValueError, match="unknown length penalty 'wu'"):
        beam_search(m, src, length_penalty="wu")


@pytest.mark.parametrize("learned", [True, False])
def test_outputs_stop_where_the_positions_do(learned):
    """A learned table has config.max_len rows: a source near it would run 50 tokens past them,
    so its output stops there instead of crashing halfway; sinusoids run the full 50."""
    m = model(seed=3, max_len=8, learned_positions=learned)
    m.src_embed.weight.data[3] = -10.0  # EOS improbable: every output runs to its limit
    src = sources(seed=6, n=3, max_len=6)
    lengths = (src != 0).sum(axis=1) + 1  # with EOS
    for hyps in (beam_search(m, src, beam_size=3, max_len_extra=5), greedy_decode(m, src, max_len_extra=5)):
        got = np.array([len(h) for h in hyps])
        if learned:
            assert list(got) == list(np.minimum(lengths + 5, 8) - 1)  # the limit counts EOS
        else:
            assert (got <= lengths + 5 - 1).all() and got.max() > 8  # past max_len, as the export


def test_beam_wider_than_the_vocabulary_allows():
    mt.manual_seed(0)
    m = nn.Transformer(nn.TransformerConfig(**{**DECODING_CFG, "vocab_size": 6})).eval()
    src = np.array([[4, 5, 4], [5, 0, 0]])
    out = beam_search(m, src, beam_size=4, max_len_extra=3)  # only 2 tokens besides the specials
    assert len(out) == 2 and all(set(h) <= {4, 5} for h in out)


def test_wider_beam_never_scores_worse_on_a_sharp_model():
    m = model(seed=6)
    src = sources(seed=7, n=6)
    narrow = beam_search(m, src, beam_size=1, alpha=0.0, max_len_extra=4, return_scores=True)
    wide = beam_search(m, src, beam_size=6, alpha=0.0, max_len_extra=4, return_scores=True)
    better = sum(w[1] >= n[1] - 1e-5 for w, n in zip(wide, narrow))
    assert better >= 5  # beam search is not exact, but on this tiny model it should dominate


def test_translate_of_no_sentences_is_empty():
    assert translate(None, None, []) == []


@pytest.mark.parametrize("search", [greedy_decode, beam_search, lambda m, src: beam_search(m, src, return_scores=True)])
def test_a_batch_of_no_sentences_decodes_to_nothing(search):
    assert search(model(), np.zeros((0, 5), np.int64)) == []


@settings(max_examples=150, deadline=None)
@given(slots=st.integers(1, 5), width=st.integers(1, 4), vocab=st.integers(2, 60), m=st.integers(1, 10),
       group=st.integers(1, 4), coarse=st.booleans(), forced=st.floats(0, 1), dead=st.floats(0, 1),
       seed=st.integers(0, 2**32 - 1))
def test_candidates_scored_by_their_bound_are_the_best_of_all(slots, width, vocab, m, group, coarse, forced, dead,
                                                              seed):
    """The fast selection gives the definition's candidates, ids and float32 scores exactly: with
    ties (coarse logits), -inf words, rows forced to EOS, dead beams (log P(prefix) = -inf), and
    groups of 1 to 4 words for the bound (1: the best row's exact m-th best)."""
    rng = np.random.default_rng(seed)
    rows = slots * width
    logits = rng.normal(0, 4, (rows, vocab)).astype(np.float32)
    if coarse:
        logits = np.round(logits).astype(np.float32)  # many equal scores
    logits[:, rng.random(vocab) < 0.1] = -np.inf  # never-valid words (PAD, BOS)
    shifted, log_sum = log_softmax_parts(logits)
    at_limit = np.repeat(rng.random(slots) < forced / 2, width)
    decoding._force_eos(shifted, at_limit, vocab - 1, np)
    scores = rng.normal(-5, 3, rows)
    scores[rng.random(rows) < dead / 3] = -np.inf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoding, "_GROUP", group)
        mp.setenv("OMP_NUM_THREADS", "2")
        mp.setattr(decoding, "_SPLIT_ELEMENTS", 1)  # rows split over two threads, however few
        top, top_scores = decoding._score_candidates(shifted, log_sum[:, 0], scores, slots, m, np)
    want, want_scores = decoding._plain_candidates(shifted, log_sum[:, 0], scores, slots, m)
    assert top.shape == want.shape and top_scores.dtype == np.float32
    finite = np.isfinite(want_scores)
    np.testing.assert_array_equal(top[finite], want[finite])
    np.testing.assert_array_equal(top_scores[finite], want_scores[finite])
    assert (top_scores[~finite] == -np.inf).all()  # empty slots: -inf, as the definition's leftovers


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(width=32, allow_nan=False), st.sampled_from([0.0, -0.0, 1.0, -1.0])),
                max_size=40))
def test_descending_bits_sort_as_the_numbers_do(values):
    """The sort key of the candidates' scores: a stable sort of the keys is one of the numbers,
    best first, equal numbers (+0 and -0 too) in their first order."""
    x = np.array(values, np.float32)
    keys = decoding._descending_bits(x)
    assert keys.dtype == np.uint64 and (keys < 2**32).all()
    np.testing.assert_array_equal(np.argsort(keys, kind="stable"), np.argsort(-x, kind="stable"))


def test_beam_search_with_the_plain_candidates_decodes_the_same(monkeypatch):
    m = model(seed=8)
    src = sources(seed=9, n=6)
    fast = beam_search(m, src, beam_size=4, alpha=0.6, max_len_extra=5, return_scores=True)
    monkeypatch.setattr(decoding, "_score_candidates", lambda shifted, log_sum, scores, slots, k, xp:
                        decoding._plain_candidates(shifted, log_sum, scores, slots, k))
    assert beam_search(m, src, beam_size=4, alpha=0.6, max_len_extra=5, return_scores=True) == fast


def test_a_model_that_starts_from_eos_decodes_as_its_full_forward_reads():
    """decoder_start="eos" (fairseq's): greedy, beam search and the incremental cache all start
    from EOS, as the model reads a target prefix in training: greedy takes the argmax of a full
    forward over [EOS] + prefix, beam width 1 is greedy, and a beam's score is recomputed from it."""
    eos = 3
    m = model(seed=5, decoder_start="eos")
    assert m.config.start_id == eos
    src = sources(seed=6, n=4)
    greedy = greedy_decode(m, src, max_len_extra=4)
    assert beam_search(m, src, beam_size=1, max_len_extra=4) == greedy
    beams = beam_search(m, src, beam_size=3, alpha=0.6, max_len_extra=4, return_scores=True)
    for i in range(len(src)):
        steps = []  # log P of each token after [EOS] + prefix, from the full forward
        for hyp in (greedy[i], beams[i][0]):
            prefix, logp = [eos], []
            for tok in hyp + [eos]:
                logits = m(src[i: i + 1], np.array([prefix])).numpy()[0, -1].astype(np.float64)
                logits[[0, 2]] = -np.inf
                logp.append(log_softmax_array(logits))
                prefix.append(tok)
            steps.append(logp)
        ends = len(greedy[i]) < 4 + int((src[i] != 0).sum()) - 1  # not cut at the length limit
        assert all(int(lp.argmax()) == tok for lp, tok in zip(steps[0], greedy[i] + ([eos] if ends else [])))
        hyp, score = beams[i]
        logp = sum(float(lp[tok]) for lp, tok in zip(steps[1], hyp + [eos]))
        assert score == pytest.approx(logp / length_penalty(len(hyp) + 1, 0.6), rel=1e-4)


def test_min_len_one_bars_the_empty_hypothesis():
    """fairseq's --min-len 1: EOS cannot be the first token. A model drawn to EOS ends most
    sentences at once without it."""
    m = model(seed=7)
    projector = m.projector

    def drawn_to_eos():  # EOS's logit raised by 10 at every step
        project = projector()

        def raised(states):
            logits = project(states)
            logits.data[..., 3] += 10
            return logits
        return raised

    m.projector = drawn_to_eos
    src = sources(seed=8, n=6)
    assert sum(not h for h in beam_search(m, src, beam_size=3)) >= 3
    assert all(beam_search(m, src, beam_size=3, min_len=1))
    with pytest.raises(ValueError, match="min_len"):
        beam_search(m, src, min_len=-1)
