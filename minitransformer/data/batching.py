"""Token-count batching: padded id arrays for the encoder-decoder, bucketed by length.

The paper (section 5.1): "Sentence pairs were batched together by approximate sequence
length. Each training batch contained a set of sentence pairs containing approximately
25000 source tokens and 25000 target tokens." Counting tokens instead of sentences keeps
every step's work (and memory) about the same, and grouping sentences of similar length
keeps padding, which is computed and thrown away, small.

One pair becomes (the tokenizer gives the pieces x and y, the batcher adds the specials):

    src     = x + [EOS]          the encoder input
    tgt_in  = [BOS] + y          the decoder input (teacher forcing)
    tgt_out = y + [EOS]          what the decoder must predict at each position

(``start_id=EOS_ID`` puts EOS in BOS's place, as fairseq does: the model's
``config.start_id``, which decoding starts from too.)

A ``Batch`` pads these to the longest row with PAD_ID into int64 arrays, with

    src      (B, S)   src_mask (B, S)  bool, True at real tokens (the attention keys to use)
    tgt_in   (B, T)   tgt_mask (B, T)  bool, True at real tokens of tgt_in and of tgt_out
    tgt_out  (B, T)                    (the same positions: both have len(y) + 1 tokens)
    indices  (B,)     each row's position in the data set given to the batcher
    num_src_tokens, num_tgt_tokens     real (unpadded) tokens; num_tgt_tokens counts the
                                       loss terms, the paper's "target tokens"

The masks are built here, once per batch, and the model expands them for each attention.

``TokenBatcher`` makes an epoch's batches so that B * S <= max_tokens and B * T <= max_tokens
(padded sizes, which is what memory and compute see):

    1. sort the pairs by (longer side's length, source length, target length), once; then,
       each epoch, shuffle every run of pairs of equal lengths with a generator seeded by
       (seed, epoch), so that the batches differ from epoch to epoch;
    2. cut the sorted pairs greedily into batches within the token budget (the lengths along
       the sorted pairs are the same every epoch, and so are the cuts);
    3. shuffle the batch order with the same generator;
    4. data parallelism: with W ranks, each batch is one step of all ranks together, and
       rank r takes the r-th of W consecutive slices of its (length-sorted) sentences
       (``np.array_split``). Every rank computes the same list, since it depends only on
       (data, seed, epoch), so all take the same number of steps (an all-reduce waits for
       all of them), and a step trains on the same sentences at any W: the union of the
       ranks' shares is one process's batch. A batch of fewer than W sentences (at most the
       epoch's last cut, when W * max_len <= max_tokens) leaves the last ranks an empty share.

``max_tokens`` is the step's, all ranks together: the paper's 25,000 + 25,000 tokens per
step, spread over 8 GPUs, are ``max_tokens=25000`` with W = 8, about 3,100 a GPU.
Everything depends only on (seed, epoch), so a run resumed from ``state_dict()`` sees
exactly the batches it would have seen without the interruption.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..schema import check_int, check_keys
from ..settings import SettingsError
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

logger = logging.getLogger(__name__)

# The way batches are made, saved in state_dict(), so that only the code that made a run's
# batches resumes it. 3 sorts the pairs once and shuffles each run of equal lengths each
# epoch; 2 shuffled all the pairs, then sorted them (batches of the same kind, but others);
# from 2 on, each step's batch is split among the ranks; before, unsaved, every rank cut its own.
BATCHING = 3


@dataclass
class Batch:
    """One step's padded arrays (shapes in the module docstring); the target fields are
    None for a source-only batch (translation). ``epoch``/``step`` say where in the
    batcher's stream it came from (None when built by ``collate`` directly)."""

    src: np.ndarray
    src_mask: np.ndarray
    tgt_in: np.ndarray | None
    tgt_out: np.ndarray | None
    tgt_mask: np.ndarray | None
    indices: np.ndarray
    num_src_tokens: int
    num_tgt_tokens: int
    epoch: int | None = None
    step: int | None = None

    def __len__(self) -> int:
        return self.src.shape[0]


