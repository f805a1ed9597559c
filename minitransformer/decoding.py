"""Inference: greedy decoding and batched beam search, both incremental.

The encoder runs once per batch. The decoder then runs one position at a time with a cache
(see ``nn.attention``): each layer keeps the keys and values of the target prefix, and the
cross-attention keys and values of the source, so a step costs O(current length), not a
recompute of the whole prefix.

Beam search follows the paper (section 6.1): beam size 4, length penalty alpha = 0.6, and a
maximum output length of input length + 50 (and never past a learned position table). The length penalty is GNMT's (Wu et al., 2016):

    score(Y) = log P(Y | X) / lp(Y),     lp(Y) = ((5 + |Y|) / 6) ** alpha

|Y| counts the EOS. ``length_penalty="fairseq"`` divides by |Y| ** alpha instead, fairseq's
``--lenpen`` (with its default alpha = 1, the mean log-probability per token), which much of
the later literature decodes with.

Each step keeps the best ``beam_size`` live hypotheses per sentence. A hypothesis that emits
EOS among the top ``beam_size`` candidates is finished and never extended again; a sentence
is done once it has ``beam_size`` finished hypotheses or reaches its maximum length (where EOS
is forced), and leaves the batch. Its answer is the finished hypothesis with the best score.
Sentences are independent: each is decoded exactly as it would be alone (padding is masked,
and the stopping rule looks at nothing but the sentence itself). With beam size 1 this is
greedy decoding.

Every search starts from ``config.start_id``, the token the model was trained to read first
(BOS, or EOS as fairseq feeds it: ``TransformerConfig.decoder_start``). ``min_len=1`` keeps a
hypothesis from ending at its first step, fairseq's ``--min-len`` default (its EOS gets -inf
there, the other words keep their probabilities); 0, the default, lets it.

A step of ``_beam``: the decoder's log-probabilities for every row (one row per sentence at the
first step, where all beams are the same start token; k after), EOS barred before ``min_len``
and forced at the length limit (``_force_eos``), the 2k best extensions per sentence
(``_score_candidates``), split into those that finish and the k that live on
(``_select_beams``), and the cache gathered for the survivors (``_reorder``: the
self-attention caches every step; the source side, which the decoder holds once per sentence
for all its beams, only when sentences leave the batch).

``beam_search(..., observer=f)`` calls ``f(step)`` after each step with a ``BeamStep``: the
candidates the step scored, the hypotheses that finished, the beams it kept (examples/tour.py
draws one sentence's search as a tree from them). Without an observer nothing of it is built.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass

import numpy as np

from . import backend
from .autograd import no_grad
from .functional.softmax import log_softmax_array, log_softmax_parts_
from .tensor import Tensor

logger = logging.getLogger(__name__)
MAX_LEN_EXTRA = 50  # a translation may run this many tokens past its source (section 6.1)
BEAM, ALPHA = 4, 0.6  # the paper's beam size and length penalty (section 6.1)
# The largest alpha the programs take: lp stays finite and above the scores' rounding at any
# length the decoder writes ((5 + 1100) / 6) ** 10 is 4e22; GNMT used 0.6 to 1, our presets 2.
ALPHA_MAX = 10.0
LENGTH_PENALTIES = ("gnmt", "fairseq")


@contextlib.contextmanager
def _eval_mode(model):
    """Put a model in eval mode for a block and restore its mode afterwards, even on error."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def length_penalty(length: int, alpha: float, kind: str = "gnmt") -> float:
    r"""$\mathrm{lp}(Y)$ for a hypothesis of ``length`` $= |Y|$ tokens, EOS included: GNMT's
    $((5 + |Y|) / 6)^\alpha$, or fairseq's $|Y|^\alpha$ (``kind``, one of LENGTH_PENALTIES)."""
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "fairseq":
        return float(length) ** alpha
    raise ValueError(f"unknown length penalty {kind!r}; expected one of {LENGTH_PENALTIES}")


def _prepare(model, src):
    src = src if isinstance(src, Tensor) else Tensor(np.asarray(src))
    src_mask = model.src_key_mask(src)  # shared by every layer and step
    lengths = backend.to_device(src_mask.mask.sum(axis=1), "cpu")
    return src, lengths, src_mask, model.encode(src, src_mask)


