import io
import signal

import numpy as np
import pytest
import sentencepiece as spm

from minitransformer import cli
from minitransformer.data import (
    BOS_ID, EOS_ID, PAD_ID, PRESETS, UNK_ID, CorpusError, ParallelCorpus, SubwordNmtConfig, SubwordNmtTokenizer,
    Tokenizer, TokenizerConfig, TokenizerError, load_or_train, moses, open_tokenizer, train_tokenizer,
)
from minitransformer.data import tokenizer as tokenizer_module

SMALL = TokenizerConfig(vocab_size=400)


@pytest.fixture(scope="module")
def tok(sample_pairs, tmp_path_factory):
    return load_or_train(sample_pairs, tmp_path_factory.mktemp("tok"), SMALL)


def test_special_ids_are_fixed(tok):
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tok.vocab_size == SMALL.vocab_size
    assert PRESETS["wmt14"].vocab_size == 37000  # the paper's shared vocabulary


def test_round_trip_is_exact_detokenization(tok, sample_pairs):
    texts = sample_pairs.src + sample_pairs.tgt
    ids = tok.encode(texts)
    assert all(min(row) > EOS_ID for row in ids)  # pieces only: no specials, no unknowns
    # sentencepiece's NFKC normalization collapses runs of spaces; nothing else changes.
    assert tok.decode(ids) == [" ".join(t.split()) for t in texts]


def test_one_vocabulary_serves_both_languages(tok, sample_pairs):
    en, de = tok.encode(sample_pairs.src), tok.encode(sample_pairs.tgt)
    en_ids, de_ids = {i for r in en for i in r}, {i for r in de for i in r}
    assert en_ids & de_ids  # shared pieces (names, punctuation, "a", ...)
    assert en_ids - de_ids and de_ids - en_ids  # and pieces only one language uses
    assert max(en_ids | de_ids) < tok.vocab_size


def test_encode_batch_matches_one_at_a_time(tok, sample_pairs):
    texts = sample_pairs.tgt[:20]
    assert tok.encode(texts) == [tok.encode([t])[0] for t in texts]
    with pytest.raises(TypeError, match="batch"):
        tok.encode("a single string")


def test_decode_cuts_at_eos_and_drops_pad_and_bos(tok, sample_pairs):
    rng = np.random.default_rng()
    texts = sample_pairs.tgt[:8]
    rows = tok.encode(texts)
    width = max(len(r) for r in rows) + 6
    out = np.full((len(rows), width), PAD_ID, dtype=np.int64)  # as beam search returns them
    for b, r in enumerate(rows):
        out[b, 0] = BOS_ID
        out[b, 1:1 + len(r)] = r
        out[b, 1 + len(r)] = EOS_ID
        tail = rng.integers(EOS_ID + 1, tok.vocab_size, size=width - len(r) - 2)
        out[b, 2 + len(r):] = tail  # whatever follows EOS is not part of the sentence
    assert tok.decode(out) == [" ".join(t.split()) for t in texts]
    assert tok.decode([[BOS_ID, EOS_ID]]) == [""]


def test_unseen_characters_become_unk(tok):
    ids = tok.encode(["ሰላም ሰላም"])[0]  # Ge'ez script: not in Multi30k
    assert UNK_ID in ids


def test_cache_reuses_then_retrains_on_changed_settings(sample_pairs, tmp_path, monkeypatch):
    first = load_or_train(sample_pairs, tmp_path, SMALL)
    assert first.path.parent == tmp_path and (first.path.with_suffix(".json")).is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been used")

    with monkeypatch.context() as m:
        m.setattr(spm.SentencePieceTrainer, "train", no_training)
        again = load_or_train(sample_pairs, tmp_path, SMALL)
    assert again.path == first.path

    bigger = load_or_train(sample_pairs, tmp_path, TokenizerConfig(vocab_size=450))
    assert bigger.path != first.path and bigger.vocab_size == 450
    coverage = load_or_train(sample_pairs, tmp_path,
                             TokenizerConfig(vocab_size=400, character_coverage=0.9999))
    assert coverage.path not in (first.path, bigger.path)
    changed = ParallelCorpus(sample_pairs.src[:-1] + ["A different last sentence."],
                             sample_pairs.tgt, sample_pairs.src_paths, sample_pairs.tgt_paths)
    assert load_or_train(changed, tmp_path, SMALL).path not in (first.path, bigger.path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_cache_beside_data_or_in_user_cache(sample_pairs, tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    corpus = ParallelCorpus(sample_pairs.src, sample_pairs.tgt,
                            (data_dir / "train.en",), (data_dir / "train.de",))
    assert load_or_train(corpus, config=SMALL).path.parent == data_dir
    # A read-only data directory (the shared copy): fall back to $XDG_CACHE_HOME.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_module.os, "access", lambda path, mode: False)
    fallback = load_or_train(corpus, config=SMALL).path.parent
    assert fallback == tmp_path / "cache" / "minitransformer" / "tokenizers"


def test_foreign_model_with_other_special_ids_is_refused(sample_pairs, tmp_path):
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sample_pairs.src), model_writer=proto,
                                   vocab_size=200, model_type="bpe", minloglevel=2)
    path = tmp_path / "foreign.model"
    path.write_bytes(proto.getvalue())  # sentencepiece's defaults: unk 0, bos 1, eos 2, no pad
    with pytest.raises(TokenizerError, match="special ids") as err:
        Tokenizer(path)
    assert str(path) in str(err.value)
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a sentencepiece model") as err:
        Tokenizer(junk)
    assert isinstance(err.value, CorpusError) and "\n" not in str(err.value)  # every program's one line
    damaged = tmp_path / "damaged.model"  # a cached model cut short
    damaged.write_bytes(path.read_bytes()[:300])
    with pytest.raises(TokenizerError, match="damaged.model (is not a sentencepiece model|has special ids)"):
        Tokenizer(damaged)
    with pytest.raises(FileNotFoundError, match="absent.model"):
        Tokenizer(tmp_path / "absent.model")


