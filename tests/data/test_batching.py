import itertools
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minitransformer.data import (
    BOS_ID, EOS_ID, PAD_ID, PackedSequences, TokenBatcher, TokenizerConfig, collate,
    encode_packed, load_or_train,
)


def random_pairs(rng, n, max_len=30, vocab=1000):
    lengths = rng.integers(0, max_len, size=(n, 2))
    src = [rng.integers(EOS_ID + 1, vocab, size=a).tolist() for a, _ in lengths]
    tgt = [rng.integers(EOS_ID + 1, vocab, size=b).tolist() for _, b in lengths]
    return src, tgt


def check_batch(batch, src, tgt, max_tokens):
    """Every field of a batch, checked against the sequences it was built from."""
    B, S = batch.src.shape
    T = batch.tgt_in.shape[1]
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == np.int64
    assert batch.src_mask.dtype == batch.tgt_mask.dtype == np.bool_
    assert batch.tgt_out.shape == batch.tgt_mask.shape == (B, T) and batch.src_mask.shape == (B, S)
    assert B * S <= max_tokens and B * T <= max_tokens
    for b, i in enumerate(batch.indices):
        x, y = src[i], tgt[i]
        assert batch.src[b].tolist() == x + [EOS_ID] + [PAD_ID] * (S - len(x) - 1)
        assert batch.tgt_in[b].tolist() == [BOS_ID] + y + [PAD_ID] * (T - len(y) - 1)
        assert batch.tgt_out[b].tolist() == y + [EOS_ID] + [PAD_ID] * (T - len(y) - 1)
        assert batch.src_mask[b].tolist() == [True] * (len(x) + 1) + [False] * (S - len(x) - 1)
        assert batch.tgt_mask[b].tolist() == [True] * (len(y) + 1) + [False] * (T - len(y) - 1)
    assert batch.num_src_tokens == sum(len(src[i]) + 1 for i in batch.indices)
    assert batch.num_tgt_tokens == sum(len(tgt[i]) + 1 for i in batch.indices)
    assert S == max(len(src[i]) for i in batch.indices) + 1  # padded to its own longest row
    assert T == max(len(tgt[i]) for i in batch.indices) + 1


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 80), max_len=st.integers(1, 40),
       slack=st.integers(0, 150), epoch=st.integers(0, 5))
def test_an_epoch_covers_every_pair_once_within_budget(seed, n, max_len, slack, epoch):
    rng = np.random.default_rng(seed)
    src, tgt = random_pairs(rng, n, max_len)
    max_tokens = max_len + slack  # any pair (at most max_len tokens) fits on its own
    batcher = TokenBatcher(src, tgt, max_tokens=max_tokens, seed=seed)
    batches = list(batcher.iter_epoch(epoch))
    assert len(batches) == batcher.steps_per_epoch(epoch)
    seen = np.concatenate([b.indices for b in batches])
    assert sorted(seen.tolist()) == list(range(n))
    for batch in batches:
        check_batch(batch, src, tgt, max_tokens)
        assert batch.epoch == epoch


def plain_plan(src_len, tgt_len, max_tokens, max_len, seed, epoch, shuffle=True):
    """The epoch's batches as the module docstring states them: the pairs within max_len
    sorted stably by (longer side, source, target) with np.lexsort, each run of equal lengths
    shuffled in turn, cut pair by pair where the next one would take B * longest over
    max_tokens, the batches shuffled."""
    src_len, tgt_len = src_len + 1, tgt_len + 1  # EOS, BOS
    longest = np.maximum(src_len, tgt_len)
    kept = np.flatnonzero(longest <= max_len) if max_len is not None else np.arange(len(src_len))
    order = kept[np.lexsort((tgt_len[kept], src_len[kept], longest[kept]))]
    rng = np.random.default_rng([seed, epoch])
    key = list(zip(longest[order], src_len[order], tgt_len[order]))
    start = 0
    for k in range(1, len(order) + 1):
        if k == len(order) or key[k] != key[start]:
            if shuffle and k - start > 1:
                rng.shuffle(order[start:k])
            start = k
    batches, start, widest = [], 0, 0
    for k, i in enumerate(order):
        widest = max(widest, longest[i])
        if (k + 1 - start) * widest > max_tokens:
            batches.append(order[start:k])
            start, widest = k, longest[i]
    batches.append(order[start:])
    return [batches[j] for j in rng.permutation(len(batches))] if shuffle else batches