def _max_out(model, lengths: np.ndarray, max_len_extra: int) -> np.ndarray:
    """Each sentence's longest output, EOS included: its source's length + ``max_len_extra``
    (section 6.1). Sources stay within ``config.max_len`` positions (``translate`` splits longer
    ones) and outputs may run ``max_len_extra`` past them, as the sinusoids allow and the export
    writes; a learned position table has only ``max_len`` rows, so there outputs stop at it."""
    if model.config.learned_positions:
        return np.minimum(lengths + max_len_extra, model.config.max_len)
    return lengths + max_len_extra


def _step_logits(model, project, last_tokens: np.ndarray, memory, src_mask, cache, t: int, xp):
    """The next token's logits for each row, computed on the model's device: (rows, V).
    ``project``: the search's ``model.projector()``.

    PAD and BOS are never valid outputs, so they get -inf (probability 0)."""
    states = model.decode(Tensor(xp.asarray(last_tokens[:, None])), memory, src_mask, cache, offset=t)
    logits = project(states).data[:, -1]
    logits[:, [model.config.pad_id, model.config.bos_id]] = -np.inf
    return logits


@no_grad()
def greedy_decode(model, src, max_len_extra: int = MAX_LEN_EXTRA) -> list[list[int]]:
    """The most probable next token at every step; returns token ids without BOS/EOS."""
    with _eval_mode(model):
        return _greedy(model, src, max_len_extra)


def _greedy(model, src, max_len_extra: int) -> list[list[int]]:
    cfg = model.config
    src, lengths, src_mask, memory = _prepare(model, src)
    xp = backend.array_module_of(src.data)
    n = src.shape[0]
    if n == 0:  # nothing to decode (and max_out.max() has no value)
        return []
    max_out = _max_out(model, lengths, max_len_extra)
    cache, project = model.new_cache(), model.projector()
    out = [[] for _ in range(n)]
    done = np.zeros(n, bool)
    last = np.full(n, cfg.start_id)
    for t in range(int(max_out.max())):
        logp = log_softmax_array(_step_logits(model, project, last, memory, src_mask, cache, t, xp))
        last = backend.to_device(logp.argmax(axis=-1), "cpu")
        for i in np.flatnonzero(~done):
            if last[i] == cfg.eos_id:
                done[i] = True
            else:
                out[i].append(int(last[i]))
                done[i] = len(out[i]) >= max_out[i] - 1  # the next position could only be EOS
        if done.all():
            break
    return out


@dataclass
class BeamStep:
    """What one step of ``beam_search`` scored and chose, as its ``observer`` receives it.

    A slot is a sentence still in the batch; rows are its beams, ``row = slot * width + beam``
    (width 1 at step 0, where every beam is the same start token). Arrays are NumPy, on the host.

        t             the output position this step filled (0: the first token after the start)
        sentences     (slots,) each slot's index in the batch given to ``beam_search``
        prefixes      (rows, t) each row's tokens before this step, the start token left out
        candidate_*   (slots, min(2k, width * V)) the best extensions of each slot, best
                      first: the row each extends (``_rows``), the word it adds (``_words``),
                      and its log P(prefix + word | src) (``_scores``; -inf: not possible)
        finished      (sentence, tokens, log_prob, score) of each hypothesis that ended here
                      (tokens without EOS; score = log_prob / length_penalty decides the winner)
        kept_*        the beams that live on: ``kept_sentences`` (n,) the sentences still
                      decoding, and for each its k beams (n, k): the row each extends, its word
                      and its log P (-inf: a dead beam, when the vocabulary is tiny)
    """

    t: int
    sentences: np.ndarray
    prefixes: np.ndarray
    candidate_rows: np.ndarray
    candidate_words: np.ndarray
    candidate_scores: np.ndarray
    finished: list[tuple[int, list[int], float, float]]
    kept_sentences: np.ndarray
    kept_rows: np.ndarray
    kept_words: np.ndarray
    kept_scores: np.ndarray


