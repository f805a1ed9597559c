"""A tour of minitransformer in 4 seconds on 2 CPU cores: each idea of the paper run on the
package's own code, told as it happens, and drawn.

    python examples/tour.py                      # the pictures go to runs/tour/
    python examples/tour.py --out /tmp/tour --seed 1

In the paper's order:

 1. The model (section 3): one forward and one backward pass of a small Transformer, module by
    module, with the shape of what each returns; then the shapes of a few gradients.
 2. Masks (3.2.3): the key padding of a batch, the causal mask, and the causal mask of the KV
    cache, where a few new queries see every cached key (masks.png).
 3. Attention (3.2.1) as the fused kernel computes it: the loop of its NumPy twin watched key
    tile by key tile, its online softmax reaching the plain softmax's output (online-softmax.png).
 4. Sinusoidal positions (3.5): the table (positional-encoding.png), and the dot products of
    its rows, which depend on the offset between two positions only (position-dot-products.png).
 5. The learning rate of equation (3), for the base and big models (learning-rate.png).
 6. Label smoothing (5.4): the target distribution and the loss it sets (label-smoothing.png).
 7. Training: a tiny model learns to copy sequences (examples/copy_task.py), one
    ``train.train_step`` a batch; its encoder-decoder attention becomes a diagonal
    (copy-attention.png).
 8. Beam search (6.1) of one sequence with that model, step by step, and the length penalty's
    choice among the finished hypotheses (beam-search.png).

``main`` returns a ``TourResult`` with the numbers the tests check (tests/examples/test_tour.py).
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import math
import os
import time
from dataclasses import dataclass

# Set before NumPy loads its BLAS. The tour's matrices are tiny (32 wide): a second BLAS thread
# only adds synchronisation (the tour took 38 s with two threads on two busy cores, 9 s with
# one). A thread count the user set wins.
if not any(v in os.environ for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")):
    os.environ["OMP_NUM_THREADS"] = "1"

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
import numpy as np  # noqa: E402

import copy_task  # noqa: E402 - examples/, beside this file
import minitransformer as mt  # noqa: E402
from minitransformer import cli, files, nn  # noqa: E402
from minitransformer import functional as F  # noqa: E402
from minitransformer.decoding import beam_search, length_penalty  # noqa: E402
from minitransformer.functional.attention import causal_mask  # noqa: E402
from minitransformer.kernels import reference  # noqa: E402
from minitransformer.kernels.reference import formulas  # noqa: E402
from minitransformer.nn.embedding import sinusoid_table  # noqa: E402
from minitransformer.optim.schedule import noam_lr  # noqa: E402

PAD, BOS, EOS, FIRST_SYMBOL = copy_task.PAD, copy_task.BOS, copy_task.EOS, copy_task.FIRST_SYMBOL
PICTURES = ["positional-encoding.png", "position-dot-products.png", "learning-rate.png", "masks.png",
            "label-smoothing.png", "beam-search.png", "online-softmax.png", "copy-attention.png"]
WIDTH = 8.0  # inches: 800 px at the 100 dpi of save(), readable when shown 700 px wide
plt.rcParams.update({"font.size": 10, "axes.titlesize": 10, "figure.titlesize": 12,
                     "figure.constrained_layout.use": True})  # room for titles, labels and colour bars


@dataclass
class TourResult:
    out: str  # the folder of the pictures
    diagonal_mass: float  # share of the copy model's cross-attention on the diagonal
    online_softmax_error: float  # max |O_online - O_full| of the online-softmax picture
    copy_steps: int  # training steps until the cross-attention was diagonal
    beam_source: list[int]  # the sequence the beam-search picture decodes
    beam_hypothesis: list[int]  # and what it decoded
    seconds: float


def say(text: str) -> None:
    print(text, flush=True)


def symbol(i: int) -> str:
    """A token of the copy task as a reader sees it: the symbols 4, 5, ... are a, b, ...; id 1,
    the tokenizer's unknown piece, never occurs in the data, but a model may still propose it."""
    return {PAD: "pad", 1: "unk", BOS: "BOS", EOS: "EOS"}.get(int(i), chr(ord("a") + int(i) - FIRST_SYMBOL))


def spell(ids) -> str:
    return " ".join(symbol(i) for i in ids)


def save(fig, out: str, name: str) -> None:
    files.save_figure(fig, os.path.join(out, name), readable=True)
    say(f"    wrote {name}")