def _pad(rows: Sequence[np.ndarray], prefix: int | None, suffix: int | None) -> np.ndarray:
    """Rows with an optional first/last token added, right-padded with PAD_ID: (B, L) int64."""
    extra = (prefix is not None) + (suffix is not None)
    length = max(len(r) for r in rows) + extra
    out = np.full((len(rows), length), PAD_ID, dtype=np.int64)
    start = int(prefix is not None)
    for b, row in enumerate(rows):
        if prefix is not None:
            out[b, 0] = prefix
        out[b, start:start + len(row)] = row
        if suffix is not None:
            out[b, start + len(row)] = suffix
    return out


def collate(src: Sequence[Sequence[int]], tgt: Sequence[Sequence[int]] | None = None,
            indices: Sequence[int] | None = None, start_id: int = BOS_ID) -> Batch:
    """A ``Batch`` from piece-id sequences (without specials, as ``Tokenizer.encode`` gives).

    Use it for inputs the batcher does not see, e.g. sentences to translate: the source
    gets the same EOS the model was trained with. ``start_id`` begins each ``tgt_in`` row.
    """
    if len(src) == 0:
        raise ValueError("collate needs at least one sequence")
    if tgt is not None and len(tgt) != len(src):
        raise ValueError(f"collate got {len(src)} source and {len(tgt)} target sequences")
    src_rows = [np.asarray(s, dtype=np.int64) for s in src]
    src_arr = _pad(src_rows, None, EOS_ID)                                  # (B, S)
    # Lengths, not `!= PAD_ID`: a (malformed) id 0 inside a sentence must not unmask itself.
    src_mask = np.arange(src_arr.shape[1]) < np.array([len(r) + 1 for r in src_rows])[:, None]
    ids = np.arange(len(src), dtype=np.int64) if indices is None else np.asarray(indices, np.int64)
    if tgt is None:
        return Batch(src_arr, src_mask, None, None, None, ids, int(src_mask.sum()), 0)
    tgt_rows = [np.asarray(t, dtype=np.int64) for t in tgt]
    tgt_in, tgt_out = _pad(tgt_rows, start_id, None), _pad(tgt_rows, None, EOS_ID)  # (B, T)
    tgt_mask = np.arange(tgt_in.shape[1]) < np.array([len(r) + 1 for r in tgt_rows])[:, None]
    return Batch(src_arr, src_mask, tgt_in, tgt_out, tgt_mask, ids,
                 int(src_mask.sum()), int(tgt_mask.sum()))


