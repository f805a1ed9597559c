"""The reading's pictures of ideas, each drawn from the code it explains.

    python docs/figures.py --out /tmp/pictures            # every picture
    python docs/figures.py --out /tmp/pictures stacks     # one

Where examples/tour.py shows what the code does when it runs (a model trained, a beam
searched), these show how the pieces fit: Figure 1 from the model's own modules with the shapes
that pass between them, the heads of multi-head attention, one embedding matrix in three
places. Each is a function named after the page that shows it, and each takes what it draws
from the package (a module's parameters, the batcher's batches, the autograd graph of an
expression, DistributedDataParallel's buckets), so that a picture changes when the code does.
docs/build.py draws them when they are missing or older than the code, each beside the numbers
its function returns (NAME.json, by ``draw``), which a page quotes as {{NAME.KEY}}.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import json
import math
import os
import sys
import time

# One BLAS thread, as in examples/tour.py: the matrices here are small, and a second thread
# only waits for the first (on two busy cores, for seconds).
if not any(v in os.environ for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")):
    os.environ["OMP_NUM_THREADS"] = "1"

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

import minitransformer as mt  # noqa: E402
from minitransformer import backend, cli, files, nn  # noqa: E402
from minitransformer import functional as F  # noqa: E402
from minitransformer.data.batching import TokenBatcher  # noqa: E402
from minitransformer.distributed import ddp as ddp_module  # noqa: E402
from minitransformer.distributed.comm import LocalCommunicator  # noqa: E402
from minitransformer.distributed.world import World  # noqa: E402

import build  # noqa: E402 - docs/, beside this file: the ladder the table and the figure both read
import why_self_attention as section_4  # noqa: E402 - docs/: the measurements of section 4's page

WIDTH = 8.0  # inches: 800 px at 100 dpi, as the tour's pictures
plt.rcParams.update({"font.size": 10, "axes.titlesize": 10, "figure.titlesize": 12,
                     "figure.constrained_layout.use": True})
INK, MUTED, ENCODER, DECODER, SHARED = "#1d1f23", "#5b6270", "#dbe7f6", "#f8e3cf", "#e3f1dd"


def save(fig, out: str, name: str) -> None:
    files.save_figure(fig, os.path.join(out, name), readable=True)


def box(ax, x: float, y: float, w: float, h: float, text: str, color: str, size: float = 9, **kw) -> None:
    """A rounded box centred at (x, y) with ``text`` in it."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=color, edgecolor=INK, linewidth=0.8, **kw))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, color=INK)


def arrow(ax, start, end, text: str = "", color: str = INK) -> None:
    """An arrow from ``start`` to ``end``, with ``text`` (a shape) beside its middle."""
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=0.9,
                                                          shrinkA=0, shrinkB=0))
    if text:
        ax.text((start[0] + end[0]) / 2 + 0.12, (start[1] + end[1]) / 2, text, fontsize=7.5, color=MUTED,
                va="center", family="monospace")


def shape(t) -> str:
    return "(" + ", ".join(map(str, t.shape)) + ")"


def base_model(vocab_size: int = 8000, layers: int = 6) -> nn.Transformer:
    cfg = nn.TransformerConfig.base(vocab_size, num_encoder_layers=layers, num_decoder_layers=layers)
    mt.manual_seed(0)
    return nn.Transformer(cfg).eval()


def sublayers(layer) -> list[tuple[str, nn.Module, str]]:
    """A layer's sublayers in the order its forward runs them, each with the residual block
    (Add & Norm) that wraps it: its children are the sublayers, then sub1, sub2, ..."""
    children = list(layer.named_children())
    inner = [(n, m) for n, m in children if not n.startswith("sub")]
    residual = [n for n, _ in children if n.startswith("sub")]
    return [(n, m, r) for (n, m), r in zip(inner, residual)]


# --------------------------------------------------------------------------- section 3.1