# --------------------------------------------------------------------------- 1. shapes


def show_shapes(seed: int) -> nn.Transformer:
    """One forward and one backward pass, module by module, printing each output's shape."""
    cfg = nn.TransformerConfig(vocab_size=20, d_model=32, d_ff=64, h=4, num_encoder_layers=2,
                               num_decoder_layers=2, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    mt.manual_seed(seed)
    model = nn.Transformer(cfg).eval()  # no dropout: the walk below must equal model(src, tgt_in)
    src, tgt_in, tgt_out, _ = copy_task.make_batch(np.random.default_rng(seed), 2, cfg.vocab_size, 4, 7, "copy")
    src, tgt_in = mt.tensor(src), mt.tensor(tgt_in)
    say(f"[1/8] The model (section 3): d_model={cfg.d_model}, h={cfg.h}, d_ff={cfg.d_ff}, "
        f"N={cfg.num_encoder_layers}, V={cfg.vocab_size}, {model.num_parameters():,} parameters")
    say("    forward, module by module (B batch, S source length, T target length):")
    row = lambda what, x: say(f"      {what:<54} {str(tuple(x.shape)):>10}")  # noqa: E731

    src_mask = model.src_key_mask(src)  # True at real tokens, shared by every layer
    row("source ids (B, S)", src)
    x = model.src_embed(src) * math.sqrt(cfg.d_model)  # section 3.4
    row("source embeddings * sqrt(d_model) (B, S, d_model)", x)
    x = model.embed_dropout(model.positions(x))
    row("+ positional encoding", x)
    for i, layer in enumerate(model.encoder.layers, 1):
        x = layer(x, src_mask)
        row(f"encoder layer {i} (self-attention, feed-forward)", x)
    memory = x
    row("target ids, BOS first (B, T)", tgt_in)
    y = model.embed_dropout(model.positions(model.tgt_embed(tgt_in) * math.sqrt(cfg.d_model)))
    row("target embeddings * sqrt(d_model) + PE", y)
    for i, layer in enumerate(model.decoder.layers, 1):
        y = layer(y, memory, src_mask)
        row(f"decoder layer {i} (causal self-, cross-attention, ffn)", y)
    logits = model.project(y)
    row("logits, y W_emb^T (B, T, V)", logits)
    loss = F.cross_entropy(logits, tgt_out, cfg.label_smoothing, ignore_index=PAD)
    row(f"label-smoothed loss ({loss.item():.3f})", loss)
    same = np.allclose(logits.numpy(), model(src, tgt_in).numpy(), atol=1e-6)
    say(f"    the walk gives model(src, tgt_in)'s logits: {same}")

    loss.backward()
    say("    backward: each parameter's gradient has its parameter's shape")
    params = dict(model.named_parameters())
    for name in ("src_embed.weight", "encoder.layers.0.self_attn.q_proj.weight",
                 "decoder.layers.1.cross_attn.k_proj.weight", "decoder.layers.1.ffn.w_1.weight",
                 "decoder.layers.1.sub3.norm.weight"):
        say(f"      {name:<54} {str(tuple(params[name].grad.shape)):>10}")
    say("      (src_embed.weight is also the target embedding and the output projection: one "
        "gradient sums all three uses)")
    return model


# --------------------------------------------------------------------------- 2. masks


def draw_masks(model: nn.Transformer, seed: int, out: str) -> None:
    say("[2/8] Masks (section 3.2.3): True where a query may attend to a key")
    src, *_ = copy_task.make_batch(np.random.default_rng(seed), 4, model.config.vocab_size, 2, 6, "copy")
    padding = model.src_key_mask(mt.tensor(src)).mask  # (B, S)
    S, new = src.shape[1], 2
    causal = causal_mask(np, S, S)  # (T, S), T = S: the lower triangle
    cached = causal_mask(np, new, S)  # the last `new` positions' queries, against all S keys (S - new cached)
    say(f"    key padding of a batch of {len(src)}: real tokens per row {padding.sum(axis=1).tolist()}")
    say("    causal, T = S: query i sees keys j <= i; with a KV cache (T < S) query i sees "
        "j <= i + S - T: all the cached keys")

    fig, axes = plt.subplots(1, 3, figsize=(WIDTH, 3.4), layout="constrained")
    two = ListedColormap(["#d6e4f3", "#1f5fa8"])  # masked, may attend
    panels = [(padding, f"key padding (B={len(src)}, S={S})", "sentence b"),
              (causal, f"causal, T = S = {S}", "query i"),
              (cached, f"KV cache: T = {new} new queries,\nS = {S} keys ({S - new} cached)", "position of the query")]
    for ax, (mask, title, ylabel) in zip(axes, panels):
        image = ax.imshow(mask, cmap=two, vmin=-0.5, vmax=1.5)
        ax.set(title=title, xlabel="key j", ylabel=ylabel, xticks=range(mask.shape[1]), yticks=range(mask.shape[0]))
    bar = fig.colorbar(image, ax=axes.tolist(), shrink=0.6, ticks=[0, 1])
    bar.ax.set_yticklabels(["masked", "may attend"])
    for (b, j), token in np.ndenumerate(src):  # the tokens behind the padding mask
        axes[0].text(j, b, symbol(token), ha="center", va="center", fontsize=8,
                     color="white" if padding[b, j] else "dimgray")
    axes[2].set_yticks(range(new), range(S - new, S))  # query i of the T new ones sits at position S - T + i
    fig.suptitle("Attention masks (dark: may attend, light: masked)")
    save(fig, out, "masks.png")


# --------------------------------------------------------------------------- 3. online softmax


def draw_online_softmax(seed: int, out: str) -> float:
    """Watch the twin of csrc/attention.cu tile by tile; returns max |O_online - O_full|."""
    T, S, D, block_k = 8, 64, 16, 8
    say(f"[3/8] The fused attention kernel's online softmax (section 3.2.1): {T} queries, {S} keys "
        f"in tiles of {block_k}, d_k={D}")
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 1, n, D)) for n in (T, S, S))  # float64: the algorithm, not rounding
    trace = []  # after each key tile: keys seen, running max m, running sum l, unnormalised O

    def observer(rows, cols, m, l, o_acc):
        trace.append((cols[-1] + 1, m[0, 0].copy(), l[0, 0].copy(), o_acc[0, 0].copy()))

    o, _ = reference.attention_forward(q, k, v, block_q=T, block_k=block_k, observer=observer)
    full, _ = formulas.attention(q, k, v)  # the plain softmax(q k^T / sqrt(d_k)) v, in float64
    seen, m, l, o_acc = (np.array(a) for a in zip(*trace))  # (tiles,), (tiles, T), (tiles, T), (tiles, T, D)
    o_tiles = o_acc / l[..., None]  # the output after each tile, normalised by what it has seen so far
    error = float(np.abs(o_tiles[-1] - full[0, 0]).max())
    say(f"    after the last tile, max |O_online - O_full| = {error:.1e} (the twin returns it: "
        f"max |o - O_full| = {np.abs(o - full).max():.1e})")

    i = int(np.argmax(m[-1] - m[0]))  # the query whose max rises most after the first tile: most rescaling
    scores = (q[0, 0, i] @ k[0, 0].T) / math.sqrt(D)
    say(f"    query {i}: its running max rose from {m[0, i]:.2f} to {m[-1, i]:.2f}, in "
        f"{int((np.diff(m[:, i]) > 0).sum())} steps; at each, l and O were rescaled by exp(m_old - m_new)")
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH, 6.2))
    tiles = np.arange(1, len(seen) + 1)
    ax = axes[0, 0]
    for t0 in range(0, S, 2 * block_k):
        ax.axvspan(t0 - 0.5, t0 + block_k - 0.5, color="0.93")
    ax.plot(scores, ".", color="tab:blue", label="score s_j")
    ax.step(np.concatenate([[0], seen]) - 0.5, np.concatenate([m[:, i], m[-1:, i]]), where="post",
            color="tab:red", label="running max m")  # m[t] over tile t's keys
    ax.set(title=f"query {i}: scores, key tile by key tile", xlabel="key j", ylabel="q·k / sqrt(d_k)")
    ax.legend(fontsize=8, loc="lower right")
    ax = axes[0, 1]
    ax.plot(tiles, l[:, i], "o-", label="l, as the kernel holds it (relative to its m)")
    ax.plot(tiles, l[:, i] * np.exp(m[:, i] - m[-1, i]), "s--", label="l * exp(m - m_final)")
    ax.axhline(np.exp(scores - scores.max()).sum(), color="k", ls=":", label="full: sum exp(s - max s)")
    ax.set(title="running sum l", xlabel="key tiles seen", ylabel="l")
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1, 0]
    for d, color in zip(range(4), ["tab:blue", "tab:orange", "tab:green", "tab:purple"]):
        ax.plot(tiles, o_tiles[:, i, d], "o-", color=color, label=f"O[{d}]")
        ax.axhline(full[0, 0, i, d], color=color, ls=":")
    ax.set(title="output O = o_acc / l (dotted: full softmax)", xlabel="key tiles seen", ylabel="O")
    ax.legend(fontsize=8, ncol=2)
    ax = axes[1, 1]
    ax.semilogy(tiles, np.abs(o_tiles - full[0, 0]).max(axis=-1)[:, i] + 1e-17, "o-")  # 1e-17: log of 0
    ax.set(title="max |O - O_full| over d", xlabel="key tiles seen", ylabel="error (log)")
    fig.suptitle("Online softmax of kernels/reference/attention.py (csrc/attention.cu's twin)")
    save(fig, out, "online-softmax.png")
    return error


