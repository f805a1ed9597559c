"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), section 3.

    src ids (B, S) -> Embedding * sqrt(d_model) + PE -> Dropout -> N x EncoderLayer -> memory
    tgt ids (B, T) -> Embedding * sqrt(d_model) + PE -> Dropout -> N x DecoderLayer(memory)
                   -> xW_emb^T -> logits (B, T, V)

Each sublayer (self-attention, cross-attention, feed-forward) is wrapped as in section 3.1
and 5.4: ``LayerNorm(x + Dropout(Sublayer(x)))`` (post-norm). With a joint source/target
vocabulary, one matrix serves the source embedding, the target embedding and the pre-softmax
projection (section 3.4).

Deviations from the paper are named options, off by default:
  * ``norm_first``: pre-norm, ``x + Dropout(Sublayer(LayerNorm(x)))`` plus a final LayerNorm
    after each stack (trains without warmup more easily; not what the paper did);
  * ``attention_dropout``: dropout on the attention weights (the tensor2tensor code has it;
    the paper does not mention it);
  * ``learned_positions``: the learned positional embeddings of Table 3, row (E).

Two conventions the paper does not state are options too, so that fairseq 0.9's (the toolkit of
the Multi30k literature's figures) can be compared with ours:
  * ``init``: "plain" (every Linear Xavier-uniform with zero biases, embeddings
    N(0, d_model^-1/2)) or "fairseq" (``Transformer._init_fairseq`` says what differs);
  * ``decoder_start``: the decoder's first input, "bos" or "eos" (fairseq feeds EOS); training's
    ``tgt_in`` (``data.collate``), decoding and the export all read it as ``config.start_id``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from .. import backend
from .. import functional as F
from ..settings import SettingsError
from ..tensor import Tensor
from .attention import KVCache, MultiHeadAttention, reorder_cache
from . import init
from .embedding import Embedding, PositionalEncoding
from .layers import Dropout, LayerNorm, Linear, check_fraction, check_int, check_positive
from .module import Module, ModuleList

INITS = ("plain", "fairseq")  # TransformerConfig.init
DECODER_STARTS = ("bos", "eos")  # TransformerConfig.decoder_start


@dataclass
class TransformerConfig:
    vocab_size: int = 37000  # source vocabulary; also the target one when the vocabulary is joint
    tgt_vocab_size: int | None = None  # None: joint vocabulary
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8
    d_k: int | None = None  # per head, for queries and keys; None: d_model / h (Table 3 row B varies it)
    d_v: int | None = None  # per head, for values; None: d_model / h
    num_encoder_layers: int = 6  # N
    num_decoder_layers: int = 6
    dropout: float = 0.1  # P_drop
    label_smoothing: float = 0.1  # eps_ls
    share_embeddings: bool = True  # needs a joint vocabulary
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3
    layer_norm_eps: float = 1e-5
    norm_first: bool = False
    attention_dropout: float = 0.0
    learned_positions: bool = False
    max_len: int = 1024  # positions of a source (decoding splits longer ones); a learned table's rows
    init: str = "plain"  # INITS: how the weights start (see Transformer._init_fairseq)
    decoder_start: str = "bos"  # DECODER_STARTS: the decoder's first input (a checkpoint without it: "bos")

    def __post_init__(self) -> None:
        # Here, not when a layer is built, so that the message names the field.
        owner = "TransformerConfig"
        for name in ("vocab_size", "d_model", "d_ff", "h", "num_decoder_layers", "max_len"):
            check_int(owner, name, getattr(self, name))
        check_int(owner, "num_encoder_layers", self.num_encoder_layers, low=0)  # 0: memory is the embedded source
        for name in ("tgt_vocab_size", "d_k", "d_v"):  # None: joint vocabulary, d_model / h
            if getattr(self, name) is not None:
                check_int(owner, name, getattr(self, name))
        for name in ("pad_id", "bos_id", "eos_id"):  # NumPy would read a negative id from the end
            check_int(owner, name, getattr(self, name), low=0)
        for name in ("dropout", "attention_dropout", "label_smoothing"):
            check_fraction(owner, name, getattr(self, name))
        check_positive(owner, "layer_norm_eps", self.layer_norm_eps)
        for name in ("share_embeddings", "norm_first", "learned_positions"):
            if not isinstance(getattr(self, name), bool):
                raise SettingsError(f"{owner}: {name} must be True or False, got {getattr(self, name)!r}")
        for name, choices in (("init", INITS), ("decoder_start", DECODER_STARTS)):
            if getattr(self, name) not in choices:
                raise SettingsError(f"{owner}: {name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if (self.d_k is None or self.d_v is None) and self.d_model % self.h:
            raise SettingsError(f"d_model={self.d_model} must be divisible by h={self.h} (or set d_k and d_v)")
        if self.share_embeddings and self.tgt_vocab_size not in (None, self.vocab_size):
            raise SettingsError("share_embeddings needs a joint vocabulary (tgt_vocab_size=None)")

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size or self.vocab_size

    @property
    def start_id(self) -> int:
        """The id the decoder reads first: ``tgt_in``'s first column in training, every
        search's first step."""
        return self.eos_id if self.decoder_start == "eos" else self.bos_id

    @classmethod
    def base(cls, vocab_size: int = 37000, **overrides) -> TransformerConfig:
        """Table 3, "base": N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1, eps_ls=0.1."""
        return cls(vocab_size=vocab_size, **overrides)

    @classmethod
    def big(cls, vocab_size: int = 37000, **overrides) -> TransformerConfig:
        """Table 3, "big": d_model=1024, d_ff=4096, h=16, P_drop=0.3 (EN-DE)."""
        params = dict(d_model=1024, d_ff=4096, h=16, dropout=0.3)
        params.update(overrides)
        return cls(vocab_size=vocab_size, **params)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, config: dict) -> TransformerConfig:
        """The config ``to_dict`` wrote (a checkpoint's): a field this class does not have, or
        a value of the wrong kind, is a ValueError naming it, not a TypeError."""
        if not isinstance(config, dict):
            raise SettingsError(f"a model config is a mapping of its fields, not a {type(config).__name__}")
        unknown = sorted(set(config) - {f.name for f in fields(cls)})
        if unknown:
            raise SettingsError(f"the model config has fields this code does not know: {', '.join(map(str, unknown))}")
        return cls(**config)