def stacks(out: str) -> None:
    """Figure 1 of the paper, drawn from nn.Transformer's modules, with the shapes of a real
    forward pass of the base model (B=2 sentences, S=7 source and T=5 target tokens)."""
    model = base_model()
    cfg = model.config
    rng = np.random.default_rng(0)
    src = mt.tensor(rng.integers(4, cfg.vocab_size, (2, 7)))
    tgt = mt.tensor(rng.integers(4, cfg.vocab_size, (2, 5)))
    mask = model.src_key_mask(src)
    with mt.no_grad():
        x = model.encode(src, mask)
        y = model.decode(tgt, x, mask)
        logits = model.project(y)

    fig, ax = plt.subplots(figsize=(WIDTH, 8.0))
    ax.set_xlim(-0.3, 10.3)
    ax.axis("off")

    def column(x: float, layer, ids: str, embed: str, n: int, color: str, shape_: str, side: int) -> tuple:
        """One stack, bottom to top: (the y of its top, the y of its cross-attention or None)."""
        box(ax, x, 0.3, 2.6, 0.45, ids, "white")
        box(ax, x, 1.25, 3.2, 0.6, f"{embed}: Embedding × √d_model\n+ positions: PositionalEncoding", SHARED, 8)
        arrow(ax, (x, 0.53), (x, 0.95))
        parts = sublayers(layer)
        top = 2.0 + 2.15 * len(parts) + 0.1
        ax.add_patch(FancyBboxPatch((x - 2.0, 2.0), 4.0, top - 2.0, boxstyle="round,pad=0.05,rounding_size=0.2",
                                    facecolor=color, edgecolor=INK, linewidth=1.0, alpha=0.6))
        ax.text(x + side * 2.2, (2.0 + top) / 2, f"N = {n} ×\n{type(layer).__name__}", fontsize=9,
                ha="left" if side > 0 else "right", va="center")
        y, below, cross = 2.75, 1.55, None
        for name, module, residual in parts:
            label = f"{name}: {type(module).__name__}"
            if isinstance(module, nn.MultiHeadAttention):
                causal = "causal, " if name == "self_attn" and side > 0 else ""  # the decoder's
                label += f"\n{causal}h={module.h}, d_k={module.d_k}, d_v={module.d_v}"
            else:
                widths = [module.w_1.in_features, module.w_1.out_features, module.w_2.out_features]
                label += "\n" + " → ".join(map(str, widths))
            arrow(ax, (x, below), (x, y - 0.3), shape_)
            box(ax, x, y, 3.2, 0.6, label, "white", 8)
            if name == "cross_attn":
                cross = y
            box(ax, x, y + 0.95, 3.2, 0.4, f"{residual}: Add & Norm", "#f4f4f4", 8)
            arrow(ax, (x, y + 0.3), (x, y + 0.75))
            # the residual connection: the sublayer's input, around it, into Add & Norm
            rx = x - side * 1.8
            ax.plot([x, rx, rx], [y - 0.5, y - 0.5, y + 0.95], color=MUTED, lw=0.9)
            arrow(ax, (rx, y + 0.95), (x - side * 1.6, y + 0.95), color=MUTED)
            below, y = y + 1.15, y + 2.15
        return top, cross

    # the shapes measured on the forward pass above: every layer keeps its stream's shape
    top_e, _ = column(2.5, model.encoder.layers[0], f"source ids {shape(src)}", "src_embed", cfg.num_encoder_layers,
                      ENCODER, shape(x), -1)
    top_d, cross = column(7.5, model.decoder.layers[0], f"target ids {shape(tgt)}", "tgt_embed",
                          cfg.num_decoder_layers, DECODER, shape(y), 1)
    # the encoder's output, the memory, gives the keys and values of every cross-attention
    ax.plot([2.5, 2.5, 4.95, 4.95], [top_e, top_e + 0.45, top_e + 0.45, cross], color=INK, lw=0.9)
    arrow(ax, (4.95, cross), (5.9, cross))
    ax.text(2.6, top_e + 0.75, f"memory {shape(x)}:\nK and V of every cross_attn", fontsize=8, color=MUTED)
    box(ax, 7.5, top_d + 0.75, 3.2, 0.55, "project: y · src_embed.weightᵀ\n(the shared embedding)", SHARED, 8)
    arrow(ax, (7.5, top_d), (7.5, top_d + 0.47), shape(y))
    box(ax, 7.5, top_d + 1.75, 3.2, 0.45, f"logits {shape(logits)} → softmax", "white", 8)
    arrow(ax, (7.5, top_d + 1.03), (7.5, top_d + 1.52))
    ax.set_ylim(-0.2, top_d + 2.1)
    ax.set_title(f"Figure 1, drawn from nn.Transformer: the base model (d_model={cfg.d_model}, d_ff={cfg.d_ff}, "
                 f"h={cfg.h}, V={cfg.vocab_size:,})\nwith the shapes of one forward pass: B = 2 sentences, "
                 "S = 7 source and T = 5 target tokens")
    save(fig, out, "stacks.png")


# --------------------------------------------------------------------------- section 3.2.2


def multi_head(out: str) -> None:
    """Multi-head attention's split and concat, on a real forward of MultiHeadAttention(512, 8):
    the projected queries split into h column blocks of d_k, one attention per head, the
    heads' outputs concatenated and projected by W^O."""
    mt.manual_seed(0)
    mha = nn.MultiHeadAttention(512, 8).eval()
    mha.keep_weights = True
    h, d_k, d_v, t = mha.h, mha.d_k, mha.d_v, 10
    tokens = mt.tensor(np.random.default_rng(0).standard_normal((1, t, 512)).astype(np.float32))
    x = nn.PositionalEncoding(512)(tokens)  # a sentence's embeddings, with its positions
    with mt.no_grad():
        o = mha(x, x, x).numpy()[0]
        q = mha.q_proj(x).numpy()[0]
        v = mha.v_proj(x).numpy()[0].reshape(t, h, d_v)
        w = mha.last_weights.numpy()[0]  # (h, T, T), as the forward computed them
    concat = np.einsum("hij,jhd->ihd", w, v).reshape(t, h * d_v)  # head_i = w_i V_i, side by side
    if not np.allclose(mha.out_proj(mt.tensor(concat)).numpy(), o, atol=1e-4):
        raise AssertionError("Concat(heads) W^O is not the module's output: the picture would lie")

    fig = plt.figure(figsize=(WIDTH, 6.2))
    grid = fig.add_gridspec(3, h, height_ratios=[1.0, 0.8, 1.0])

    def stripes(ax, m, title):
        image = ax.imshow(m, aspect="auto", cmap="RdBu_r", vmin=-np.abs(m).max(), vmax=np.abs(m).max())
        for i in range(1, h):
            ax.axvline(i * d_k - 0.5, color="k", lw=1.2)
        ax.set_xticks([i * d_k + d_k / 2 for i in range(h)], [f"head {i + 1}" for i in range(h)], fontsize=8)
        ax.set_yticks([0, t - 1])
        ax.set_ylabel("position")
        ax.set_xlabel(f"column, {d_k} a head", fontsize=8)
        ax.set_title(title)
        fig.colorbar(image, ax=ax, fraction=0.025, pad=0.01, label="value")

    stripes(fig.add_subplot(grid[0, :]), q, f"Q = X W^Q, ({t}, h·d_k = {h}·{d_k}): head i takes its {d_k} columns "
            "(so do K and V)")
    heads = [fig.add_subplot(grid[1, i]) for i in range(h)]
    for i, a in enumerate(heads):
        weights = a.imshow(w[i], cmap="Blues", vmin=0, vmax=1)
        a.set_xticks([])
        a.set_yticks([])
        a.set_xlabel(f"head {i + 1}", fontsize=8)
        if i == 0:
            a.set_ylabel("softmax(Q_i K_iᵀ/√d_k)", fontsize=8)
    fig.colorbar(weights, ax=heads, fraction=0.025, pad=0.01, label="weight")
    stripes(fig.add_subplot(grid[2, :]), concat,
            f"Concat(head_1, …, head_{h}), head_i = softmax(Q_i K_iᵀ/√{d_k}) V_i; then × W^O ({h * d_v}×{mha.d_model})")
    fig.suptitle(f"nn.MultiHeadAttention({mha.d_model}, {h}) on one sentence of {t} positions\n"
                 "(random weights: the mechanics, not what a trained head learns)")
    save(fig, out, "multi-head.png")