@no_grad()
def beam_search(model, src, beam_size: int = BEAM, alpha: float = ALPHA, max_len_extra: int = MAX_LEN_EXTRA,
                return_scores: bool = False, observer=None, length_penalty: str = "gnmt", min_len: int = 0):
    """Batched beam search (see the module docstring). Returns, per sentence, the best
    hypothesis's token ids without the start token and EOS (and its score when ``return_scores``).
    ``length_penalty``: "gnmt" or "fairseq" (LENGTH_PENALTIES), the lp that ``alpha`` shapes.
    ``min_len``: tokens a hypothesis has at least, EOS not counted (fairseq's default is 1).

    ``observer``: called as ``observer(step)`` with a ``BeamStep`` after every step, to watch
    the search; it changes nothing (None, the default, costs nothing)."""
    with _eval_mode(model):
        if length_penalty not in LENGTH_PENALTIES:  # before the encoder runs
            raise ValueError(f"unknown length penalty {length_penalty!r}; expected one of {LENGTH_PENALTIES}")
        if min_len < 0:
            raise ValueError(f"min_len must be >= 0, got {min_len}")
        results = _beam(model, src, beam_size, alpha, max_len_extra, observer, length_penalty, min_len)
    return results if return_scores else [hyp for hyp, _ in results]


def _beam(model, src, k: int, alpha: float, max_len_extra: int, observer=None, lp: str = "gnmt",
          min_len: int = 0) -> list[tuple[list[int], float]]:
    eos = model.config.eos_id
    src, lengths, src_mask, memory = _prepare(model, src)
    if len(lengths) == 0:  # nothing to decode (and max_out.max() has no value)
        return []
    xp = backend.array_module_of(src.data)
    max_out = _max_out(model, lengths, max_len_extra)
    cache, project = model.new_cache(), model.projector()
    # Rows are (sentence, beam) pairs, beam-major inside each sentence: row = slot * width + beam.
    # Every beam starts from the same start token, so the first step decodes one row per sentence.
    width = 1
    active = np.arange(len(lengths))  # sentence id of each slot still in the batch
    tokens = np.zeros((len(active), 0), np.int64)  # generated so far, per row
    scores = np.zeros(len(active))  # log P(tokens | src), per row
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in active]

    for t in range(int(max_out.max())):
        last = tokens[:, -1] if t else np.full(len(tokens), model.config.start_id)
        # log P(next | prefix) = shifted - log_sum, per row (slots * width, V) and (rows, 1)
        shifted, log_sum = log_softmax_parts_(_step_logits(model, project, last, memory, src_mask, cache, t, xp))
        at_limit = np.repeat(t + 1 >= max_out[active], width)
        if t < min_len:  # EOS barred after the softmax, as in fairseq (the other words keep their log P);
            shifted[xp.asarray(np.flatnonzero(~at_limit)), eos] = -np.inf  # the length limit wins
        _force_eos(shifted, at_limit, eos, xp)
        top, top_scores = _score_candidates(shifted, log_sum[:, 0], scores, len(active), 2 * k, xp)
        vocab = shifted.shape[-1]
        ends, slots, rows, words, scores = _select_beams(top, top_scores, vocab, width, k, eos)
        ended = [(int(active[slot]), tokens[row].tolist(), score) for slot, row, score in zip(*ends)]
        ended = [(sid, hyp, score, score / length_penalty(len(hyp) + 1, alpha, lp)) for sid, hyp, score in ended]
        for sid, hyp, _, penalized in ended:
            finished[sid].append((penalized, hyp))
        going = np.asarray([len(finished[sid]) < k for sid in active[slots]], bool)
        if observer is not None:  # copies of what the search reads on: the observer cannot change it
            observer(BeamStep(
                t, active.copy(), tokens.copy(),
                np.arange(len(top))[:, None] * width + top // vocab, top % vocab, top_scores, ended,
                active[slots[going]], rows[going], words[going], scores[going]))
        if not going.any():
            break
        # Sentences done leave the batch; only the rows of those still going live on.
        slots, rows, words, scores = slots[going], rows[going].ravel(), words[going].ravel(), scores[going].ravel()
        source_rows = None if len(slots) == len(active) else slots
        tokens = np.concatenate([tokens[rows], words[:, None]], axis=1)
        active, width = active[slots], k
        memory, src_mask = _reorder(model, cache, memory, src_mask, rows, source_rows, xp)

    results = []
    for sid, hyps in enumerate(finished):
        if not hyps:  # only non-finite scores were left: NaN log-probabilities
            raise FloatingPointError(f"beam search finished no hypothesis for sentence {sid} of the batch: the "
                                     f"model's log-probabilities are not finite (are its weights?)")
        best_score, best = max(hyps, key=lambda h: h[0])
        results.append((best, best_score))
    return results