def packed_of_lengths(lengths):
    return PackedSequences(np.zeros(int(lengths.sum()), np.int32), np.concatenate([[0], np.cumsum(lengths)]))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 400), longest=st.sampled_from([3, 40, 300, 70_000]),
       slack=st.integers(0, 5), with_max_len=st.booleans(), shuffle=st.booleans(), epoch=st.integers(0, 3))
def test_the_plan_is_its_plain_formulation(seed, n, longest, slack, with_max_len, shuffle, epoch):
    # The batcher ranks the lengths through a table, sorts by radix and cuts run by run of
    # equal lengths; the plain formulation sorts with lexsort and visits every pair.
    # Lengths past 1,024 take the batcher's other ranking; many equal lengths test the
    # shuffle of ties.
    rng = np.random.default_rng(seed)
    src_len, tgt_len = rng.integers(0, longest, size=(2, n))
    max_tokens = (longest + 1) * (1 + slack)
    max_len = int(rng.integers(1, longest + 2)) if with_max_len else None
    if max_len is not None and np.all(np.maximum(src_len, tgt_len) + 1 > max_len):
        max_len = longest + 1
    batcher = TokenBatcher(packed_of_lengths(src_len), packed_of_lengths(tgt_len), max_tokens=max_tokens,
                           max_len=max_len, shuffle=shuffle, seed=seed)
    expected = plain_plan(src_len, tgt_len, max_tokens, max_len, seed, epoch, shuffle)
    got = batcher.epoch_batches(epoch)
    assert [b.tolist() for b in got] == [b.tolist() for b in expected]


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_plan_is_its_plain_formulation_past_2_16_distinct_lengths(shuffle):
    # More than 2^16 distinct (S, T): the ranks no longer fit a uint16, and sort another way;
    # lengths past 1,024 with many equal S take the other ranking.
    rng = np.random.default_rng(5)
    src_len, tgt_len = rng.integers(0, 1500, size=(2, 90_000))
    assert len(set(zip(src_len.tolist(), tgt_len.tolist()))) > 2**16
    batcher = TokenBatcher(packed_of_lengths(src_len), packed_of_lengths(tgt_len), max_tokens=3000,
                           shuffle=shuffle, seed=5)
    expected = plain_plan(src_len, tgt_len, 3000, None, 5, 2, shuffle)
    assert [b.tolist() for b in batcher.epoch_batches(2)] == [b.tolist() for b in expected]


def test_similar_lengths_are_bucketed_together():
    rng = np.random.default_rng()
    # Translations: target lengths follow source lengths, give or take a few tokens.
    n = 3000
    src_len = rng.integers(1, 60, size=n)
    tgt_len = np.clip(src_len + rng.integers(-4, 5, size=n), 0, None)
    src = [[7] * k for k in src_len]
    tgt = [[8] * k for k in tgt_len]
    batcher = TokenBatcher(src, tgt, max_tokens=1000, seed=int(rng.integers(1 << 30)))
    batches = list(batcher.iter_epoch(0))
    sizes = np.cumsum([0] + [len(b) for b in batches])
    perm = rng.permutation(n)
    for side, lengths in (("src", src_len), ("tgt_in", tgt_len)):
        real = sum(lengths[b.indices].sum() + len(b) for b in batches)
        padded = sum(getattr(b, side).size for b in batches)
        # The same batch sizes filled at random would pad heavily (lengths uniform in 1..59).
        random_padded = sum((b - a) * (lengths[perm[a:b]].max() + 1)
                            for a, b in itertools.pairwise(sizes))
        assert padded - real < 0.25 * (random_padded - real), side
        assert padded < 1.1 * real, side
    # Most batches fill the budget closely (the longer side of each decides).
    fill = [len(b) * max(b.src.shape[1], b.tgt_in.shape[1]) / 1000 for b in batches]
    assert np.median(fill) > 0.9