# --------------------------------------------------------------------------- section 3.2.3


def uses_of_attention(out: str) -> None:
    """The three uses of attention in one model, on a padded batch: where each takes its
    queries, keys and values, and which keys its mask lets each query see. The weights are
    the model's own (random), kept by MultiHeadAttention.keep_weights."""
    cfg = nn.TransformerConfig(vocab_size=50, d_model=64, d_ff=128, h=4, num_encoder_layers=1,
                               num_decoder_layers=1)
    mt.manual_seed(0)
    model = nn.Transformer(cfg).eval()
    rng = np.random.default_rng(0)
    src = rng.integers(4, 50, (2, 9))
    src[1, 6:] = cfg.pad_id  # the second sentence has 6 real tokens and 3 of padding
    tgt = rng.integers(4, 50, (2, 7))
    layers = (model.encoder.layers[0].self_attn, model.decoder.layers[0].self_attn,
              model.decoder.layers[0].cross_attn)
    for m in layers:
        m.keep_weights = True
    with mt.no_grad():
        model(mt.tensor(src), mt.tensor(tgt))
    titles = ["encoder self-attention\nQ, K, V: the encoder's states",
              "decoder self-attention (causal)\nQ, K, V: the decoder's states",
              "encoder-decoder attention\nQ: decoder; K, V: the encoder's output"]
    fig, axes = plt.subplots(1, 3, figsize=(WIDTH, 3.5), gridspec_kw={"width_ratios": [9, 7, 9]},
                             layout="constrained")
    weights = [m.last_weights.numpy()[1].mean(axis=0) for m in layers]  # sentence 2, heads averaged
    top = max(w.max() for w in weights)  # one colour scale for the three, so that one bar reads them
    for ax, w, title, (rows, cols) in zip(axes, weights, titles, [("source", "source"), ("target", "target"),
                                                                  ("target", "source")]):
        image = ax.imshow(w, cmap="Blues", vmin=0, vmax=top)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(0, w.shape[1], 2))
        ax.set_yticks(range(0, w.shape[0], 2))
        ax.set_xlabel(f"key: {cols} position")
        ax.set_ylabel(f"query: {rows} position")
        if cols == "source":
            ax.axvspan(5.5, 8.5, color="#f3b0a0", alpha=0.35, lw=0)
            ax.text(7, len(w) / 2 - 0.5, "padding:\nmasked", ha="center", va="center", fontsize=8, color="#a33")
    fig.colorbar(image, ax=axes.tolist(), shrink=0.8, label="attention weight")
    fig.suptitle("The three uses of attention in one nn.Transformer (random weights, heads averaged),\n"
                 "on a sentence of 6 source tokens padded to 9 and 7 target tokens")
    save(fig, out, "uses-of-attention.png")


# --------------------------------------------------------------------------- section 3.3