class PackedSequences:
    """Variable-length id sequences in one flat int32 array with offsets.

    Sequence i is ``data[offsets[i]:offsets[i + 1]]``. WMT14's 4.5M pairs, ~30 pieces a
    side, as Python lists of ints would take about 10 GB; packed, about 1 GB.
    """

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        if offsets.ndim != 1 or offsets[0] != 0 or offsets[-1] != len(data):
            raise ValueError(f"offsets must run from 0 to len(data)={len(data)}")
        self.data, self.offsets = data, offsets
        self.lengths = np.diff(offsets)

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int]]) -> PackedSequences:
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        data = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32,
                           count=int(offsets[-1]))
        return cls(data, offsets)

    @classmethod
    def concatenate(cls, parts: Sequence[PackedSequences]) -> PackedSequences:
        starts = np.cumsum([0] + [len(p.data) for p in parts[:-1]])
        offsets = np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
        return cls(np.concatenate([p.data for p in parts]), offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.data[self.offsets[i]:self.offsets[i + 1]]


def encode_packed(tokenizer: Tokenizer, texts: Sequence[str], chunk_size: int = 100_000) -> PackedSequences:
    """``tokenizer.encode(texts)``, packed chunk by chunk, so that a corpus the size of
    WMT14 never exists as Python lists all at once."""
    return PackedSequences.concatenate([
        PackedSequences.from_sequences(tokenizer.encode(texts[i:i + chunk_size]))
        for i in range(0, max(len(texts), 1), chunk_size)
    ])


def _packed(seqs: PackedSequences | Sequence[Sequence[int]]) -> PackedSequences:
    return seqs if isinstance(seqs, PackedSequences) else PackedSequences.from_sequences(seqs)


@dataclass
class _Pairs:
    """The data set's pairs and the plan that follows from their lengths alone: ``by_length``, the pairs the batches may use, sorted stably by (longest, S, T);
    ``ties``, the (start, end) of each run of two or more equal lengths in it; ``cuts``, where
    each batch ends in it."""

    src: PackedSequences
    tgt: PackedSequences | None
    by_length: np.ndarray
    ties: list[tuple[int, int]]
    cuts: np.ndarray


def length_rank(src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
    """Each pair's rank among the distinct (max(S, T), S, T) of the data set, ordered
    lexicographically: a stable sort by it is a stable sort by the three lengths, in one key.

    Sentence lengths are small numbers, so the ranks come from a table over every (S, T)
    that can occur, with no sort of the pairs; past 1,024 tokens the table would be too
    large, and the pairs themselves are sorted instead. The rank is a uint16 where it fits,
    which NumPy sorts by radix, in linear time.
    """
    width = int(max(src_len.max(), tgt_len.max())) + 1
    if width <= 1024:
        cell = src_len * width + tgt_len
        present = np.flatnonzero(np.bincount(cell, minlength=width * width))
        s, t = np.divmod(present, width)
        table = np.empty(width * width, np.int32)
        table[present[np.lexsort((t, s, np.maximum(s, t)))]] = np.arange(len(present))
        rank = table[cell]
    else:
        by_key = np.lexsort((tgt_len, src_len, np.maximum(src_len, tgt_len)))
        new = np.ones(len(by_key), bool)  # where (S, T), and so the key, changes
        new[1:] = (np.diff(src_len[by_key]) != 0) | (np.diff(tgt_len[by_key]) != 0)
        rank = np.empty(len(by_key), np.int64)
        rank[by_key] = np.cumsum(new) - 1
    return rank.astype(np.uint16) if rank.max() < 2**16 else rank


class TokenBatcher:
    """Batches of about ``max_tokens`` padded tokens, bucketed by length; with ``world_size``
    ranks, this rank's share of each.

    src, tgt: piece ids per sentence (``Tokenizer.encode`` output, or ``encode_packed``'s
        for a large corpus); ``tgt=None`` for source-only batches (translating a test set).
    max_tokens: budget per batch for each side, padding included: B*S and B*T stay within it.
    max_len: pairs whose source or target exceeds this many tokens, EOS/BOS included, are
        dropped (counted in ``num_dropped`` and logged). Without it, a pair that cannot fit
        ``max_tokens`` on its own is an error.
    shuffle: False gives a fixed order (sorted by length, the same each epoch), e.g. for
        evaluation; ``Batch.indices`` maps rows back to the input order.
    seed, rank, world_size: see the module docstring.
    start_id: the first token of each ``tgt_in`` row (the model's ``config.start_id``).

    Iterate with ``for batch in batcher`` (endless, epoch after epoch, from ``position``),
    or ``iter_epoch(epoch)`` for one epoch.
    """

    def __init__(self, src: PackedSequences | Sequence[Sequence[int]],
                 tgt: PackedSequences | Sequence[Sequence[int]] | None = None, *,
                 max_tokens: int, max_len: int | None = None, shuffle: bool = True,
                 seed: int = 0, rank: int = 0, world_size: int = 1, start_id: int = BOS_ID):
        if tgt is not None and len(tgt) != len(src):
            raise ValueError(f"TokenBatcher got {len(src)} source and {len(tgt)} target sequences")
        if len(src) == 0:
            raise ValueError("TokenBatcher got no sentences")
        if max_tokens < 1:
            raise SettingsError(f"max_tokens must be positive, got {max_tokens}")
        if max_len is not None and not 1 <= max_len <= max_tokens:
            raise SettingsError(f"max_len must be in [1, max_tokens={max_tokens}], got {max_len}")
        if not 0 <= rank < world_size:
            raise SettingsError(f"rank {rank} is not in [0, world_size={world_size})")
        self.max_tokens, self.max_len, self.shuffle = max_tokens, max_len, shuffle
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.start_id = start_id
        self.num_pairs = len(src)
        self._pairs = self._measure(_packed(src), _packed(tgt) if tgt is not None else None)
        self.num_dropped = self.num_pairs - len(self._pairs.by_length)
        self.position = (0, 0)  # (epoch, step) of the next batch the iterator yields
        self._cached: tuple[int, list[np.ndarray]] | None = None

    def _measure(self, src: PackedSequences, tgt: PackedSequences | None) -> _Pairs:
        """The pairs with their lengths and their plan (``_Pairs``), of those kept: within
        max_len, or (without it) an error naming a pair that cannot fit max_tokens on its own."""
        src_len = src.lengths + 1                                        # + EOS
        tgt_len = tgt.lengths + 1 if tgt is not None else np.zeros_like(src_len)  # + BOS (or EOS)
        longest = np.maximum(src_len, tgt_len)  # B * max(S, T) <= max_tokens keeps both sides within budget
        if self.max_len is not None:
            kept = np.flatnonzero(longest <= self.max_len)
            dropped = len(src) - len(kept)
            if dropped:
                logger.warning("dropped %d of %d sentence pairs longer than max_len=%d tokens",
                               dropped, len(src), self.max_len)
            if len(kept) == 0:
                raise SettingsError(f"every pair is longer than max_len={self.max_len}")
        else:
            too_long = np.flatnonzero(longest > self.max_tokens)
            if len(too_long):
                i = int(too_long[0])
                raise SettingsError(
                    f"{len(too_long)} pairs cannot fit max_tokens={self.max_tokens} on their own, "
                    f"e.g. pair {i} ({src_len[i]} source, {tgt_len[i]} target "
                    f"tokens); raise max_tokens or set max_len to drop them"
                )
            kept = np.arange(len(src))
        # Sorted on max(S, T) first, the quantity the budget bounds, which fills batches best
        # (Multi30k: 4% padding on either side; sorting on S first pads T by 12%). int32
        # indices where they fit: half the bytes to move.
        rank = length_rank(src_len[kept], tgt_len[kept])
        by_length = kept[np.argsort(rank, kind="stable")].astype(np.int32 if len(src) < 2**31 else np.int64)
        runs = itertools.pairwise([0, *np.cumsum(np.bincount(rank)).tolist()])  # equal ranks: equal lengths
        ties = [(a, b) for a, b in runs if b - a > 1]
        return _Pairs(src, tgt, by_length, ties, self._cuts(np.bincount(longest[kept])))

    def _cuts(self, pairs_of_length: np.ndarray) -> np.ndarray:
        """Where each batch ends along the pairs sorted by length (``pairs_of_length[L]`` of
        them have L as their longer side): the greedy cut, a batch taking pairs while
        B * longest fits max_tokens. The pairs ascend in length, so within the run of length
        L a batch holds max_tokens // L of them: the cuts come run by run, not pair by pair."""
        ends, start, first = [], 0, 0  # the batch in progress starts at start, the run at first
        for length in np.flatnonzero(pairs_of_length).tolist():
            after = first + int(pairs_of_length[length])
            fit = self.max_tokens // length
            end = max(first, start + fit)  # the batch in progress takes this run's pairs while they fit
            while end < after:
                ends.append(end)
                start, end = end, end + fit
            first = after
        ends.append(first)
        return np.array(ends)

    def _all_batches(self, epoch: int) -> list[np.ndarray]:
        """The batches of an epoch (all ranks together), as index arrays, in step order."""
        pairs = self._pairs
        if not self.shuffle:
            return np.split(pairs.by_length, pairs.cuts[:-1])
        rng = np.random.default_rng([self.seed, epoch])
        order = pairs.by_length.copy()
        # Pairs of equal lengths in a new order each epoch; the lengths, and so the cuts, stay.
        # One run at a time: each fits in cache, where one shuffle of all the pairs would not.
        for start, end in pairs.ties:
            rng.shuffle(order[start:end])
        batches = np.split(order, pairs.cuts[:-1])
        return [batches[j] for j in rng.permutation(len(batches))]

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's share of each step of an epoch: arrays of indices into the input
        sequences (empty where a step has fewer sentences than ranks)."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, [self._share(b) for b in self._all_batches(epoch)])
        return self._cached[1]

    def _share(self, batch: np.ndarray) -> np.ndarray:
        """This rank's slice of a step's batch, ``np.array_split(batch, world_size)[rank]``
        in a few integer operations (array_split takes 30 times as long: at WMT's size,
        0.1 s an epoch)."""
        size, extra = divmod(len(batch), self.world_size)  # the first `extra` ranks take one more
        start = self.rank * size + min(self.rank, extra)
        return batch[start:start + size + (self.rank < extra)]

    def steps_per_epoch(self, epoch: int) -> int:
        """How many steps this epoch has (the same on every rank and every epoch)."""
        return len(self.epoch_batches(epoch))

    def make_batch(self, indices: np.ndarray) -> Batch:
        """The padded ``Batch`` for these pair indices; no indices (an empty share of a step)
        give a batch of no rows."""
        pairs = self._pairs
        if len(indices) == 0:
            none = np.zeros((0, 0), dtype=np.int64)
            has_tgt = pairs.tgt is not None
            return Batch(none, none.astype(bool), none if has_tgt else None, none if has_tgt else None,
                         none.astype(bool) if has_tgt else None, np.asarray(indices, np.int64), 0, 0)
        src = [pairs.src[i] for i in indices]
        tgt = [pairs.tgt[i] for i in indices] if pairs.tgt is not None else None
        return collate(src, tgt, indices, self.start_id)

    def _batch_at(self, epoch: int, step: int) -> Batch:
        batch = self.make_batch(self.epoch_batches(epoch)[step])
        batch.epoch, batch.step = epoch, step
        return batch

    def iter_epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """This rank's batches of one epoch, from ``start_step`` on."""
        for step in range(start_step, self.steps_per_epoch(epoch)):
            yield self._batch_at(epoch, step)

    def __iter__(self) -> Iterator[Batch]:
        """Batches forever, epoch after epoch, starting at ``self.position``.

        ``position`` moves on as each batch is handed out, so ``state_dict()`` taken after
        training on a batch resumes with the batch after it.
        """
        while True:
            epoch, step = self.position
            if step >= self.steps_per_epoch(epoch):
                self.position = (epoch + 1, 0)
                continue
            self.position = (epoch, step + 1)
            yield self._batch_at(epoch, step)

    def state_dict(self) -> dict:
        """Where the stream stands, plus what must match for a resume to be exact."""
        epoch, step = self.position
        return {"epoch": epoch, "step": step, "seed": self.seed, "world_size": self.world_size,
                "num_pairs": self.num_pairs, "max_tokens": self.max_tokens,
                "max_len": self.max_len, "batching": BATCHING}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict()``; refuses one made with different settings, or whose
        position is not one (before anything is set: a refused state changes nothing)."""
        mine = self.state_dict()
        check_keys("TokenBatcher.load_state_dict", state, mine)
        differ = [f"{k}: saved {state.get(k)!r}, now {mine[k]!r}"
                  for k in ("seed", "world_size", "num_pairs", "max_tokens", "max_len", "batching")
                  if state.get(k) != mine[k]]
        if differ:
            raise ValueError("cannot resume batching with different settings: " + "; ".join(differ))
        for k in ("epoch", "step"):  # a step past the epoch's last starts the next epoch
            check_int("TokenBatcher.load_state_dict", k, state[k], low=0)
        self.position = (int(state["epoch"]), int(state["step"]))