# --------------------------------------------------------------------------- 4. positions


def draw_positions(out: str) -> None:
    length, d_model = 100, 64
    say(f"[4/8] Sinusoidal positional encoding (section 3.5): {length} positions, d_model={d_model}")
    table = nn.PositionalEncoding(d_model).table(length, "cpu").numpy()[:length]  # the module's own, float32
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(WIDTH, 4.2))
    for d in (4, 5, 10, 20):
        period = 2 * math.pi * 10000 ** ((d - d % 2) / d_model)
        ax1.plot(table[:, d], label=f"dim {d} ({'sin' if d % 2 == 0 else 'cos'}, period {period:.0f})")
    ax1.set(title="PE(pos, dim) for a few dimensions", xlabel="position", ylabel="value", ylim=(-1.1, 1.1))
    ax1.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)  # below: off the curves
    image = ax2.imshow(table, aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    ax2.set(title="the whole table", xlabel="dimension", ylabel="position")
    fig.colorbar(image, ax=ax2)
    fig.suptitle("PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(...)")
    save(fig, out, "positional-encoding.png")

    table = sinusoid_table(length, d_model)  # the float64 formula the module rounds
    dots = table @ table.T  # PE_p . PE_p' = sum_i cos((p - p') w_i): the offset alone sets it
    spread = max(np.ptp(np.diagonal(dots, offset)) for offset in range(length))
    say(f"    PE_p . PE_p' depends on p - p' only: along each offset the dot products differ by at "
        f"most {spread:.1e}")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(WIDTH, 3.6))
    image = ax1.imshow(dots, cmap="viridis")
    ax1.set(title="PE_p · PE_p'", xlabel="position p'", ylabel="position p")
    fig.colorbar(image, ax=ax1)
    offsets = np.arange(0, 50)
    for p, style in ((0, "-"), (20, "--"), (45, ":")):
        ax2.plot(offsets, dots[p, p + offsets], style, lw=2, label=f"p = {p}")
    ax2.set(title="PE_p · PE_(p+k): one curve for every p", xlabel="offset k", ylabel="dot product")
    ax2.legend(fontsize=8)
    fig.suptitle("Dot products of positional encodings depend on the offset only")
    save(fig, out, "position-dot-products.png")