def feed_forward(out: str) -> None:
    """The feed-forward network's widths in the base and big models (from the modules), and
    what "position-wise" means: a change at one position moves that position's output only."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH, 3.4), gridspec_kw={"width_ratios": [1.2, 1]})
    layers = ["x\n(d_model)", "max(0, xW₁+b₁)\n(d_ff)", "FFN(x)\n(d_model)"]
    for k, (name, cfg, color) in enumerate([("base", nn.TransformerConfig.base(), "#9ab8e0"),
                                            ("big", nn.TransformerConfig.big(), "#2f5f9f")]):
        ffn = nn.PositionwiseFeedForward(cfg.d_model, cfg.d_ff)
        widths = [ffn.w_1.in_features, ffn.w_1.out_features, ffn.w_2.out_features]
        bars = left.bar(np.arange(3) + (k - 0.5) * 0.38, widths, width=0.36, color=color,
                        label=f"{name}: {ffn.num_parameters() / 1e6:.1f}M parameters a layer")
        left.bar_label(bars, fontsize=8)
    left.set_xticks(range(3), layers, fontsize=8.5)
    left.set_xlabel("the network at one position: input, hidden layer, output")
    left.set_ylabel("width (features per position)")
    left.set_ylim(0, 6000)  # room for the legend above the tallest bar's label
    left.legend(fontsize=8, loc="upper left", frameon=False)
    left.set_title("Equation (2)'s widths: d_model → d_ff = 4·d_model → d_model")

    mt.manual_seed(0)
    ffn = nn.PositionwiseFeedForward(512, 2048)
    x = np.random.default_rng(0).standard_normal((1, 8, 512)).astype(np.float32)
    moved = x.copy()
    moved[0, 3] += 1.0  # change position 3 only
    with mt.no_grad():
        change = np.abs(ffn(mt.tensor(moved)).numpy() - ffn(mt.tensor(x)).numpy()).max(axis=-1)[0]
    right.bar(range(8), change, color=["#c0392b" if i == 3 else "#9aa3b0" for i in range(8)])
    right.set_xlabel("position")
    right.set_ylabel("max |Δ FFN(x)| at the position")
    right.set_title("Position-wise: position 3's input changed")
    save(fig, out, "feed-forward.png")


# --------------------------------------------------------------------------- section 3.4


def embeddings(out: str) -> None:
    """One matrix in three places: the model's source embedding, target embedding and
    pre-softmax projection are one Parameter (checked here on the base model)."""
    model = base_model(vocab_size=37000, layers=1)
    cfg = model.config
    weight = model.src_embed.weight
    if model.tgt_embed.weight is not weight or model.out_proj is not None:
        raise AssertionError("the base model no longer shares one embedding matrix: redraw this picture")
    shared = weight.size
    fig, ax = plt.subplots(figsize=(WIDTH, 3.4))
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.5, 4.4)
    ax.axis("off")
    box(ax, 5.6, 2.0, 3.3, 1.0, f"src_embed.weight  E\n(V, d_model) = ({cfg.vocab_size:,}, {cfg.d_model})\n"
        f"{shared / 1e6:.1f}M parameters, stored once", SHARED, 9)
    for y, text in [(3.4, "encoder input: E[source ids] · √d_model"), (2.0, "decoder input: E[target ids] · √d_model"),
                    (0.6, "pre-softmax linear: logits = y Eᵀ")]:
        box(ax, 1.9, y, 3.4, 0.6, text, "white", 8.5)
        arrow(ax, (3.95, 2.0 + (y - 2.0) * 0.3), (3.65, y))
    # The counts of the whole base model (N = 6), from the architecture: the N = 1 model drawn
    # here shares its matrix as the base model does (nn.Transformer checks its count against it).
    tied = nn.transformer.expected_num_parameters(nn.TransformerConfig.base(cfg.vocab_size))
    untied = nn.transformer.expected_num_parameters(nn.TransformerConfig.base(cfg.vocab_size, share_embeddings=False))
    ax.text(5.6, -0.3, f"One gradient sums all three uses. Shared, the base model has {tied / 1e6:.1f}M "
            f"parameters; unshared, {untied / 1e6:.1f}M.", ha="center", fontsize=8.5, color=MUTED)
    ax.set_title("Section 3.4: one embedding matrix in three places (nn.Transformer's src_embed, tgt_embed and project)")
    save(fig, out, "embeddings.png")


# --------------------------------------------------------------------------- section 5.1


def batching(out: str) -> None:
    """Token batching against fixed-size batches, on sentence lengths like Multi30k's (seeded,
    log-normal about 13 tokens): the batcher's batches from data.TokenBatcher, padding light."""
    rng = np.random.default_rng(0)
    n = 4000
    src_len = np.clip(np.round(rng.lognormal(np.log(13), 0.35, n)), 3, 60).astype(int)
    tgt_len = np.clip(np.round(src_len * rng.normal(1.05, 0.12, n)), 3, 60).astype(int)
    src = [np.ones(k, np.int32) for k in src_len]
    tgt = [np.ones(k, np.int32) for k in tgt_len]
    max_tokens = 400
    token = TokenBatcher(src, tgt, max_tokens=max_tokens, seed=0).epoch_batches(0)
    per_batch = int(round(n / len(token)))
    order = rng.permutation(n)
    fixed = [order[i:i + per_batch] for i in range(0, n, per_batch)]

    def padding(batches) -> float:
        real = sum(src_len[b].sum() for b in batches)
        padded = sum(len(b) * src_len[b].max() for b in batches)
        return 1 - real / padded

    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.8), sharey=True)
    for ax, batches, title in [(axes[0], fixed, f"fixed size: {per_batch} random sentences a batch"),
                               (axes[1], token, f"TokenBatcher: ≤ {max_tokens} tokens a batch, similar lengths")]:
        y = 0
        for b in batches[:6]:
            lengths = src_len[b]
            width = lengths.max()
            ax.add_patch(plt.Rectangle((0, y), width, len(b), facecolor="#f3d2c8", edgecolor=INK, lw=0.6))
            ax.barh(y + np.arange(len(b)) + 0.5, lengths, height=1.0, color="#2f5f9f")
            y += len(b) + 3
        ax.set_xlim(0, 45)
        ax.set_ylim(y, 0)
        ax.set_xlabel("source tokens (blue: real, pink: padding)")
        ax.set_title(f"{title}\npadding over the epoch: {padding(batches):.0%} ({len(batches)} batches)", fontsize=9)
    axes[0].set_ylabel("sentences of the first six batches")
    fig.suptitle(f"Section 5.1, batches of similar length: {n:,} sentences of Multi30k-like lengths")
    save(fig, out, "batching.png")


# --------------------------------------------------------------------------- the engine