def _force_eos(shifted, rows: np.ndarray, eos: int, xp) -> None:
    """At its last allowed position a row may only end: every token but EOS gets -inf (EOS keeps
    its log-probability: the row's log_sum is left as it is)."""
    if rows.any():
        forced = xp.asarray(np.flatnonzero(rows))
        eos_value = shifted[forced, eos].copy()
        shifted[forced] = -np.inf
        shifted[forced, eos] = eos_value


def _score_candidates(shifted, log_sum, scores: np.ndarray, slots: int, m: int, xp
                      ) -> tuple[np.ndarray, np.ndarray]:
    """The ``m`` best extensions of each sentence, best first (equal scores: lower id first), on the
    host: their ids beam * V + word (slots, m), and their scores, in float32:

        score(row, word) = (shifted[row, word] - log_sum[row]) + log P(prefix of row)

    (log P(word | prefix) + log P(prefix), as ``_plain_candidates`` computes it for every word.)

    Scoring all ``width * V`` words of a sentence to keep 2k of them is most of a step's work
    after the GEMMs, so only those that can make it are scored. Any row's m-th best candidate
    scores at most the sentence's m-th best, so each sentence takes the row most likely to
    hold its best candidates (the best log P(prefix) - log_sum: a row's largest ``shifted`` is
    0), and from every row scores only the words whose ``shifted`` reaches a bound of that row's
    m-th best, less a margin for rounding. The bound is the m-th largest of the maxima of
    ``vocab // _GROUP`` groups of the row's words (m words in different groups reach it, so it is
    at most the row's m-th best, and equal to it unless two of the best share a group): one pass
    down the row and a partition of the maxima, where a partition of the whole row took ten
    times longer. A sentence with fewer than m finite maxima in that row scores all its finite
    candidates; slots left empty get id 0 and -inf.
    """
    rows, vocab = shifted.shape
    width = rows // slots
    m = min(m, width * vocab)
    prefix = xp.asarray(scores, dtype=shifted.dtype)  # (rows,) log P(prefix)
    # The bound: the m-th best score of each sentence's most promising row.
    promise = backend.to_device(prefix - log_sum, "cpu").reshape(slots, width)
    best = np.arange(slots) * width + np.where(np.isnan(promise), -np.inf, promise).argmax(axis=1)
    bound = np.full(slots, -np.inf, np.float32)
    groups = vocab // _GROUP  # of _GROUP words each, word j in group j % groups
    if m <= groups:
        index = xp.asarray(best)

        def kth_best(start: int, stop: int):  # at most the m-th largest shifted value of each best row
            best_rows = shifted[index[start:stop], :groups * _GROUP].reshape(stop - start, _GROUP, groups)
            return xp.partition(best_rows.max(axis=1), groups - m, axis=1)[:, groups - m]

        kth = xp.concatenate(backend.row_blocks(kth_best, slots, shifted, _SPLIT_ELEMENTS // vocab))
        bound = backend.to_device((kth - log_sum[index]) + prefix[index], "cpu")
    # Rows keep the words whose shifted value reaches the bound, in float64 with a margin that
    # covers float32's rounding of the two additions (relative 6e-8 each).
    log_sum_h, prefix_h = (backend.to_device(a, "cpu").astype(np.float64) for a in (log_sum, prefix))
    bound_h = np.repeat(bound.astype(np.float64), width)
    with np.errstate(invalid="ignore"):
        threshold = bound_h - prefix_h + log_sum_h
        threshold -= 1e-6 * (np.abs(bound_h) + np.abs(prefix_h) + np.abs(log_sum_h) + 1)
    # Where the bound is -inf (or NaN), every finite candidate of the sentence is scored.
    threshold[~(bound_h > -np.inf)] = -np.finfo(np.float32).max
    threshold = np.where(np.isnan(threshold), np.inf, threshold)  # a NaN log_sum: nothing to score
    threshold = xp.asarray(threshold.astype(shifted.dtype))

    def survivors(start: int, stop: int):  # flat indices into shifted
        return xp.flatnonzero(shifted[start:stop] >= threshold[start:stop, None]) + start * vocab

    flat = xp.concatenate(backend.row_blocks(survivors, rows, shifted, _SPLIT_ELEMENTS // vocab))
    row, word = flat // vocab, flat % vocab
    cand_scores = backend.to_device((shifted.ravel()[flat] - log_sum[row]) + prefix[row], "cpu")
    row, word = backend.to_device(row, "cpu"), backend.to_device(word, "cpu")
    slot, cand = row // width, (row % width) * vocab + word
    # Per sentence, best first and lower id first on ties; then the first m of each. The
    # candidates come in (slot, id) order, so one stable sort of a key that orders by slot, then
    # by score from the best, does it: a third of the time of a three-key lexsort.
    order = np.argsort((slot.astype(np.uint64) << 32) | _descending_bits(cand_scores), kind="stable")
    slot, cand, cand_scores = slot[order], cand[order], cand_scores[order]
    counts = np.bincount(slot, minlength=slots)
    rank = np.arange(len(slot)) - (np.cumsum(counts) - counts)[slot]  # position inside its sentence
    keep = rank < m
    top = np.zeros((slots, m), np.int64)
    top_scores = np.full((slots, m), -np.inf, cand_scores.dtype)
    top[slot[keep], rank[keep]] = cand[keep]
    top_scores[slot[keep], rank[keep]] = cand_scores[keep]
    return top, top_scores


_GROUP = 16  # words per group in _score_candidates's bound
# Words a thread takes at least in _score_candidates: its passes are cheap for their size, and
# only from some 500 rows of 8,000 words are two threads faster than one.
_SPLIT_ELEMENTS = 1 << 21


def _descending_bits(x: np.ndarray) -> np.ndarray:
    """uint64 keys below 2**32, one per (non-NaN) float32, that sort as the numbers do in
    descending order. A float's bits, read as an unsigned integer, order the non-negative numbers
    correctly and the negative ones backwards: so flip every bit of a negative number, only the
    sign bit of the others; that orders them ascending, and the complement turns it around.
    (-0.0 becomes +0.0 first: the two are equal scores.)"""
    bits = (x.astype(np.float32) + np.float32(0)).view(np.uint32).astype(np.uint64)
    ascending = np.where(bits >> 31, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return 0xFFFFFFFF - ascending


def _plain_candidates(shifted, log_sum, scores: np.ndarray, slots: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """What ``_score_candidates`` computes, by its definition: every word of every row scored,
    each sentence's candidates sorted (NumPy arrays in and out; the tests hold the two equal)."""
    cand = ((shifted - log_sum[:, None]) + scores.astype(shifted.dtype)[:, None]).reshape(slots, -1)
    ids = np.broadcast_to(np.arange(cand.shape[1]), cand.shape)
    top = np.lexsort((ids, -cand), axis=1)[:, :min(m, cand.shape[1])]
    return top, np.take_along_axis(cand, top, axis=1)


def _select_beams(top: np.ndarray, top_scores: np.ndarray, vocab: int, width: int, k: int, eos: int):
    """Split each sentence's candidates (best first) into those that end and those that grow.

    A candidate ending in EOS finishes if it is among the best k; the best k candidates that
    do not end are the next beams (at least k of the 2k do not, as each row has one EOS, unless
    the vocabulary is tiny: then the missing beams are dead rows with score -inf). Returns the
    finishing (slots, rows, scores), and for each slot with a live beam: its index, and its k
    beams' parent rows, words and scores, (slots, k) each.
    """
    parent, word = np.divmod(top, vocab)
    rows = np.arange(len(top))[:, None] * width + parent
    finite = top_scores > -np.inf
    ends = finite & (word == eos)
    ends[:, k:] = False
    grows = finite & (word != eos)
    end_slot, end_rank = np.nonzero(ends)
    end_rows, end_scores = rows[end_slot, end_rank], top_scores[end_slot, end_rank].tolist()
    pick = np.argsort(~grows, axis=1, kind="stable")[:, :k]  # the first k that grow, in rank order
    rows, word, top_scores, live = (np.take_along_axis(a, pick, axis=1) for a in (rows, word, top_scores, grows))
    slots = np.flatnonzero(live[:, 0])
    return ((end_slot, end_rows, end_scores), slots, rows[slots], word[slots],
            np.where(live, top_scores, -np.inf)[slots])


def _reorder(model, cache, memory, src_mask, rows: np.ndarray, source_rows: np.ndarray | None, xp):
    """Keep the decoder's state of the surviving beams: the self-attention caches follow
    ``rows``. The source side (memory, padding, cross-attention caches) has one row per slot,
    shared by the slot's beams (``DecoderLayer._cross``), and is gathered only when the slots
    change: ``source_rows``, the slots kept."""
    index = None if source_rows is None else xp.asarray(source_rows)
    model.reorder_cache(cache, xp.asarray(rows), index)
    if index is None:
        return memory, src_mask
    return Tensor(memory.data[index]), src_mask.select(index)


def translate(model, tokenizer, sentences: list[str], device: str = "cpu", beam_size: int = BEAM,
              alpha: float = ALPHA, max_tokens: int = 2048, progress: bool = False, first_line: int = 1,
              length_penalty: str = "gnmt") -> list[str]:
    """Beam-search raw sentences in length-sorted batches of about ``max_tokens`` source
    tokens; returns one detokenized translation per sentence, in the input order.

    ``tokenizer`` is a ``data.Tokenizer``; sources get the EOS the model was trained with.
    What the model cannot read is not decoded, since it would only invent a sentence: an
    empty (or whitespace-only) sentence gives "", and so does one of which the vocabulary
    knows no character (all <unk>), with a warning. A sentence longer than the model's
    positions (``config.max_len`` tokens with EOS) is split after each . ! or ? and translated
    part by part; a part still too long is truncated. ``max_tokens`` only sizes the batches
    (raised to the longest part's length if that is longer): it never truncates.
    Warnings call sentence i "line first_line + i", its line in the file it came from.
    ``length_penalty`` (with ``alpha``) as ``beam_search``'s.
    """
    from .data import TokenBatcher  # the data layer needs nothing from the model

    if not sentences:
        return []
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    limit = model.config.max_len - 1  # pieces, EOS not counted
    owners, parts = [], []  # sentence index of each part to decode, and its piece ids
    for i, (text, ids) in enumerate(zip(sentences, tokenizer.encode(sentences))):
        if not ids:  # empty, or only whitespace
            continue
        if tokenizer.knows_nothing_of(ids):
            logger.warning("line %d: the vocabulary knows none of its characters; left untranslated",
                           first_line + i)
            continue
        pieces = [ids] if len(ids) <= limit else _split(text, tokenizer, limit, first_line + i)
        owners += [i] * len(pieces)
        parts += pieces
    if not parts:
        return [""] * len(sentences)
    batcher = TokenBatcher(parts, max_tokens=max(max_tokens, max(map(len, parts)) + 1), shuffle=False)
    batches = batcher.epoch_batches(0)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="translate", unit="batch", leave=False)
    texts: list[str] = [""] * len(parts)
    for indices in batches:
        batch = batcher.make_batch(indices)
        hyps = beam_search(model, Tensor(backend.to_device(batch.src, device)), beam_size, alpha,
                           length_penalty=length_penalty)
        for j, text in zip(batch.indices, tokenizer.decode(hyps)):
            texts[j] = text
    out: list[list[str]] = [[] for _ in sentences]
    for owner, text in zip(owners, texts):
        out[owner].append(text)
    return [" ".join(t) for t in out]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentence_parts(text: str, tokenizer) -> list[list[int]]:
    """Piece ids of ``text`` cut after each . ! or ? (the parts of a text longer than the
    model's positions)."""
    return [p for p in tokenizer.encode(_SENTENCE_END.split(text)) if p]


def _split(text: str, tokenizer, limit: int, line: int) -> list[list[int]]:
    """Piece ids of ``text`` cut after each sentence end, each part at most ``limit`` long."""
    parts = sentence_parts(text, tokenizer)
    cut = sum(len(p) > limit for p in parts)
    if len(parts) == 1:
        what = f"truncated to {limit} tokens"
    else:
        what = f"translated in {len(parts)} parts cut at sentence ends"
        what += f", {cut} of them truncated to {limit} tokens" if cut else ""
    logger.warning("line %d: %d tokens, more than the model's %d positions: %s", line,
                   sum(map(len, parts)), limit + 1, what)
    return [p[:limit] for p in parts]