class PositionwiseFeedForward(Module):
    r"""$\mathrm{FFN}(x) = \max(0, xW_1 + b_1)W_2 + b_2$, equation (2)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_1 = Linear(d_model, d_ff)
        self.w_2 = Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.relu(self.w_1(x)))


class _Residual(Module):
    r"""Wraps one sublayer $f$: $\mathrm{LayerNorm}(x + \mathrm{Dropout}(f(x)))$ (section 3.1), or
    $x + \mathrm{Dropout}(f(\mathrm{LayerNorm}(x)))$ (pre-norm)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.norm = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.dropout)
        self.norm_first = cfg.norm_first

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.h, cfg.attention_dropout, cfg.d_k, cfg.d_v)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff)
        self.sub1 = _Residual(cfg)
        self.sub2 = _Residual(cfg)

    def forward(self, x: Tensor, src_mask: F.KeyMask | None = None) -> Tensor:
        x = self.sub1(x, lambda y: self.self_attn(y, y, y, key_mask=src_mask))
        return self.sub2(x, self.ffn)


class DecoderLayer(Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.h, cfg.attention_dropout, cfg.d_k, cfg.d_v)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.h, cfg.attention_dropout, cfg.d_k, cfg.d_v)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff)
        self.sub1 = _Residual(cfg)
        self.sub2 = _Residual(cfg)
        self.sub3 = _Residual(cfg)

    def forward(self, x: Tensor, memory: Tensor, src_mask: F.KeyMask | None = None,
                cache: dict | None = None) -> Tensor:
        """``cache``: {"self": KVCache(), "cross": {}} for incremental decoding: the self-attention's
        keys and values of the steps so far, and the source's, projected once at the first step.

        ``memory`` may hold fewer rows than ``x``, for beam search: x (n * width, 1, d_model)
        is then ``width`` beams of each of memory's n sentences (row = sentence * width + beam),
        and the beams of a sentence attend to its source as ``width`` queries of one sequence."""
        self_cache = cache["self"] if cache is not None else None
        cross_cache = cache["cross"] if cache is not None else None
        x = self.sub1(x, lambda y: self.self_attn(y, y, y, is_causal=True, cache=self_cache))
        x = self.sub2(x, lambda y: self._cross(y, memory, src_mask, cross_cache))
        return self.sub3(x, self.ffn)

    def _cross(self, y: Tensor, memory: Tensor, src_mask, cache) -> Tensor:
        rows, t, d = y.shape
        n = memory.shape[0]
        if rows == n:
            return self.cross_attn(y, memory, memory, key_mask=src_mask, cache=cache, static_kv=True)
        if t != 1 or rows % n:
            raise ValueError(f"DecoderLayer: {rows} rows of {t} positions for a memory of {n} sentences: beams "
                             f"share their sentence's source one position at a time, in sentences * width rows")
        grouped = self.cross_attn(y.reshape(n, rows // n, d), memory, memory, key_mask=src_mask, cache=cache,
                                  static_kv=True)
        return grouped.reshape(rows, t, d)


class Encoder(Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.layers = ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_encoder_layers))
        self.final_norm = LayerNorm(cfg.d_model, cfg.layer_norm_eps) if cfg.norm_first else None

    def forward(self, x: Tensor, src_mask: F.KeyMask | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.final_norm(x) if self.final_norm is not None else x


class Decoder(Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.layers = ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers))
        self.final_norm = LayerNorm(cfg.d_model, cfg.layer_norm_eps) if cfg.norm_first else None

    def forward(self, x: Tensor, memory: Tensor, src_mask: F.KeyMask | None = None,
                cache: list | None = None) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, src_mask, cache[i] if cache is not None else None)
        return self.final_norm(x) if self.final_norm is not None else x


