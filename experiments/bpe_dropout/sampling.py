"""BPE-dropout (Provilkov et al., 2020, Algorithm 1): a sampled segmentation of the training text.

BPE segments a word by merging, again and again, the adjacent pair of pieces that comes first
among those that form a piece (in a sentencepiece model: the piece of the highest score, the
leftmost of equals), until no adjacent pair forms one. BPE-dropout removes each merge that is
possible at a step with probability p, applies the best of those left, and stops the word when
none is left: p = 0 is plain BPE, p = 1 gives characters, and in between a word that the
vocabulary holds whole now and then comes in smaller pieces, which is the regularization.
Removing each candidate independently and taking the best survivor is taking the k-th best
candidate with probability p^k (1 - p), and stopping with probability p^m for m candidates:
one geometric draw a step.

Why not sentencepiece's own sampler (``encode(enable_sampling=True, alpha=p)``)? It draws once
per pair, as the pair leaves its queue, and a pair it skips stays unmerged unless a
neighbour's merge forms it again, so its p splits words more finely than the paper's
(``bpe_dropout.py`` beside this file: its 0.1 makes Multi30k 40% longer, the paper's 21%). And its
draws are not a function of the seed alone: sentencepiece 0.2.3, seeded alike, samples other
segmentations in another process, so ranks of one run would train on different batches (and
wait forever at an epoch's end when their step counts differ), and a resumed run would not
repeat the epoch it resumes in. Here the draws come from NumPy's generator, seeded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sentencepiece as spm

WORD_START = "\u2581"  # sentencepiece's "▁": a word's first piece starts with it
_CHUNK = 1 << 16  # geometric draws made at a time
_MAX_STATES = 1 << 20  # the cache of splits' candidate merges is emptied when it grows past this


def _merged(split: tuple[str, ...], i: int) -> tuple[str, ...]:
    """``split`` with pieces i and i + 1 merged into one."""
    return split[:i] + (split[i] + split[i + 1],) + split[i + 2:]


class BPEDropout:
    """Sampled segmentations over the pieces of a sentencepiece BPE model (see the module docstring).

    ``encode(texts, p, seed)`` gives ids as ``SentencePieceProcessor.encode`` would at p = 0
    (tested equal): the same normalization, and a run of characters outside the vocabulary as
    one unknown id.
    """

    def __init__(self, sp: spm.SentencePieceProcessor):
        self._sp = sp
        self._unk = sp.unk_id()
        self._id: dict[str, int] = {}
        self._score: dict[str, float] = {}
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                self._id[sp.id_to_piece(i)] = i
                self._score[sp.id_to_piece(i)] = sp.get_score(i)
        self._merges: dict[tuple[str, ...], tuple[int, ...]] = {}
        self._plain: dict[str, tuple[list[tuple[str, ...]], list[int]]] = {}

    def _ranked_merges(self, split: tuple[str, ...]) -> tuple[int, ...]:
        """Where the merges possible in ``split`` are, best first: i merges split[i] and split[i + 1]."""
        found = self._merges.get(split)
        if found is None:
            ranked = sorted((-self._score[split[i] + split[i + 1]], i) for i in range(len(split) - 1)
                            if split[i] + split[i + 1] in self._score)
            if len(self._merges) >= _MAX_STATES:
                self._merges.clear()
            found = self._merges[split] = tuple(i for _, i in ranked)
        return found

    def _plain_path(self, word: str) -> tuple[list[tuple[str, ...]], list[int]]:
        """The splits plain BPE passes through on ``word`` (characters first, its segmentation
        last) and that segmentation's ids: the path a draw of zeros follows."""
        found = self._plain.get(word)
        if found is None:
            path = [tuple(word)]
            while merges := self._ranked_merges(path[-1]):
                path.append(_merged(path[-1], merges[0]))
            if len(self._plain) >= _MAX_STATES:
                self._plain.clear()
            found = self._plain[word] = (path, self._ids(path[-1]))
        return found

    def _ids(self, split: tuple[str, ...]) -> list[int]:
        return [self._id.get(piece, self._unk) for piece in split]

    def encode(self, texts: Sequence[str], p: float, seed: int) -> list[list[int]]:
        """The ids of each text under BPE-dropout with probability ``p``, drawn from ``seed`` alone."""
        if not 0 <= p < 1:
            raise ValueError(f"BPE-dropout must be in [0, 1), got {p}")
        rng = np.random.default_rng(seed)
        draws: list[int] = []  # each step's k: how many of the best merges were removed
        at = 0
        out = []
        for text in texts:
            ids: list[int] = []
            for word in self._sp.normalize(text).split(WORD_START):
                if not word:
                    continue
                path, plain = self._plain_path(WORD_START + word)
                steps = len(path) - 1
                while at + steps >= len(draws):  # the plain path's draws, and one more, at hand
                    draws, at = draws[at:] + (rng.geometric(1 - p, _CHUNK) - 1).tolist(), 0
                # Plain BPE up to the first draw that is not 0 (at p = 0.1, the whole way for most words).
                ahead = draws[at:at + steps]
                if not any(ahead):
                    at += steps
                    word_ids = plain
                else:
                    zeros = next(j for j, k in enumerate(ahead) if k)
                    at += zeros
                    split = path[zeros]
                    while merges := self._ranked_merges(split):
                        if at == len(draws):
                            draws, at = (rng.geometric(1 - p, _CHUNK) - 1).tolist(), 0
                        k, at = draws[at], at + 1
                        if k >= len(merges):  # every possible merge was removed: the word is done
                            break
                        split = _merged(split, merges[k])
                    word_ids = self._ids(split)
                if self._unk in word_ids:  # a run of unknown characters is one unknown id, as in sentencepiece
                    for i in word_ids:
                        if not (i == self._unk and ids and ids[-1] == self._unk):
                            ids.append(i)
                else:
                    ids += word_ids
            out.append(ids)
        return out