def autograd(out: str) -> dict:
    """The graph that a small expression records, micrograd-style: one node per op (its
    Function), arrows from inputs to outputs, and the order in which backward visits them.
    Returns how many ops it drew."""
    from minitransformer import autograd as ag

    x = mt.tensor(np.array([[1.0, -2.0]]), requires_grad=True)
    w = mt.tensor(np.array([[0.5, -1.0, 2.0], [1.5, 0.5, -0.5]]), requires_grad=True)
    b = mt.tensor(np.array([0.1, 0.2, -0.3]), requires_grad=True)
    loss = ((x @ w + b).relu() ** 2).sum()
    order = ag._topological_order(loss._ctx)  # the backward walk's order, root first
    names = {id(x): "x (1, 2)", id(w): "w (2, 3)", id(b): "b (3,)"}
    step = {id(c): i + 1 for i, c in enumerate(order)}
    depth: dict[int, int] = {}

    def place(ctx) -> int:  # the distance from the leaves
        if id(ctx) not in depth:
            depth[id(ctx)] = 1 + max([place(t._ctx) if t is not None and t._ctx is not None else 0
                                      for t in ctx.inputs] or [0])
        return depth[id(ctx)]

    place(loss._ctx)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.2))
    ax.axis("off")
    ax.set_xlim(-0.8, max(depth.values()) * 2 + 0.8)
    ax.set_ylim(-1.3, 1.5)
    at = {id(c): (depth[id(c)] * 2, 0.0) for c in order}
    leaves = [(t, names[id(t)]) for c in order for t in c.inputs if t is not None and t._ctx is None]
    for k, (t, label) in enumerate(leaves):
        at[id(t)] = (0.0, 0.9 - k * 0.9)
        box(ax, 0, at[id(t)][1], 1.2, 0.45, label, SHARED, 9)
    for c in order:
        cx, cy = at[id(c)]
        box(ax, cx, cy, 1.3, 0.6, f"{c.fn.__name__}\nbackward #{step[id(c)]}", "white", 9)
        for t in c.inputs:
            if t is None:
                continue
            sx, sy = at[id(t._ctx) if t._ctx is not None else id(t)]
            arrow(ax, (sx + 0.62, sy), (cx - 0.66, cy + (sy - cy) * 0.3))
    lx, ly = at[id(loss._ctx)]
    ax.text(lx, ly - 0.6, f"loss = {loss.item():.2f}", ha="center", fontsize=9)
    loss.backward()
    ax.text(0, -1.25, f"after loss.backward(): x.grad = {np.round(x.grad.numpy(), 2).tolist()}", fontsize=8.5,
            color=MUTED, ha="left")
    ax.set_title("loss = ((x @ w + b).relu() ** 2).sum(): the Contexts the forward recorded, and the order "
                 "backward walks them (root first)", fontsize=9)
    save(fig, out, "autograd.png")
    return {"ops": len(order)}


def mixed_precision(out: str) -> None:
    """The number lines of float16, bfloat16 and float32 (from NumPy's and the backend's finfo),
    with the gradients of a real backward pass of a small model, before and after the loss
    scale of amp.GradScaler: float16 loses what falls below its smallest subnormal."""
    from minitransformer.amp import GradScaler

    cfg = nn.TransformerConfig(vocab_size=200, d_model=64, d_ff=256, h=4, num_encoder_layers=2, num_decoder_layers=2)
    mt.manual_seed(0)
    model = nn.Transformer(cfg)
    rng = np.random.default_rng(0)
    src, tgt = mt.tensor(rng.integers(4, 200, (8, 12))), rng.integers(4, 200, (8, 13))
    loss = F.cross_entropy(model(src, mt.tensor(tgt[:, :-1])), mt.tensor(tgt[:, 1:]), 0.1)
    loss.backward()
    g = np.abs(np.concatenate([p.grad.numpy().ravel() for p in model.parameters()]))
    g = g[g > 0]
    scale = GradScaler().scale_value  # its initial loss scale
    fig, ax = plt.subplots(figsize=(WIDTH, 3.8), layout="constrained")
    # Each format's line from its bits (exponent, explicit mantissa): normal numbers from 2^(1-bias),
    # subnormals down to 2^(1-bias-mantissa), the largest (2 - 2^-mantissa) 2^bias.
    formats = [("float32", 8, 23, np.finfo(np.float32)), ("bfloat16", 8, 7, None), ("float16", 5, 10, np.finfo(np.float16))]
    if backend.bfloat16 is not None:  # ml_dtypes (the [dev] extra) checks bfloat16's line too
        import ml_dtypes

        formats[1] = formats[1][:3] + (ml_dtypes.finfo(backend.bfloat16),)
    names = []
    for k, (name, exponent, mantissa, fi) in enumerate(formats):
        bias = 2 ** (exponent - 1) - 1
        line = (2.0 ** (1 - bias - mantissa), 2.0 ** (1 - bias), (2 - 2.0**-mantissa) * 2.0**bias)
        if fi is not None and line != tuple(float(v) for v in (fi.smallest_subnormal, fi.smallest_normal, fi.max)):
            raise AssertionError(f"{name}'s line is not its finfo's: redraw this picture")
        lo, normal, hi = np.log2(line)
        ax.plot([lo, normal], [3 + k, 3 + k], color="#9aa3b0", lw=6, solid_capstyle="butt")
        ax.plot([normal, hi], [3 + k, 3 + k], color="#2f5f9f", lw=6, solid_capstyle="butt")
        names.append(name)
    bins = np.arange(-60, 40, 1.0)
    shift = int(np.log2(scale))
    for values, color, label, y0 in [(g, "#c0392b", "gradients", 0.0), (g * scale, "#27ae60", f"× scale 2^{shift}", 1.4)]:
        hist, edges = np.histogram(np.log2(values), bins)
        ax.bar(edges[:-1], hist / hist.max() * 1.1, width=1.0, bottom=y0, color=color, align="edge", label=label)
        lost = (values < float(np.finfo(np.float16).smallest_subnormal) / 2).mean()
        ax.text(-148, y0 + 0.4, f"{lost:.1%} flush to 0 in float16", fontsize=8.5)
    ax.axvline(np.log2(float(np.finfo(np.float16).smallest_subnormal)), color="#888", ls=":", lw=0.8)
    ax.set_xlim(-152, 132)
    ax.set_yticks([0.55, 1.95, 3, 4, 5], ["gradients", f"gradients × 2^{shift}", *names], fontsize=8.5)
    ax.set_ylabel("format (its range)\nand gradients (how many)", fontsize=8.5)
    ax.set_xlabel("log₂ |value|   (grey: subnormal, blue: normal range)")
    ax.set_title("Mixed precision: each format's range, and a small model's gradients\nbefore and after the loss scale")
    save(fig, out, "mixed-precision.png")