class Transformer(Module):
    """The encoder-decoder model. ``forward(src, tgt_in)`` gives next-token logits (B, T, V)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.src_embed = Embedding(cfg.vocab_size, cfg.d_model)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else Embedding(cfg.target_vocab_size, cfg.d_model)
        self.positions = PositionalEncoding(cfg.d_model, cfg.max_len, cfg.learned_positions)
        self.embed_dropout = Dropout(cfg.dropout)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.out_proj = None if cfg.share_embeddings else Linear(cfg.d_model, cfg.target_vocab_size, bias=False)
        if cfg.init == "fairseq":
            self._init_fairseq()

    def _init_fairseq(self) -> None:
        r"""fairseq 0.9's initialisation (v0.9.0; the anchor's fork has the same code), drawn
        over the "plain" one where the two differ:

          * $W^Q$, $W^K$, $W^V$ of every attention: Xavier-uniform with gain $1/\sqrt{2}$, and
            their biases PyTorch's ``nn.Linear`` default $U(\pm 1/\sqrt{d_{\mathrm{model}}})$,
            which fairseq leaves as they are (fairseq/modules/multihead_attention.py,
            ``reset_parameters``, lines 69-86); plain: gain 1 and zero biases. $W^O$ and the
            feed-forward layers are Xavier-uniform with zero biases in both (the ``Linear`` of
            fairseq/modules/transformer_layer.py, lines 306-311);
          * the embedding's PAD row: zero (the ``Embedding`` of fairseq/models/transformer.py,
            lines 770-774); the other rows $N(0, d_{\mathrm{model}}^{-1/2})$ in both;
          * an untied output projection: $N(0, d_{\mathrm{model}}^{-1/2})$ (transformer.py, line
            550), where plain is Xavier-uniform.

        LayerNorm starts at ones and zeros in both. The other weights keep the plain draws, so
        that one seed gives the two models the same feed-forward layers and $W^O$."""
        d = self.config.d_model
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                for proj in (module.q_proj, module.k_proj, module.v_proj):
                    proj.weight.data[...] = init.xavier_uniform(*proj.weight.shape, gain=2 ** -0.5)
                    proj.bias.data[...] = init.uniform(proj.bias.shape, proj.in_features ** -0.5)
        for embedding in {id(e): e for e in (self.src_embed, self.tgt_embed)}.values():
            embedding.weight.data[self.config.pad_id] = 0.0
        if self.out_proj is not None:
            self.out_proj.weight.data[...] = init.normal(self.out_proj.weight.shape, d ** -0.5)

    def _embed(self, embedding: Embedding, ids, offset: int = 0) -> Tensor:
        x = embedding(ids) * math.sqrt(self.config.d_model)  # section 3.4
        return self.embed_dropout(self.positions(x, offset))  # section 5.4

    def src_key_mask(self, src) -> F.KeyMask:
        """The source's ``F.KeyMask``: True at real tokens, False at padding. Built once per
        batch, and given to every encoder self-attention and decoder cross-attention."""
        data = src.data if isinstance(src, Tensor) else src
        return F.KeyMask(data != self.config.pad_id)

    def encode(self, src, src_mask: F.KeyMask | None = None) -> Tensor:
        """src (B, S) ids -> memory (B, S, d_model). ``src_mask``: ``src_key_mask(src)``, which
        ``decode`` is given too (built here if not given)."""
        if src_mask is None:
            src_mask = self.src_key_mask(src)
        return self.encoder(self._embed(self.src_embed, src), src_mask)

    def decode(self, tgt_in, memory: Tensor, src_mask: F.KeyMask | None = None, cache: list | None = None,
               offset: int = 0) -> Tensor:
        """tgt_in (B, T) ids at positions ``offset`` to ``offset + T - 1`` -> decoder states
        (B, T, d_model)."""
        x = self._embed(self.tgt_embed, tgt_in, offset)
        return self.decoder(x, memory, src_mask, cache)

    def project(self, states: Tensor) -> Tensor:
        """Decoder states -> logits over the target vocabulary (the pre-softmax linear map)."""
        if self.out_proj is not None:
            return self.out_proj(states)
        return F.linear(states, F.transpose(self.tgt_embed.weight, 0, 1))  # x W_emb^T

    def projector(self):
        r"""``project`` for decoding, which calls it at every step with the weights fixed: the
        tied embedding's transpose $W_{\mathrm{emb}}^\top$ is copied once into a (d_model, V) matrix in C
        order. ``project`` multiplies by a transposed view of $W_{\mathrm{emb}}$, which OpenBLAS packs
        afresh at each call, up to 40% slower when a step's rows are few (3.5% of a whole beam
        search). The copy takes no gradient, and a change of the weights after this call does
        not reach it: for one search at a time."""
        if self.out_proj is not None:
            return self.project
        weight = self.tgt_embed.weight.data
        w_t = Tensor(backend.array_module_of(weight).ascontiguousarray(weight.T))
        return lambda states: F.linear(states, w_t)

    def forward(self, src, tgt_in) -> Tensor:
        src_mask = self.src_key_mask(src)
        return self.project(self.decode(tgt_in, self.encode(src, src_mask), src_mask))

    def new_cache(self) -> list:
        """Empty per-layer caches for incremental decoding."""
        return [{"self": KVCache(), "cross": {}} for _ in range(self.config.num_decoder_layers)]

    @staticmethod
    def reorder_cache(cache: list, index, source_index=None) -> None:
        """Keep batch rows ``index`` of every layer's self-attention cache (beam search), and
        rows ``source_index`` of its cross-attention cache, which holds the source side and so
        changes only when sentences leave the batch (None: left as it is)."""
        for layer in cache:
            reorder_cache(layer["self"], index)
            if source_index is not None:
                reorder_cache(layer["cross"], source_index)

    def extra_repr(self) -> str:
        c = self.config
        return (f"d_model={c.d_model}, d_ff={c.d_ff}, h={c.h}, N={c.num_encoder_layers}+"
                f"{c.num_decoder_layers}, vocab={c.vocab_size}, params={self.num_parameters():,}")


def expected_num_parameters(cfg: TransformerConfig) -> int:
    """The parameter count from the architecture alone (section 3), to check the modules by."""
    d, f = cfg.d_model, cfg.d_ff
    qk, v = cfg.h * (cfg.d_k or d // cfg.h), cfg.h * (cfg.d_v or d // cfg.h)  # h·d_k, h·d_v
    attn = 2 * (d * qk + qk) + (d * v + v) + (v * d + d)  # W^Q, W^K, W^V, W^O with biases
    ffn = d * f + f + f * d + d
    norm = 2 * d
    enc = cfg.num_encoder_layers * (attn + ffn + 2 * norm)
    dec = cfg.num_decoder_layers * (2 * attn + ffn + 3 * norm)
    if cfg.norm_first:
        enc, dec = enc + norm, dec + norm
    emb = cfg.vocab_size * d
    if not cfg.share_embeddings:
        emb += 2 * cfg.target_vocab_size * d  # target embedding and output projection
    if cfg.learned_positions:
        emb += cfg.max_len * d
    return emb + enc + dec
