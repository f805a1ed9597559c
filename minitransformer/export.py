"""Export a trained model to CTranslate2, the inference engine translation Transformers are
deployed with (C++, CPU and GPU, int8 quantisation), and decode with it as the project does.

Our model maps onto CTranslate2's ``TransformerSpec`` (``pip install -e ".[export]"``):

    post-norm sublayers             pre_norm=False: LayerNorm(x + Sublayer(x)), no final norm
    one embedding matrix, 3 ways    the encoder's and decoder's embeddings and the output
                                    projection (no bias), embeddings scaled by sqrt(d_model)
    sinusoidal positions            our own table, written into the spec: CTranslate2's built-in
                                    one lays out all sines then all cosines, with another
                                    frequency formula, and starts at position 1
    W_Q, W_K, W_V (in, out)         transposed to (out, in); self-attention's three joined into
                                    one (3 d_model, d_model) projection, cross-attention's K, V
                                    into one (2 d_model, d_model)
    the tokenizer's pieces          the shared vocabulary, in id order (<pad> <unk> <s> </s> ...)
    EOS after every source          add_source_eos, as our batcher gives the encoder
    config.start_id                 decoder_start_token: <s>, or </s> for a model that starts
                                    from EOS (``TransformerConfig.decoder_start``)

Decoding must then be asked to behave as ``decoding.beam_search`` does (``decode_options``):
PAD and BOS are never emitted (suppressed), an empty hypothesis may finish at the first step
(minimum length 0, where CTranslate2's default is 1), and the output may be as long as the
source + 50 tokens, EOS included. CTranslate2's length penalty is score / L^alpha, not GNMT's
((5 + L) / 6)^alpha, so to compare beam search exactly ``ctranslate2_beam_search`` asks for
all finished hypotheses with raw log-probabilities and applies ours.

Both searches stop a sentence once it holds ``beam_size`` finished hypotheses, but CTranslate2
only when a length penalty is set: with ``length_penalty=0`` it goes on until the best live beam
itself ends, and may find longer, more probable hypotheses than ours. So raw log-probabilities
are asked for with a penalty too small to change a float32 score (``_RAW``), not with 0.
One difference remains, at the length limit: CTranslate2 chooses the hypotheses it cuts there
by their scores without EOS (``ctranslate2_beam_search`` adds it afterwards), ours forces EOS
and chooses with its log-probability.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from .data import EOS_ID
from .decoding import ALPHA, BEAM, MAX_LEN_EXTRA, length_penalty
from .files import naming
from .functional.softmax import log_softmax_array
from .nn.embedding import sinusoid_table


NEEDS = 'exporting needs CTranslate2: pip install -e ".[export]"'


def available() -> bool:
    """Whether CTranslate2 is installed (the ``[export]`` extra), found without importing it:
    a program checks before it reads or computes anything."""
    return importlib.util.find_spec("ctranslate2") is not None


def _ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise ImportError(NEEDS) from None
    return ctranslate2


def _array(tensor) -> np.ndarray:
    return np.array(tensor.numpy(), dtype=np.float32)  # a copy: quantising works in place


def _linear(spec, *linears) -> None:
    """One CTranslate2 linear layer from ours, joined along the outputs: weight (out, in)."""
    spec.weight = np.concatenate([_array(m.weight).T for m in linears])
    spec.bias = np.concatenate([_array(m.bias) for m in linears])


def _norm(spec, norm) -> None:
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def _ffn(spec, layer) -> None:
    _norm(spec.layer_norm, layer.sub3.norm if hasattr(layer, "sub3") else layer.sub2.norm)
    _linear(spec.linear_0, layer.ffn.w_1)
    _linear(spec.linear_1, layer.ffn.w_2)


def to_ctranslate2(model, tokenizer, output_dir: str, quantization: str | None = None) -> str:
    """Write ``model`` (post-norm, shared embeddings, sinusoidal positions) with ``tokenizer``'s
    vocabulary as a CTranslate2 model in ``output_dir``; ``quantization`` is CTranslate2's
    weight type ("int8", "int8_float32", "int16", ...; None keeps float32)."""
    _ctranslate2()  # a clear error without the extra
    from ctranslate2.specs import transformer_spec

    cfg = model.config
    if cfg.norm_first or cfg.learned_positions or not cfg.share_embeddings:
        raise ValueError("to_ctranslate2 exports the paper's model: post-norm, sinusoidal positions and one "
                         "embedding matrix (norm_first, learned_positions and share_embeddings=False are not)")
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"{tokenizer} has {tokenizer.vocab_size} pieces, the model {cfg.vocab_size}")
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.num_encoder_layers, cfg.num_decoder_layers), cfg.h, pre_norm=False)
    embedding = _array(model.src_embed.weight)  # (V, d_model)
    # Ours grows on demand; CTranslate2's table is fixed: rows for the longest output beam search
    # gives a source of max_len tokens (max_len + MAX_LEN_EXTRA), and CTranslate2 reads no further.
    positions = sinusoid_table(cfg.max_len + MAX_LEN_EXTRA, cfg.d_model).astype(np.float32)
    for stack in (spec.encoder, spec.decoder):
        stack.position_encodings.encodings = positions
        stack.scale_embeddings = True  # x sqrt(d_model), section 3.4
    spec.encoder.embeddings[0].weight = embedding
    spec.decoder.embeddings.weight = embedding
    spec.decoder.projection.weight = embedding  # logits = x W_emb^T

    for ours, theirs in zip(model.encoder.layers, spec.encoder.layer):
        attn = ours.self_attn
        _linear(theirs.self_attention.linear[0], attn.q_proj, attn.k_proj, attn.v_proj)
        _linear(theirs.self_attention.linear[1], attn.out_proj)
        _norm(theirs.self_attention.layer_norm, ours.sub1.norm)
        _ffn(theirs.ffn, ours)
    for ours, theirs in zip(model.decoder.layers, spec.decoder.layer):
        attn, cross = ours.self_attn, ours.cross_attn
        _linear(theirs.self_attention.linear[0], attn.q_proj, attn.k_proj, attn.v_proj)
        _linear(theirs.self_attention.linear[1], attn.out_proj)
        _norm(theirs.self_attention.layer_norm, ours.sub1.norm)
        _linear(theirs.attention.linear[0], cross.q_proj)
        _linear(theirs.attention.linear[1], cross.k_proj, cross.v_proj)
        _linear(theirs.attention.linear[2], cross.out_proj)
        _norm(theirs.attention.layer_norm, ours.sub2.norm)
        _ffn(theirs.ffn, ours)

    pieces = tokenizer.id_to_piece(range(tokenizer.vocab_size))
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.add_source_eos = True
    spec.config.decoder_start_token = pieces[cfg.start_id]
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    spec.validate()
    spec.optimize(quantization=quantization)
    os.makedirs(output_dir, exist_ok=True)
    with naming(output_dir):  # CTranslate2's writes name no file when they fail (a full disk)
        spec.save(output_dir)
    return output_dir


def load_translator(model_dir: str, threads: int = 0, compute_type: str = "default"):
    """A CTranslate2 ``Translator`` on the CPU with ``threads`` OpenMP threads (0: its default)."""
    return _ctranslate2().Translator(model_dir, device="cpu", compute_type=compute_type,
                                     inter_threads=1, intra_threads=threads)


def decode_options(src: list[list[int]], beam_size: int, max_len_extra: int = MAX_LEN_EXTRA) -> dict:
    """``translate_batch`` options that make CTranslate2 search as ``decoding.beam_search``.

    Its maximum length is one per batch and does not count EOS; ours is per sentence, source
    length (with EOS) + ``max_len_extra`` tokens with EOS. They agree on a batch of sources of
    one length, and on every hypothesis that ends before the limit."""
    return dict(beam_size=beam_size, min_decoding_length=0, suppress_sequences=[["<pad>"], ["<s>"]],
                max_decoding_length=max(map(len, src)) + max_len_extra, max_input_length=0)


class Pieces:
    """Between our token ids and the piece strings CTranslate2 reads and writes."""

    def __init__(self, tokenizer):
        self.pieces = tokenizer.id_to_piece(range(tokenizer.vocab_size))
        self.ids = {p: i for i, p in enumerate(self.pieces)}

    def to_pieces(self, batch: list[list[int]]) -> list[list[str]]:
        return [[self.pieces[i] for i in ids] for ids in batch]

    def to_ids(self, batch: list[list[str]]) -> list[list[int]]:
        return [[self.ids[p] for p in pieces] for pieces in batch]


def ctranslate2_translate(translator, pieces: Pieces, src: list[list[int]], beam_size: int = BEAM,
                          alpha: float = ALPHA, max_len_extra: int = MAX_LEN_EXTRA) -> list[list[int]]:
    """CTranslate2's own beam search (its length penalty L^alpha) of one batch of source ids
    (without EOS): the best hypothesis of each, as ids without EOS."""
    results = translator.translate_batch(pieces.to_pieces(src), length_penalty=alpha,
                                         **decode_options(src, beam_size, max_len_extra))
    return pieces.to_ids([r.hypotheses[0] for r in results])


# A length penalty L^_RAW divides a score by exp(_RAW ln L) = 1 + 4e-9 at L = 50, which rounds to
# 1.0 in float32: the raw log-probability, but CTranslate2's stopping rule for a penalized search.
_RAW = 1e-9


def ctranslate2_beam_search(translator, pieces: Pieces, src: list[list[int]], beam_size: int = BEAM,
                            alpha: float = ALPHA, max_len_extra: int = MAX_LEN_EXTRA) -> list[tuple[list[int], float]]:
    """CTranslate2's beam search scored as ours: all ``beam_size`` finished hypotheses with their
    log-probabilities, each divided by GNMT's ((5 + L) / 6)^alpha (L counts EOS); the best of
    each sentence, with its score (as ``beam_search(..., return_scores=True)``).

    A hypothesis cut at the maximum length has no EOS in CTranslate2's score, where ours forces
    EOS and counts its log-probability: that is read from one more step of CTranslate2's
    decoder after the hypothesis (its logits, PAD and BOS suppressed as in the search)."""
    options = decode_options(src, beam_size, max_len_extra)
    results = translator.translate_batch(pieces.to_pieces(src), length_penalty=_RAW, num_hypotheses=beam_size,
                                         return_scores=True, **options)
    hyps = [pieces.to_ids(r.hypotheses) for r in results]
    logp = [list(r.scores) for r in results]
    cut = [(i, j) for i, hs in enumerate(hyps) for j, h in enumerate(hs) if len(h) >= options["max_decoding_length"]]
    if cut:
        prefixes = [hyps[i][j] for i, j in cut]
        steps = translator.translate_batch(
            pieces.to_pieces([src[i] for i, _ in cut]), target_prefix=pieces.to_pieces(prefixes),
            return_logits_vocab=True,
            **{**options, "beam_size": 1, "max_decoding_length": options["max_decoding_length"] + 1})
        for (i, j), prefix, step in zip(cut, prefixes, steps):
            logits = np.asarray(step.logits[0][len(prefix)], dtype=np.float64)  # after the prefix
            logp[i][j] += float(log_softmax_array(logits)[EOS_ID])
    best = []
    for hs, ss in zip(hyps, logp):
        score, hyp = max(((s / length_penalty(len(h) + 1, alpha), h) for h, s in zip(hs, ss)), key=lambda x: x[0])
        best.append((hyp, score))
    return best


def ctranslate2_log_probs(translator, pieces: Pieces, src: list[list[int]], tgt: list[list[int]]) -> list[np.ndarray]:
    """Teacher-forced log P(token | prefix, source) of each target token and of its EOS."""
    results = translator.score_batch(pieces.to_pieces(src), pieces.to_pieces(tgt))
    return [np.asarray(r.log_probs) for r in results]