def data_parallel(out: str) -> None:
    """DistributedDataParallel's buckets on a real backward pass of the base model (V = 37,000,
    one rank, CPU): each bucket's gradients arrive as backward walks the layers from the top, and
    its all-reduce starts the moment its last one is written, while backward goes on below. The
    walk is measured by the gradient it has completed, in MiB, not by a clock: the picture is
    the same on every machine."""
    from minitransformer.distributed.grad_hooks import register_post_accumulate_grad_hook

    model = base_model(vocab_size=37000)
    done, ready, launched = [0.0], {}, []  # MiB complete; where each parameter and bucket got there

    def complete(p):
        done[0] += p.data.size * 4 / 2**20
        ready[id(p)] = done[0]

    for p in model.parameters():  # registered before DDP's own hooks, so they run first
        register_post_accumulate_grad_hook(p, complete)
    comm = LocalCommunicator()
    real_launch = comm.all_reduce_async
    comm.all_reduce_async = lambda buf, op="sum": (launched.append(done[0]), real_launch(buf, op))[1]
    ddp = ddp_module.DistributedDataParallel(model, World(0, 1, 0, "cpu", comm))
    rng = np.random.default_rng(0)
    src, tgt = mt.tensor(rng.integers(4, 37000, (2, 10))), rng.integers(4, 37000, (2, 11))
    loss = F.cross_entropy(model(src, mt.tensor(tgt[:, :-1])), mt.tensor(tgt[:, 1:]), 0.1)
    loss.backward()
    fig, ax = plt.subplots(figsize=(WIDTH, 4.2))
    for k, bucket in enumerate(ddp.buckets):
        arrivals = [ready[id(ddp.params[i])] for i in bucket.params]
        ax.plot(arrivals, [k] * len(arrivals), "|", color="#2f5f9f", ms=9)
        ax.plot([min(arrivals), launched[k]], [k, k], color="#2f5f9f", lw=1)
        ax.plot(launched[k], k, "o", color="#c0392b", ms=6)
        ax.text(done[0] * 1.02, k, f"{(bucket.stop - bucket.start) * 4 / 2**20:.1f} MiB", va="center", fontsize=8)
    ax.axvline(done[0], color=MUTED, ls="--", lw=0.8)
    ax.text(done[0], -0.9, "backward ends", ha="right", fontsize=8, color=MUTED)
    ax.set_xlim(0, done[0] * 1.12)
    ax.set_ylim(len(ddp.buckets) - 0.4, -1.2)
    ax.set_yticks(range(len(ddp.buckets)), [f"bucket {k}" for k in range(len(ddp.buckets))], fontsize=8)
    ax.set_ylabel("bucket")
    ax.set_xlabel("MiB of gradients complete as backward walks down the base model (V = 37,000, one CPU rank)")
    ax.set_title(f"DistributedDataParallel, {ddp_module.DEFAULT_BUCKET_BYTES // 2**20} MiB buckets: "
                 "gradients written (|), all-reduce launched (●)")
    save(fig, out, "data-parallel.png")


# --------------------------------------------------------------------------- the kernels


def fused_attention(out: str) -> dict:
    """The kernel ladder's counts, the rows of the page's table (docs/ladder.json, which
    benchmarks/attn.py counts on the emulated device, read by build.read_ladder as the table
    is): each rung's global memory in the 32-byte sectors its requests fetch, before any cache,
    beside the fewest its bytes could take; and its shared-memory wavefronts beside the fewest
    its requests could take. Returns the counts it drew, and the ratios of them the page quotes."""
    _, rows = build.read_ladder("docs/figures.py")
    rungs = [r["rung"] for r in rows]
    by = {r["rung"]: r for r in rows}
    fig, (moved, shared) = plt.subplots(1, 2, figsize=(WIDTH, 3.3), sharey=True)
    y = np.arange(len(rows))
    for ax, taken, fewest, unit, title in [
            (moved, "global_KB", "ideal_KB", "KiB", "global memory: KiB of the sectors fetched"),
            (shared, "wavefronts", "ideal_wf", "", "shared memory: wavefronts")]:
        values, least = [r[taken] for r in rows], [r[fewest] for r in rows]
        ax.barh(y, values, height=0.6, color="#2f5f9f", label="taken")
        ax.barh(y, least, height=0.25, color="#f0b37e", label="fewest possible")
        low = 10 ** math.floor(math.log10(min(v for v in least if v) / 3))
        for k, v in enumerate(values):
            ax.text(v * 1.25 if v else low * 1.5, k, f"{v:,.0f} {unit}" if v else "none: no shared memory",
                    va="center", fontsize=8, color=INK if v else MUTED)
        ax.set_xscale("log")
        ax.set_xlim(low, max(values) * 40)
        ax.set_title(title)
        ax.set_xlabel(f"{unit or 'wavefronts'} (log scale)")
    moved.set_yticks(y, [f"{r['rung']}\n{r['dtype']}" for r in rows])
    moved.set_ylabel("rung")
    moved.invert_yaxis()
    moved.legend(fontsize=8, loc="lower right")
    shape = ", ".join(f"{k} = {v}" for k, v in rows[0]["shape"].items())
    fig.suptitle(f"One forward of each rung ({shape}, non-causal), counted on the emulated device:\n"
                 "the rows of the ladder's table", fontsize=10)
    save(fig, out, "fused-attention.png")
    counts = {name.replace(" ", "_"): {k: by[name][k] for k in ("global_KB", "ideal_KB", "wavefronts", "ideal_wf")}
              for name in rungs}
    return {**counts,
            "naive_over_fewest": by["naive"]["global_KB"] / by["naive"]["ideal_KB"],
            "naive_over_tiled": by["naive"]["global_KB"] / by["tiled"]["global_KB"],
            "tiled_over_fused_wavefronts": by["tiled"]["wavefronts"] / by["fused"]["wavefronts"]}


