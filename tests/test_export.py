"""minitransformer.export: a model written into CTranslate2 decodes as ours does (a tiny model:
what is checked is the mapping of every weight and decoding option, not translation quality)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from minitransformer import data, export
from minitransformer.decoding import beam_search, greedy_decode
from minitransformer.functional.softmax import log_softmax_array
from tests.helpers import sentences, tiny_run

pytest.importorskip("ctranslate2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from export_ctranslate2 import same_length_batches  # noqa: E402
from translate import load_model  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tiny_run(tmp_path_factory.mktemp("run"), seed=3)
    tok = data.Tokenizer(next(folder.glob("*.model")))
    model = load_model(str(folder / "averaged.npz"), "cpu", tokenizer=tok)
    translator = export.load_translator(export.to_ctranslate2(model, tok, str(folder / "ct2")), threads=1)
    src = tok.encode(sentences(40, seed=4))
    return model, tok, export.Pieces(tok), translator, src


def test_teacher_forced_log_probabilities_agree(exported):
    model, tok, pieces, translator, src = exported
    tgt = [ids[::-1] for ids in src]  # any target will do
    batch = data.collate(src, tgt)
    ours = log_softmax_array(model(batch.src, batch.tgt_in).numpy())
    theirs = export.ctranslate2_log_probs(translator, pieces, src, tgt)
    for row, (ids, t) in enumerate(zip(tgt, theirs)):
        np.testing.assert_allclose(t, ours[row, np.arange(len(ids) + 1), ids + [data.EOS_ID]], atol=2e-5)


def test_greedy_and_beam_search_agree(exported):
    model, tok, pieces, translator, src = exported
    for idx in same_length_batches(src, 16):
        batch = [src[i] for i in idx]
        padded = data.collate(batch).src
        assert export.ctranslate2_translate(translator, pieces, batch, beam_size=1) == greedy_decode(model, padded)
        ours = beam_search(model, padded, 4, 0.6, return_scores=True)
        theirs = export.ctranslate2_beam_search(translator, pieces, batch, 4, 0.6)
        assert [h for h, _ in theirs] == [h for h, _ in ours]
        np.testing.assert_allclose([s for _, s in theirs], [s for _, s in ours], rtol=1e-4)


@pytest.fixture(scope="module")
def eos_prone(tmp_path_factory):
    """The tiny model with EOS's embedding scaled up: its hypotheses end at all lengths, so that
    which search stops when decides the answer (the plain one runs most to the length limit)."""
    folder = tiny_run(tmp_path_factory.mktemp("run"), seed=0)
    tok = data.Tokenizer(next(folder.glob("*.model")))
    model = load_model(str(folder / "averaged.npz"), "cpu", tokenizer=tok)
    model.src_embed.weight.data[data.EOS_ID] *= 7
    translator = export.load_translator(export.to_ctranslate2(model, tok, str(folder / "ct2")), threads=1)
    src = [ids for ids in tok.encode(sentences(300, seed=4)) if len(ids) <= 20][:100]
    return model, export.Pieces(tok), translator, src


@pytest.mark.parametrize("beam, alpha", [(4, 0.6), (8, 2.0)])
def test_beam_searches_stop_alike(eos_prone, beam, alpha):
    """CTranslate2 asked for raw scores stops a sentence as ours does (with length_penalty=0 it
    would go on until its best beam ends: export._RAW). They still differ where a hypothesis is
    cut at the length limit, which CTranslate2 ranks without its EOS: those sentences are left
    out, and most are not."""
    model, pieces, translator, src = eos_prone
    compared = 0
    for idx in same_length_batches(src, 16):
        batch = [src[i] for i in idx]
        ours = beam_search(model, data.collate(batch).src, beam, alpha, return_scores=True)
        theirs = export.ctranslate2_beam_search(translator, pieces, batch, beam, alpha)
        all_theirs = translator.translate_batch(pieces.to_pieces(batch), num_hypotheses=beam,
                                                **export.decode_options(batch, beam))
        limit = export.decode_options(batch, beam)["max_decoding_length"]
        for (o, o_score), (t, t_score), r in zip(ours, theirs, all_theirs):
            if max(map(len, r.hypotheses)) < limit:
                compared += 1
                assert o == t and o_score == pytest.approx(t_score, rel=1e-4, abs=1e-5)
    assert compared >= 80, compared


def test_int8_export_translates(exported, tmp_path):
    model, tok, pieces, _, src = exported
    int8 = export.load_translator(export.to_ctranslate2(model, tok, str(tmp_path / "int8"), "int8"), threads=1)
    hyps = export.ctranslate2_translate(int8, pieces, src[:5])
    assert len(hyps) == 5 and all(set(h) <= set(range(tok.vocab_size)) - {data.PAD_ID, data.BOS_ID} for h in hyps)


def test_only_the_papers_model_is_exported(exported, tmp_path, monkeypatch):
    model, tok, *_ = exported
    monkeypatch.setattr(model.config, "norm_first", True)
    with pytest.raises(ValueError, match="post-norm"):
        export.to_ctranslate2(model, tok, str(tmp_path))


def test_a_model_that_starts_from_eos_is_exported_with_its_start(exported, tmp_path):
    """decoder_start="eos": CTranslate2's decoder starts from </s> too (decoder_start_token), so
    that teacher-forced scores and greedy search agree with ours, which read EOS first."""
    from minitransformer import nn

    model, tok, pieces, _, src = exported
    eos_model = nn.Transformer(nn.TransformerConfig(**{**model.config.to_dict(), "decoder_start": "eos"})).eval()
    eos_model.load_state_dict(model.state_dict())
    translator = export.load_translator(export.to_ctranslate2(eos_model, tok, str(tmp_path / "eos")), threads=1)
    tgt = [ids[::-1] for ids in src[:16]]
    batch = data.collate(src[:16], tgt, start_id=data.EOS_ID)
    ours = log_softmax_array(eos_model(batch.src, batch.tgt_in).numpy())
    for row, (ids, t) in enumerate(zip(tgt, export.ctranslate2_log_probs(translator, pieces, src[:16], tgt))):
        np.testing.assert_allclose(t, ours[row, np.arange(len(ids) + 1), ids + [data.EOS_ID]], atol=2e-5)
    differ = 0
    for idx in same_length_batches(src, 16):
        batch = [src[i] for i in idx]
        greedy = greedy_decode(eos_model, data.collate(batch).src)
        assert export.ctranslate2_translate(translator, pieces, batch, beam_size=1) == greedy
        differ += sum(a != b for a, b in zip(greedy, greedy_decode(model, data.collate(batch).src)))
    assert differ >= len(src) // 4  # the start token matters to what the model writes