# --------------------------------------------------------------------------- 5. learning rate


def draw_learning_rate(out: str) -> None:
    warmup, steps = 4000, np.arange(1, 100_001)
    say(f"[5/8] Learning rate, equation (3): d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), warmup {warmup}")
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6))
    for name, cfg in (("base", nn.TransformerConfig.base()), ("big", nn.TransformerConfig.big())):
        lr = [noam_lr(int(s), cfg.d_model, warmup) for s in steps]
        peak = noam_lr(warmup, cfg.d_model, warmup)
        say(f"    {name} (d_model {cfg.d_model}): peak {peak:.2e} at step {warmup}, {lr[-1]:.2e} at step {steps[-1]:,}")
        ax.plot(steps, lr, label=f"{name}, d_model = {cfg.d_model} (peak {peak:.1e})")
    ax.axvline(warmup, color="0.6", ls=":", label=f"warmup = {warmup} steps")
    ax.set(title="Learning rate of equation (3): linear warmup, then 1/sqrt(step)", xlabel="training step",
           ylabel="learning rate")
    ax.legend()
    save(fig, out, "learning-rate.png")


# --------------------------------------------------------------------------- 6. label smoothing


def draw_label_smoothing(out: str) -> None:
    V, y, eps = 8, 2, 0.1
    say(f"[6/8] Label smoothing (section 5.4): q_k = (1 - eps) [k = y] + eps / V, eps = {eps}, V = {V}")
    # q read back from the package's loss: its gradient with respect to the logits is softmax(z) - q.
    z = mt.zeros((1, V), requires_grad=True)
    F.cross_entropy(z, np.array([y]), eps, reduction="sum").backward()
    q = 1.0 / V - z.grad.numpy()[0]
    say(f"    target {y}: q = {' '.join(f'{x:.4f}' for x in q)}")
    # The loss when the model puts p on the target and spreads the rest evenly.
    p = np.linspace(0.02, 0.999, 400)
    probs = np.repeat(((1 - p) / (V - 1))[:, None], V, axis=1)
    probs[:, y] = p
    logits, targets = mt.tensor(np.log(probs).astype(np.float32)), np.full(len(p), y)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(WIDTH, 3.6))
    ax1.bar(np.arange(V) - 0.2, np.eye(V)[y], 0.4, label="one-hot (eps = 0)", color="0.6")
    ax1.bar(np.arange(V) + 0.2, q, 0.4, label=f"smoothed (eps = {eps})", color="tab:blue")
    ax1.text(y + 0.45, q[y], f"{q[y]:.4f}", va="center", fontsize=8)
    other = (y + 3) % V
    ax1.annotate(f"eps / V = {q[other]:.4f}", (other + 0.2, q[other]), (other + 0.2, 0.3), ha="center", fontsize=8,
                 arrowprops=dict(arrowstyle="->", color="tab:blue"))
    ax1.set(title=f"target distribution for y = {y}", xlabel="class k", ylabel="q_k", xticks=range(V), ylim=(0, 1.1))
    ax1.legend(fontsize=8)
    for e, color in ((0.0, "0.4"), (eps, "tab:blue")):
        loss = F.cross_entropy(logits, targets, e, reduction="none").numpy()
        ax2.plot(p, loss, color=color, label=f"eps = {e}")
        best = p[loss.argmin()]
        ax2.plot(best, loss.min(), "o", color=color)
        say(f"    eps = {e}: " + ("the loss falls all the way to P(y) = 1" if best == p[-1] else
                                  f"the loss is lowest at P(y) = {best:.3f} = q_y"))
    ax2.axvline(1 - eps + eps / V, color="tab:blue", ls=":", label="1 - eps + eps/V")
    ax2.set(title="loss when the model gives P(y) to the target", xlabel="P(y)", ylabel="cross-entropy",
            ylim=(0, 2.5))
    ax2.legend(fontsize=8)
    fig.suptitle("Label smoothing: the best prediction is no longer certainty")
    save(fig, out, "label-smoothing.png")