# --------------------------------------------------------------------------- section 4


def path_lengths(layers, n: int, sources) -> np.ndarray:
    r"""How many layers information needs to go from each position of ``sources`` (the columns)
    to each of the $n$ positions ($\infty$: never), when layer $l$ lets position $i$ read
    position $j$ where ``layers(l)[i, j]``: a breadth-first walk over the masks themselves, a
    layer a step. Where a layer's mask is the last one's (the same array), only the positions
    reached at the last step can reach new ones."""
    hops = np.full((n, len(sources)), np.inf)
    for c, source in enumerate(sources):
        hops[source, c] = 0
        reached, new, previous = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), None
        reached[source] = new[source] = True
        for step in range(1, n):
            mask = layers(step - 1)
            spread = new if mask is previous else reached
            new = mask[:, spread].any(axis=1) & ~reached
            if reached.all() or not new.any() and mask is previous:
                break
            hops[new, c] = step
            reached |= new
            previous = mask
    return hops


def _band(n: int, offsets) -> np.ndarray:
    r"""(n, n) mask: position $i$ reads $i + o$ for each offset $o$ (a convolution's taps)."""
    i = np.arange(n)
    return np.isin(i[None, :] - i[:, None], np.asarray(offsets))


def layer_masks(n: int, r: int = 8, k: int = 3) -> dict:
    r"""Each layer type of Table 1 as the mask of what a position reads in one layer, for $n$
    positions: self-attention (the encoder's ``KeyMask`` with no padding, and the decoder's
    causal mask: the model's own), self-attention restricted to a neighbourhood of $r$, a
    convolution of width $k$ over the past, dilated $k^l$ at layer $l$ (Table 1's
    $\log_k(n)$), and a recurrent layer, which reads the previous position's state and its own
    input."""
    from minitransformer.functional.attention import causal_mask

    keys = F.KeyMask(np.ones((1, n), dtype=bool)).attn_mask[0, 0]  # (1, n): no padding
    full, causal = np.broadcast_to(keys, (n, n)), causal_mask(np, n, n)
    window, chain = _band(n, range(-(r // 2), r // 2 + 1)), _band(n, [-1, 0])
    # layer l of the dilated stack reads i, i - k^l, ..., i - (k - 1) k^l; from k^l >= n
    # on, only i itself: the last of these serves every deeper layer
    depth = math.ceil(math.log(n, k))
    dilated = [_band(n, [-o * k**l for o in range(k)]) for l in range(depth + 1)]
    return {"self-attention": lambda l: full,
            "self-attention, causal": lambda l: causal,
            f"restricted, r = {r}": lambda l: window,
            f"convolution, k = {k}, dilated": lambda l: dilated[min(l, len(dilated) - 1)],
            "recurrent": lambda l: chain}


def why_self_attention(out: str) -> dict:
    """Table 1 of section 4 measured: above, how many layers separate two positions, from the
    masks of each layer type (the model's own masks for self-attention); below, the maximum of
    that against the length n, and this project's attention measured against n
    (docs/why-self-attention.json: the fused kernel's global bytes and mma FLOPs counted on the
    emulated device, and the CPU time of the NumPy path). Returns the numbers the page quotes."""
    from matplotlib.colors import PowerNorm

    data = section_4.load()
    lengths, small = data["lengths"], 16
    kinds = list(layer_masks(small))
    keys = dict(zip(kinds, ["self_attention", "causal", "restricted", "convolution", "recurrent"]))
    titles = dict(zip(kinds, ["self-attention", "causal self-attention", "restricted, r = 8",
                              "dilated conv., k = 3", "recurrent"]))
    colors = dict(zip(kinds, ["#2f5f9f", "#6a4c93", "#3c8f5a", "#8e6c1f", "#c0392b"]))
    fig = plt.figure(figsize=(WIDTH, 6.4))
    rows = fig.add_gridspec(2, 1, height_ratios=[1, 1.3])
    top, bottom = rows[0].subgridspec(1, len(kinds)), rows[1].subgridspec(1, 3)
    longest, maps = {}, []
    norm = PowerNorm(0.4, vmin=0, vmax=small - 1)  # one layer stands apart from none and from many
    for c, kind in enumerate(kinds):
        hops = path_lengths(layer_masks(small)[kind], small, np.arange(small))  # (to, from)
        ax = fig.add_subplot(top[c], sharey=maps[0] if maps else None)
        maps.append(ax)
        image = ax.imshow(np.ma.masked_invalid(hops), cmap="viridis_r", norm=norm)  # masked, white: never
        longest[kind] = int(hops[np.isfinite(hops)].max())
        ax.set_title(f"{titles[kind]}\nlongest: {longest[kind]}", fontsize=8, color=colors[kind])
        ax.set_xticks([0, small - 1])
        ax.set_yticks([0, small - 1])
        ax.tick_params(labelsize=7, labelleft=c == 0)
        ax.set_xlabel("from j", fontsize=8)
    maps[0].set_ylabel("to position i", fontsize=8)
    fig.colorbar(image, ax=maps, label="layers (white: never)", ticks=[0, 1, 2, 4, 8, 15], shrink=0.85)
    paths, counted_ax, timed = (fig.add_subplot(bottom[c]) for c in range(3))
    worst = {kind: [] for kind in kinds}  # from either end: the longest path of these masks
    for n in lengths:
        for kind, layers in layer_masks(n).items():
            hops = path_lengths(layers, n, [0, n - 1])
            worst[kind].append(int(hops[np.isfinite(hops)].max()))
    for kind in kinds:
        if kind != kinds[1]:  # the causal mask's paths are the full one's: one line for both
            paths.plot(lengths, worst[kind], "-o", ms=3, color=colors[kind])
            paths.text(lengths[-1] * 1.2, worst[kind][-1], str(worst[kind][-1]), fontsize=7, va="center",
                       color=colors[kind])
    paths.set_yscale("log", base=2)
    paths.set_ylabel("layers")
    paths.set_title("maximum path length\n(colours as above)", fontsize=9)
    counts, times = data["counts"]["rows"], data["times"]["rows"]
    counted = np.asarray(data["counted"], dtype=float)
    for values, color, style, label in [
            ([r["global_bytes"] / 2**10 for r in counts["float32"]], "#2f5f9f", "-o", "global KiB, float32"),
            ([r["global_bytes"] / 2**10 for r in counts["bfloat16"]], "#7aa6d8", "-o", "global KiB, tensor cores"),
            ([r["mma_flops"] / 1e6 for r in counts["bfloat16"]], "#3c8f5a", "-s", "MFLOP in mma")]:
        counted_ax.plot(counted, values, style, ms=3, color=color, label=label)
    flops = counts["bfloat16"][-1]["mma_flops"] / 1e6
    counted_ax.plot(counted, flops * (counted / counted[-1]) ** 2, ":", color=MUTED, label="∝ n²")
    counted_ax.set_ylabel("KiB or MFLOP")
    counted_ax.set_title("fused kernel, counted\n(emulated device)", fontsize=9)
    highest = max(r["global_bytes"] / 2**10 for r in counts["float32"])
    counted_ax.set_ylim(flops * (counted[0] / counted[-1]) ** 2 / 10, highest * 2)  # the legend below the lines
    counted_ax.legend(fontsize=6.5, loc="lower right")
    n = np.asarray(lengths, dtype=float)
    ms = [r["forward_ms"] for r in times]
    timed.plot(n, ms, "-^", ms=3, color="#c0392b", label="forward")
    timed.plot(n, ms[-1] * (n / n[-1]) ** 2, ":", color=MUTED, label="∝ n²")
    timed.set_ylabel("ms of CPU")
    timed.set_title("NumPy path, timed\n(one BLAS thread)", fontsize=9)
    timed.legend(fontsize=6.5, loc="upper left")
    for ax, xs in ((paths, lengths), (counted_ax, data["counted"]), (timed, lengths)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(v) for v in xs], fontsize=6.5)
        ax.minorticks_off()
        ax.set_xlabel("length n")
        if ax is not paths:
            ax.set_yscale("log")
    fig.suptitle(f"Section 4, Table 1: how far apart two positions are, and what one head of attention "
                 f"(d = {data['d']}) costs, against n", fontsize=10)
    save(fig, out, "why-self-attention.png")
    ratio = lambda rows, key: rows[-1][key] / rows[-2][key]  # noqa: E731 - the last doubling of n
    return {"longest_at_16": {keys[k]: v for k, v in longest.items()},
            "longest_at_1024": {keys[k]: v[-1] for k, v in worst.items()},
            "counted_to": data["counted"][-1], "counted_from": data["counted"][-2],
            "flops_last_doubling": ratio(counts["bfloat16"], "mma_flops"),
            "bytes_last_doubling": ratio(counts["float32"], "global_bytes"),
            "time_1024_over_512": ratio(times, "forward_ms")}


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=cli.output_folder, required=True, help="folder for the pictures")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"pictures to draw (default: all): {', '.join(FIGURES)}")
    return p