def test_order_is_deterministic_per_seed_and_epoch_and_reshuffled_each_epoch():
    rng = np.random.default_rng()
    src, tgt = random_pairs(rng, 500)
    seed = int(rng.integers(1 << 30))

    def epoch(batcher, e):
        return [b.tolist() for b in batcher.epoch_batches(e)]

    a = TokenBatcher(src, tgt, max_tokens=300, seed=seed)
    b = TokenBatcher(src, tgt, max_tokens=300, seed=seed)
    assert epoch(a, 0) == epoch(b, 0) and epoch(a, 3) == epoch(b, 3)
    assert epoch(a, 0) != epoch(a, 1)  # new batch order and new batch contents
    assert {tuple(x) for x in epoch(a, 0)} != {tuple(x) for x in epoch(a, 1)}
    assert epoch(a, 0) != epoch(TokenBatcher(src, tgt, max_tokens=300, seed=seed + 1), 0)
    fixed = TokenBatcher(src, tgt, max_tokens=300, shuffle=False)
    assert epoch(fixed, 0) == epoch(fixed, 1)
    order = np.concatenate(fixed.epoch_batches(0))
    longest = [max(len(src[i]), len(tgt[i])) for i in order]
    assert longest == sorted(longest)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_the_ranks_split_each_step_of_one_process(world_size):
    """Every step is one process's batch, cut into the ranks' shares: the same steps at any
    number of ranks, each sentence on exactly one rank, the shares contiguous runs of the
    length-sorted batch (so of similar lengths), and rank 0's never empty."""
    rng = np.random.default_rng()
    src, tgt = random_pairs(rng, int(rng.integers(50, 400)))
    seed, epoch = int(rng.integers(1 << 30)), int(rng.integers(0, 10))
    max_tokens = int(rng.integers(60, 400))
    single = TokenBatcher(src, tgt, max_tokens=max_tokens, seed=seed)
    ranks = [TokenBatcher(src, tgt, max_tokens=max_tokens, seed=seed, rank=r, world_size=world_size)
             for r in range(world_size)]
    assert {r.steps_per_epoch(epoch) for r in ranks} == {single.steps_per_epoch(epoch)}
    for step, whole in enumerate(single.epoch_batches(epoch)):
        shares = [r.epoch_batches(epoch)[step] for r in ranks]
        assert np.concatenate(shares).tolist() == whole.tolist()
        sizes = [len(s) for s in shares]
        assert sizes[0] >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    for r in ranks:  # a share pads to its own longest row, within the step's budget
        for batch in r.iter_epoch(epoch):
            assert batch.src.size <= max_tokens and batch.tgt_in.size <= max_tokens


def test_an_empty_share_is_a_batch_of_no_rows():
    src, tgt = [[5, 6, 7]] * 2, [[8, 9]] * 2  # one step of two sentences, three ranks
    last = TokenBatcher(src, tgt, max_tokens=100, rank=2, world_size=3)
    (batch,) = list(last.iter_epoch(0))
    assert len(batch) == 0 and batch.num_tgt_tokens == 0 and batch.src.shape == (0, 0)
    assert len(next(iter(TokenBatcher(src, tgt, max_tokens=100, rank=0, world_size=3)))) == 1


def test_resume_from_state_dict_continues_exactly():
    rng = np.random.default_rng()
    src, tgt = random_pairs(rng, 120)
    seed = int(rng.integers(1 << 30))
    kwargs = dict(max_tokens=200, max_len=25, seed=seed, rank=1, world_size=2)
    original = TokenBatcher(src, tgt, **kwargs)
    per_epoch = original.steps_per_epoch(0)
    stream = iter(original)
    k = per_epoch + int(rng.integers(1, per_epoch))  # stop inside the second epoch
    for _ in range(k):
        next(stream)
    state = original.state_dict()
    assert (state["epoch"], state["step"]) == (1, k - per_epoch)
    expected = [next(stream) for _ in range(2 * per_epoch)]  # runs on into the third epoch

    resumed = TokenBatcher(src, tgt, **kwargs)
    resumed.load_state_dict(state)
    got = [b for b, _ in zip(resumed, range(len(expected)))]
    for e, g in zip(expected, got):
        assert (e.epoch, e.step) == (g.epoch, g.step)
        assert np.array_equal(e.indices, g.indices) and np.array_equal(e.tgt_out, g.tgt_out)
    positions, (epoch, step) = [], (1, state["step"])
    while len(positions) < len(got):  # epochs may differ in length by a step or two
        if step == resumed.steps_per_epoch(epoch):
            epoch, step = epoch + 1, 0
        positions.append((epoch, step))
        step += 1
    assert [(b.epoch, b.step) for b in got] == positions

    other = TokenBatcher(src, tgt, **{**kwargs, "world_size": 4})
    with pytest.raises(ValueError, match="world_size: saved 2, now 4"):
        other.load_state_dict(state)


def test_over_long_pairs_are_dropped_and_logged(caplog):
    rng = np.random.default_rng()
    src, tgt = random_pairs(rng, 300, max_len=50)
    max_len = int(rng.integers(10, 40))
    too_long = {i for i in range(300) if max(len(src[i]), len(tgt[i])) + 1 > max_len}
    with caplog.at_level(logging.WARNING, logger="minitransformer.data.batching"):
        batcher = TokenBatcher(src, tgt, max_tokens=400, max_len=max_len)
    assert batcher.num_dropped == len(too_long) > 0
    assert f"dropped {len(too_long)} of 300" in caplog.text and f"max_len={max_len}" in caplog.text
    seen = set(np.concatenate(batcher.epoch_batches(0)).tolist())
    assert seen == set(range(300)) - too_long


