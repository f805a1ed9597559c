"""BPE-dropout: plain BPE at p = 0, the paper's Algorithm 1 in distribution, and the seed's draws alone."""

import collections
import json
import math
import random
import subprocess
import sys

import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from minitransformer.data import TokenizerConfig, load_or_train, train_tokenizer
from minitransformer.data.bpe_dropout import WORD_START, BPEDropout
from tests.helpers import pseudo_words


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(pseudo_words(300, 3), tmp_path_factory.mktemp("bpe") / "spm.model",
                           TokenizerConfig(vocab_size=100))


@pytest.fixture(scope="module")
def sp(tok):
    return spm.SentencePieceProcessor(model_file=str(tok.path))


# Letters in the vocabulary and some outside it (runs of those are one unknown id), spaces.
texts = st.lists(st.text(alphabet="abcdefgh  xyzÄ.", max_size=40), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(texts=texts, seed=st.integers(0, 2**32 - 1))
def test_without_dropout_it_is_sentencepieces_bpe(sp, texts, seed):
    assert BPEDropout(sp).encode(texts, 0.0, seed) == sp.encode(texts)


def test_without_dropout_it_is_sentencepieces_bpe_on_multi30k(sample_pairs, tmp_path):
    """Real text in both languages: umlauts, digits, punctuation, rare characters."""
    tok = load_or_train(sample_pairs, tmp_path, TokenizerConfig(vocab_size=400))
    texts = sample_pairs.src + sample_pairs.tgt
    sp = spm.SentencePieceProcessor(model_file=str(tok.path))
    assert BPEDropout(sp).encode(texts, 0.0, seed=0) == sp.encode(texts)


def algorithm_1(sp, word, p, rng):
    """The paper's Algorithm 1 as written: every merge possible at a step is removed with
    probability p; the best one left is applied; the word is done when none is left."""
    split = list(word)
    while True:
        merges = []
        for i in range(len(split) - 1):
            piece = sp.piece_to_id(split[i] + split[i + 1])
            if piece != sp.unk_id() and rng.random() >= p:
                merges.append((sp.get_score(piece), -i))
        if not merges:
            return tuple(split)
        i = -max(merges)[1]
        split[i:i + 2] = [split[i] + split[i + 1]]


@pytest.mark.parametrize("p", [0.1, 0.4])
def test_one_geometric_draw_a_step_samples_as_algorithm_1(sp, p):
    """The same word sampled n times each way: every segmentation's frequency agrees within
    5 standard errors of a difference of two frequencies (plus 1/n for the rare ones)."""
    n = 20_000
    word = max(pseudo_words(50, 9)[0].split(), key=len)  # a long word: many paths
    ours = collections.Counter(tuple(sp.id_to_piece(i) for i in ids)
                               for ids in BPEDropout(sp).encode([word] * n, p, seed=1))
    rng = random.Random(2)
    paper = collections.Counter(algorithm_1(sp, WORD_START + word, p, rng) for _ in range(n))
    assert len(paper) > 5  # the draw matters for this word
    for split in set(ours) | set(paper):
        f, g = ours[split] / n, paper[split] / n
        mean = (f + g) / 2
        assert abs(f - g) <= 5 * math.sqrt(2 * mean * (1 - mean) / n) + 1 / n, (split, f, g)


def test_the_draws_are_the_seeds_alone_in_any_process(tok):
    """Another process, seeded alike, samples the same segmentation: what every rank of a run,
    and a resumed run, rely on. (sentencepiece's own sampler fails this.)"""
    sentences = pseudo_words(200, 5)
    here = tok.encode(sentences, dropout=0.1, seed=11)
    code = ("import json, sys; from minitransformer.data import Tokenizer; "
            "print(json.dumps(Tokenizer(sys.argv[1]).encode(json.loads(sys.argv[2]), dropout=0.1, seed=11)))")
    there = subprocess.run([sys.executable, "-c", code, str(tok.path), json.dumps(sentences)],
                           capture_output=True, text=True, check=True).stdout
    assert json.loads(there) == here
    assert here != tok.encode(sentences) and here != tok.encode(sentences, dropout=0.1, seed=12)


def test_p_must_lie_below_one(sp):
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        BPEDropout(sp).encode(["abc"], 1.0, seed=0)