def draw(name: str, out: str) -> dict:
    """Draw picture ``name`` into ``out``, and keep beside it, as ``name``.json, the numbers its
    function returned (those it drew, which a page may quote: build.QUOTE) with the SHA-256 of
    the picture they belong to."""
    numbers = FIGURES[name](out) or {}
    with files.atomic_write(os.path.join(out, f"{name}.json")) as f:
        json.dump({"picture_sha256": build.sha256(os.path.join(out, f"{name}.png")), "numbers": numbers}, f, indent=1)
        f.write("\n")
    return numbers


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in FIGURES]
    if unknown:
        parser.error(f"no picture {unknown[0]!r}: choose from {', '.join(FIGURES)}")
    os.makedirs(args.out, exist_ok=True)
    for name in args.names or FIGURES:
        start = time.perf_counter()
        draw(name, args.out)
        print(f"{name}.png in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


FIGURES = {"stacks": stacks, "multi-head": multi_head, "uses-of-attention": uses_of_attention,
           "feed-forward": feed_forward, "embeddings": embeddings, "batching": batching, "autograd": autograd,
           "mixed-precision": mixed_precision, "data-parallel": data_parallel, "fused-attention": fused_attention,
           "why-self-attention": why_self_attention}
# The data a figure reads besides the package: the build draws it again when they change.
READS = {"fused-attention": (build.LADDER,), "why-self-attention": (section_4.DATA,)}

if __name__ == "__main__":
    sys.exit(cli.run(main))