# --------------------------------------------------------------------------- 7. copy task


def cross_attention(model, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
    """The last decoder layer's encoder-decoder attention, (B, h, T, S), kept as plot_attention.py does."""
    cross = model.decoder.layers[-1].cross_attn
    was_training, cross.keep_weights = model.training, True
    model.eval()
    try:
        with mt.no_grad():
            model(mt.tensor(src), mt.tensor(tgt_in))
    finally:
        cross.keep_weights = False
        model.train(was_training)
    return cross.last_weights.numpy()


def diagonal_mass(weights: np.ndarray, refs: list[list[int]]) -> float:
    """Share of attention on the diagonal: target position i (fed token i - 1, BOS first) copies
    source token i, so it should look there. Averaged over heads, positions and sequences; the
    last position (which predicts EOS) has no source token to copy and is left out."""
    return float(np.mean([weights[b, :, np.arange(len(r)), np.arange(len(r))].mean() for b, r in enumerate(refs)]))


def train_copy_task(seed: int, out: str):
    """Train until the cross-attention is diagonal; returns (model, options, diagonal mass, steps)."""
    # A tiny model with no dropout: at this size the task needs no regularisation, only steps.
    args = copy_task.parse_args(["--d-model", "32", "--heads", "2", "--layers", "1", "--dropout", "0",
                                 "--warmup", "100", "--steps", "1000", "--batch-size", "32",
                                 "--log-every", "50", "--seed", str(seed)])
    say(f"[7/8] Training to copy sequences of {args.min_len}-{args.max_len} symbols "
        f"({args.vocab - FIRST_SYMBOL} symbols; examples/copy_task.py, train.train_step): d_model={args.d_model}, "
        f"h={args.heads}, N={args.layers}")
    mt.manual_seed(seed)
    model = copy_task.build(args)
    held_out = copy_task.make_batch(np.random.default_rng(seed + 1), 100, args.vocab, args.min_len,
                                    args.max_len, args.task)
    masses = {}

    def diagonal(step: int) -> bool:
        masses[step] = diagonal_mass(cross_attention(model, held_out[0], held_out[1]), held_out[3])
        say(f"        cross-attention on the diagonal: {masses[step]:.0%}")
        return masses[step] >= 0.95

    copy_task.train(model, args, np.random.default_rng(seed), stop=diagonal)
    steps, mass = max(masses), masses[max(masses)]
    exact = copy_task.exact_match(model, np.random.default_rng(seed + 2), args)
    say(f"    after {steps} steps {mass:.0%} of the attention is on the diagonal; greedy decoding copies "
        f"{exact:.0%} of 200 held-out sequences exactly")

    b = int(np.argmax([len(r) for r in held_out[3]]))  # the longest held-out sequence
    n = len(held_out[3][b])
    weights = cross_attention(model, held_out[0][b: b + 1, :n], held_out[1][b: b + 1, : n + 1])[0]
    fig, axes = plt.subplots(1, args.heads, figsize=(WIDTH, 4.2), squeeze=False)
    for head, ax in enumerate(axes[0]):
        image = ax.imshow(weights[head], cmap="viridis", vmin=0, vmax=1)
        ax.set_xticks(range(n), [symbol(t) for t in held_out[0][b, :n]])
        ax.set_yticks(range(n + 1), [symbol(t) for t in held_out[1][b, : n + 1]])
        ax.set(title=f"head {head + 1}", xlabel="source token (key)", ylabel="decoder input (query)")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="attention weight")
    fig.suptitle(f"Encoder-decoder attention of the copy model after {steps} steps "
                 f"({mass:.0%} on the diagonal)")
    save(fig, out, "copy-attention.png")
    return model, args, mass, steps


