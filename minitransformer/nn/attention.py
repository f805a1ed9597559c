"""Multi-head attention, paper section 3.2.2:

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
    head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i),     d_k = d_v = d_model / h

The h per-head projections W^Q_i (d_model x d_k) are stored side by side as one d_model x
h·d_k matrix, so projecting once and reshaping (B, T, h·d_k) -> (B, h, T, d_k) gives every head
at once. ``d_k`` and ``d_v`` may be set apart from d_model / h, as Table 3 varies them (row B:
a smaller d_k alone); W^O is then h·d_v x d_model.

Incremental decoding passes a cache per attention layer:
  * self-attention appends this step's keys and values to a ``KVCache``, so each new token
    costs one query against the stored keys, not a recompute of the prefix;
  * cross-attention (``static_kv=True``) projects the encoder output once, on the first step,
    into a dict's ``"k"``/``"v"``, and reuses it for every later step.
"""

from __future__ import annotations

from .. import backend
from .. import functional as F
from ..autograd import is_grad_enabled
from ..settings import SettingsError
from ..tensor import Tensor
from .layers import Linear, check_fraction, check_int
from .module import Module


class MultiHeadAttention(Module):
    def __init__(self, d_model: int, h: int, dropout: float = 0.0, d_k: int | None = None,
                 d_v: int | None = None) -> None:
        super().__init__()
        check_int("MultiHeadAttention", "d_model", d_model)
        check_int("MultiHeadAttention", "h", h)
        for name, size in (("d_k", d_k), ("d_v", d_v)):
            if size is not None:  # 0 would read as "d_model / h" below
                check_int("MultiHeadAttention", name, size)
        check_fraction("MultiHeadAttention", "dropout", dropout)  # as F.scaled_dot_product_attention
        if (d_k is None or d_v is None) and d_model % h:
            raise SettingsError(f"d_model={d_model} is not divisible by h={h} (or give d_k and d_v)")
        self.d_model, self.h = d_model, h
        self.d_k, self.d_v = d_k or d_model // h, d_v or d_model // h
        self.attn_dropout = dropout  # on the attention weights: a named deviation, 0 in the paper
        self.keep_weights = False  # True: each forward stores its probabilities in last_weights
        self.last_weights = None
        self.q_proj = Linear(d_model, h * self.d_k)
        self.k_proj = Linear(d_model, h * self.d_k)
        self.v_proj = Linear(d_model, h * self.d_v)
        self.out_proj = Linear(h * self.d_v, d_model)

    def _split_heads(self, x: Tensor) -> Tensor:
        b, t, width = x.shape
        return x.reshape(b, t, self.h, width // self.h).transpose(1, 2)  # (B, h, T, d_k or d_v)

    def _project_kv(self, key: Tensor, value: Tensor, cache, static_kv: bool):
        if cache is not None and static_kv and "k" in cache:
            return cache["k"], cache["v"]
        k = self._split_heads(self.k_proj(key))  # (B, h, S, d_k)
        v = self._split_heads(self.v_proj(value))
        if cache is None:
            return k, v
        if static_kv:
            cache["k"], cache["v"] = k, v
            return k, v
        return cache.append(k, v)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_mask: F.KeyMask | None = None,
                is_causal: bool = False, need_weights: bool = False, cache: dict | None = None,
                static_kv: bool = False):
        """query (B, T, d_model), key/value (B, S, d_model) -> (B, T, d_model).

        ``key_mask``: the ``F.KeyMask`` of the keys (True at real tokens, False at padding),
        which a model builds once for all its layers.
        ``is_causal``: query t attends to keys up to its own position (decoder self-attention).
        ``need_weights``: also return the (B, h, T, S) attention probabilities, for plots.
        """
        if key_mask is not None and not isinstance(key_mask, F.KeyMask):
            raise TypeError(f"MultiHeadAttention: key_mask must be an F.KeyMask (True = may attend), "
                            f"got {type(key_mask).__name__}: build one with F.KeyMask(tokens != pad_id)")
        q = self._split_heads(self.q_proj(query))  # (B, h, T, d_k)
        k, v = self._project_kv(key, value, cache, static_kv)
        p = self.attn_dropout if self.training else 0.0
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=is_causal, dropout_p=p)
        b, _, t, _ = heads.shape
        out = self.out_proj(heads.transpose(1, 2).reshape(b, t, self.h * self.d_v))  # Concat(heads) W^O
        if need_weights or self.keep_weights:
            weights = F.attention_weights(q, k, key_mask, is_causal)  # (B, h, T, S)
            if self.keep_weights:
                self.last_weights = weights
            if need_weights:
                return out, weights
        return out

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, h={self.h}, d_k={self.d_k}, d_v={self.d_v}"


class KVCache:
    """The keys (B, h, n, d_k) and values (B, h, n, d_v) a decoder self-attention has seen,
    for incremental decoding (under ``no_grad``: they are written in place).

    They live in buffers with room for a few more positions (``GROW`` at a time): a step
    writes its keys at position n, where appending by concatenation would copy the whole
    prefix at every step. ``select(rows)`` keeps batch rows (beam search's surviving beams):
    gathering whole buffer rows is one contiguous copy per row, the cheapest gather NumPy
    has (gathering into a slice of a preallocated buffer copies in small strided pieces, 3 to
    15 times slower), so the spare positions are gathered too, at every step of a beam
    search: hence few of them. Growing by 2 positions made beam search 5% faster than by 8
    (and by 3 or 4 in between, by 1 slower again: each growth copies the buffers)."""

    GROW = 2  # positions added when the buffers are full

    def __init__(self) -> None:
        self.n = 0  # positions held
        self._buffers = None  # [keys, values], (B, h, capacity, d)

    @property
    def k(self) -> Tensor:
        return Tensor(self._buffers[0][:, :, :self.n])

    @property
    def v(self) -> Tensor:
        return Tensor(self._buffers[1][:, :, :self.n])

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add a step's keys and values (B, h, T, d) after the prefix; returns all of them."""
        if is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError("KVCache: incremental decoding runs under minitransformer.no_grad() "
                               "(the cache is written in place, which gradients cannot follow)")
        xp = backend.array_module_of(k.data)
        b, t = k.shape[0], k.shape[2]
        if self._buffers is None:
            self._buffers = [xp.empty((*x.shape[:2], 0, x.shape[3]), x.dtype) for x in (k.data, v.data)]
        if b != self._buffers[0].shape[0]:
            raise ValueError(f"KVCache: a step of {b} rows for a cache of {self._buffers[0].shape[0]}")
        short = self.n + t - self._buffers[0].shape[2]
        if short > 0:  # GROW positions more (or as many as the step needs, rounded up)
            more = -(-short // self.GROW) * self.GROW
            self._buffers = [xp.concatenate([x, xp.empty((*x.shape[:2], more, x.shape[3]), x.dtype)], axis=2)
                             for x in self._buffers]
        for buffer, new in zip(self._buffers, (k.data, v.data)):
            buffer[:, :, self.n:self.n + t] = new
        self.n += t
        return self.k, self.v

    def select(self, index) -> None:
        """Keep batch rows ``index`` (an integer array), in its order."""
        if self._buffers is not None:
            self._buffers = [x[index] for x in self._buffers]


def reorder_cache(cache, index) -> None:
    """Select batch rows of a cache in place (beam search keeps the surviving beams)."""
    if isinstance(cache, KVCache):
        cache.select(index)
        return
    for name in ("k", "v"):
        if name in cache:
            cache[name] = Tensor(cache[name].data[index])