def test_a_pair_that_cannot_fit_is_an_error_without_max_len():
    src = [[5] * 10, [6] * 50, [7] * 3]
    tgt = [[5] * 10, [6] * 3, [7] * 3]
    with pytest.raises(ValueError, match=r"pair 1 \(51 source, 4 target tokens\)"):
        TokenBatcher(src, tgt, max_tokens=40)
    with pytest.raises(ValueError, match="max_len"):
        TokenBatcher(src, tgt, max_tokens=40, max_len=41)
    with pytest.raises(ValueError, match="rank 2"):
        TokenBatcher(src, tgt, max_tokens=60, rank=2, world_size=2)
    with pytest.raises(ValueError, match="3 source and 2 target"):
        TokenBatcher(src, tgt[:2], max_tokens=60)


def test_source_only_batches_for_translation():
    rng = np.random.default_rng()
    src, _ = random_pairs(rng, 57)
    batcher = TokenBatcher(src, None, max_tokens=120, shuffle=False)
    batches = list(batcher.iter_epoch(0))
    assert all(b.tgt_in is None and b.tgt_out is None and b.tgt_mask is None for b in batches)
    restored = [None] * 57
    for b in batches:
        for row, i in enumerate(b.indices):
            restored[i] = b.src[row, : b.src_mask[row].sum() - 1].tolist()
    assert restored == src
    one = collate([src[0], src[1]])
    assert one.src.shape == (2, max(len(src[0]), len(src[1])) + 1) and one.tgt_in is None


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        collate([])
    with pytest.raises(ValueError, match="2 source and 1 target"):
        collate([[4], [5]], [[6]])


def test_batches_of_real_tokenized_pairs(sample_pairs, tmp_path):
    tok = load_or_train(sample_pairs, tmp_path, TokenizerConfig(vocab_size=400))
    src, tgt = tok.encode(sample_pairs.src), tok.encode(sample_pairs.tgt)
    batcher = TokenBatcher(src, tgt, max_tokens=500, max_len=100, seed=3)
    for batch in batcher.iter_epoch(0):
        check_batch(batch, src, tgt, 500)
        texts = tok.decode(batch.tgt_out)
        assert texts == [" ".join(sample_pairs.tgt[i].split()) for i in batch.indices]


def test_packed_encoding_matches_lists(sample_pairs, tmp_path):
    tok = load_or_train(sample_pairs, tmp_path, TokenizerConfig(vocab_size=400))
    lists = tok.encode(sample_pairs.src)
    packed = encode_packed(tok, sample_pairs.src, chunk_size=37)  # many uneven chunks
    assert len(packed) == len(lists)
    assert all(packed[i].tolist() == lists[i] for i in range(len(lists)))
    tgt = encode_packed(tok, sample_pairs.tgt, chunk_size=1000)
    a = TokenBatcher(packed, tgt, max_tokens=300, seed=9)
    b = TokenBatcher(lists, tok.encode(sample_pairs.tgt), max_tokens=300, seed=9)
    assert all(np.array_equal(x, y) for x, y in zip(a.epoch_batches(2), b.epoch_batches(2)))
    assert len(encode_packed(tok, [])) == 0
    with pytest.raises(ValueError, match="offsets"):
        PackedSequences(np.zeros(5, np.int32), np.array([0, 2, 4]))


def test_tgt_in_starts_with_the_model_s_start_token():
    """start_id=EOS_ID (fairseq's decoder start): tgt_in begins with EOS instead of BOS, and
    nothing else in the batch changes; the batcher passes it to every batch."""
    src, tgt = random_pairs(np.random.default_rng(4), 30)
    batcher = TokenBatcher(src, tgt, max_tokens=200, seed=1, start_id=EOS_ID)
    for indices in batcher.epoch_batches(0):
        batch, bos = batcher.make_batch(indices), collate([src[i] for i in indices], [tgt[i] for i in indices],
                                                          indices)
        assert (batch.tgt_in[:, 0] == EOS_ID).all() and (bos.tgt_in[:, 0] == BOS_ID).all()
        np.testing.assert_array_equal(batch.tgt_in[:, 1:], bos.tgt_in[:, 1:])
        for name in ("src", "src_mask", "tgt_out", "tgt_mask"):
            np.testing.assert_array_equal(getattr(batch, name), getattr(bos, name))