def test_vocabulary_too_large_for_the_text(tmp_path):
    with pytest.raises(CorpusError, match="5000-piece") as err:  # a user error: one line (cli.run)
        train_tokenizer(["a tiny corpus", "with few characters"], tmp_path / "x.model",
                        TokenizerConfig(vocab_size=5000))
    assert "2 sentences" in str(err.value) and "Please set it to a value <=" in str(err.value)
    assert "\n" not in str(err.value) and ".cc(" not in str(err.value)  # not sentencepiece's source line
    assert not (tmp_path / "x.model").exists()
    with pytest.raises(ValueError, match="vocab_size"):
        TokenizerConfig(vocab_size=4)


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), cli.Terminated(signal.SIGTERM), CorpusError("line 7: bad")])
def test_what_stops_the_reading_inside_sentencepiece_is_raised_as_it_was(tmp_path, stop):
    """sentencepiece wraps an exception of the iterator it reads ("INTERNAL: KeyboardInterrupt"
    for Ctrl-C): the original comes out, so that an interrupt ends in its one line and 130."""
    def sentences():
        for i in range(500):
            if i == 300:
                raise stop
            yield f"sentence number {i}"

    with pytest.raises(type(stop)) as e:
        train_tokenizer(sentences(), tmp_path / "x.model", TokenizerConfig(vocab_size=30))
    assert e.value is stop and not (tmp_path / "x.model").exists()


NMT = SubwordNmtConfig(merges=300)


@pytest.fixture(scope="module")
def nmt_text(sample_pairs):
    """The sample as the literature's BPE reads it: lowercased Moses tokens."""
    return moses.preprocess_corpus(sample_pairs, "moses-lc")


@pytest.fixture(scope="module")
def nmt(nmt_text, tmp_path_factory):
    return load_or_train(nmt_text, tmp_path_factory.mktemp("nmt"), NMT)


def test_subword_nmt_round_trip_joins_its_pieces(nmt, nmt_text):
    texts = nmt_text.src[:50] + nmt_text.tgt[:50]
    ids = nmt.encode(texts)
    assert all(min(row) > EOS_ID for row in ids)  # its own training text: no specials, no unknowns
    assert nmt.decode(ids) == [" ".join(t.split()) for t in texts]
    for text in texts[:10]:  # every piece but a word's last ends in "@@"
        pieces = nmt.pieces(text)
        assert sum(not p.endswith("@@") for p in pieces) == len(text.split())
        assert " ".join(pieces).replace("@@ ", "") == " ".join(text.split())
    assert nmt.id_to_piece([PAD_ID, UNK_ID, BOS_ID, EOS_ID]) == ["<pad>", "<unk>", "<s>", "</s>"]
    row = [BOS_ID] + ids[0] + [EOS_ID] + ids[1]  # cut at EOS, BOS dropped, as sentencepiece's
    assert nmt.decode([row]) == [" ".join(texts[0].split())]


def test_subword_nmt_vocabulary_is_its_segmented_text_most_frequent_first(nmt, nmt_text):
    counts = {}
    for text in nmt_text.src + nmt_text.tgt:
        for piece in nmt.pieces(text):
            counts[piece] = counts.get(piece, 0) + 1
    assert nmt.vocab_size == 4 + len(counts)
    pieces = nmt.id_to_piece(range(4, nmt.vocab_size))
    assert [counts[p] for p in pieces] == sorted(counts.values(), reverse=True)
    again = open_tokenizer(nmt.path)  # the cached file, opened by its suffix
    assert again.kind == "subword-nmt" and again.encode(nmt_text.src[:5]) == nmt.encode(nmt_text.src[:5])
    assert load_or_train(nmt_text, nmt.path.parent, NMT).path == nmt.path  # found, not learnt anew


def test_subword_nmt_unknown_characters_and_damaged_files(nmt, tmp_path):
    ids = nmt.encode(["ሰላም ሰላም"])[0]
    assert UNK_ID in ids and nmt.knows_nothing_of(ids)
    for name, content in (("garbage.bpe", b"\x80\x81 not json"), ("list.bpe", b"[1, 2]"),
                          ("specials.bpe", b'{"format": "subword-nmt", "codes": "#version: 0.2\\n", '
                                           b'"vocab": ["a", "b", "c", "d", "e"]}'),
                          ("merges.bpe", b'{"format": "subword-nmt", "codes": "#version: 0.2\\na b c\\n", '
                                         b'"vocab": ["<pad>", "<unk>", "<s>", "</s>", "e"]}')):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(TokenizerError, match=name):
            SubwordNmtTokenizer(tmp_path / name)