# --------------------------------------------------------------------------- 8. beam search


def draw_beam_search(model, args, seed: int, out: str, beam_size: int = 3, alpha: float = 0.6):
    """One sequence's beam search, watched through beam_search's observer and drawn as a tree."""
    src = copy_task.make_batch(np.random.default_rng(seed + 3), 1, args.vocab, 5, 5, args.task)[0]
    say(f"[8/8] Beam search (section 6.1) of '{spell(src[0])}', beam {beam_size}, length penalty "
        f"alpha = {alpha}")
    steps = []
    (best, best_score), = beam_search(model, mt.tensor(src), beam_size, alpha, max_len_extra=2,
                                      return_scores=True, observer=steps.append)
    fig, (tree, bars) = plt.subplots(2, 1, figsize=(WIDTH, 7.6), gridspec_kw={"height_ratios": [3, 2]})
    # Each row of a step is drawn where the step before drew the beam it continues: row r of
    # step t is the r-th beam kept by step t - 1.
    parent_y = [0.5 * (2 * beam_size - 1)]  # BOS, centred in column 0
    tree.text(0, parent_y[0], "BOS", ha="center", va="center", bbox=dict(boxstyle="round", fc="tab:blue", ec="none"),
              color="white", fontsize=9)
    finished = []
    for step in steps:
        x = step.t + 1
        kept = list(zip(step.kept_rows[0].tolist(), step.kept_words[0].tolist())) if len(step.kept_rows) else []
        ends = {tuple(tokens) for _, tokens, _, _ in step.finished}
        next_y = {}
        for rank, (row, word, score) in enumerate(zip(step.candidate_rows[0], step.candidate_words[0],
                                                      step.candidate_scores[0])):
            if not np.isfinite(score):  # not a possible extension (EOS forced at the length limit)
                continue
            prefix = tuple(step.prefixes[row].tolist())
            if word == EOS and prefix in ends:
                style, color = dict(boxstyle="round", fc="tab:green", ec="none"), "white"
            elif (row, word) in kept:
                style, color = dict(boxstyle="round", fc="tab:blue", ec="none"), "white"
                next_y[(row, word)] = rank
            else:
                style, color = None, "0.55"
            tree.plot([x - 1, x], [parent_y[row], rank], color=color if style is None else style["fc"],
                      lw=0.8 if style is None else 1.6, zorder=1)
            tree.text(x, rank, f"{symbol(word)} {score:.2f}", ha="center", va="center", fontsize=8,
                      color=color, bbox=style or dict(boxstyle="round", fc="white", ec="0.8"), zorder=2)
        finished += step.finished
        parent_y = [next_y[beam] for beam in kept]
        say(f"    step {step.t}: kept {[spell(step.prefixes[r].tolist() + [w]) for r, w in kept] or 'none'}"
            + "".join(f"; finished '{spell(tokens)}' (log P {lp:.2f})" for _, tokens, lp, _ in step.finished))
    tree.set(title=f"Beam search of '{spell(src[0])}', beam {beam_size}: each step ranks its {2 * beam_size} best "
                   f"candidates\n(token, log P so far); blue: kept, green: finished with EOS, grey: dropped",
             xlabel="output position", ylabel="candidate rank", xlim=(-0.6, len(steps) + 0.6))
    tree.invert_yaxis()
    tree.set_xticks(range(len(steps) + 1))

    names = [f"{spell(tokens)} EOS" for _, tokens, _, _ in finished]
    log_probs = np.array([lp for _, _, lp, _ in finished])
    scores = np.array([score for _, _, _, score in finished])
    rows = np.arange(len(finished))
    bars.barh(rows - 0.2, log_probs, 0.4, color="0.6", label="log P (alpha = 0: no penalty)")
    bars.barh(rows + 0.2, scores, 0.4, color="tab:green", label=f"log P / lp, alpha = {alpha}")
    for values, dy, what in ((log_probs, -0.2, "best log P"), (scores, 0.2, f"wins at alpha = {alpha}")):
        w = int(values.argmax())
        bars.text(values[w], w + dy, f"{what} ->  ", ha="right", va="center", fontsize=8)
    bars.set_yticks(rows, names)
    bars.set_ylabel("finished hypothesis")
    lengths = {len(tokens) + 1 for _, tokens, _, _ in finished}  # EOS counted, as lp counts it
    if len(lengths) > 1:
        title = "Finished hypotheses: lp(Y) = ((5 + |Y|) / 6)^alpha divides a longer one's log P by more"
    else:  # the copy task's answers are all as long as its question
        title = (f"Finished hypotheses, all of |Y| = {lengths.pop()}: lp(Y) = ((5 + |Y|) / 6)^alpha divides "
                 f"each alike,\nso their order is log P's")
    bars.set(title=title, xlabel="score (higher wins)", xlim=(min(log_probs.min(), scores.min()) * 1.15, 0))
    bars.invert_yaxis()
    bars.legend(fontsize=8, loc="lower left")
    no_penalty = beam_search(model, mt.tensor(src), beam_size, 0.0, max_len_extra=2)[0]
    say(f"    winner with alpha = {alpha}: '{spell(best)}' (score {best_score:.3f}; lp = "
        f"{length_penalty(len(best) + 1, alpha):.2f}); with alpha = 0: '{spell(no_penalty)}' (beams are ranked "
        f"by log P alone: alpha only chooses among the finished)")
    save(fig, out, "beam-search.png")
    return src[0].tolist(), best


# --------------------------------------------------------------------------- main


def tour(out: str, seed: int = 0) -> TourResult:
    start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    model = show_shapes(seed)
    draw_masks(model, seed, out)
    error = draw_online_softmax(seed, out)
    draw_positions(out)
    draw_learning_rate(out)
    draw_label_smoothing(out)
    copy_model, args, mass, steps = train_copy_task(seed, out)
    source, hypothesis = draw_beam_search(copy_model, args, seed, out)
    seconds = time.perf_counter() - start
    say(f"done in {seconds:.0f} s: {len(PICTURES)} pictures in {out}")
    return TourResult(out, mass, error, steps, source, hypothesis, seconds)


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=cli.output_folder, default=os.path.join("runs", "tour"), help="folder for the pictures")
    p.add_argument("--seed", type=cli.integer(0), default=0, help="seeds the models, the data and the inputs")
    return p


def main(argv=None) -> TourResult:
    args = build_parser().parse_args(argv)
    return tour(args.out, args.seed)


if __name__ == "__main__":
    cli.run(main)
