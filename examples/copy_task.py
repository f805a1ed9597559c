"""Train a small Transformer to copy (or reverse) random token sequences, on the CPU.

The smallest end-to-end check of the whole stack: embeddings, positional encoding, encoder,
causal decoder with cross-attention, label-smoothed loss, Adam with the warmup schedule, and
greedy/beam decoding with the KV cache. Within a minute or two on a laptop CPU the model
decodes held-out sequences exactly.

    python examples/copy_task.py                 # copy, default size
    python examples/copy_task.py --task reverse --steps 1500
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import time

import numpy as np

import minitransformer as mt
from minitransformer import backend, cli, nn
from minitransformer.decoding import beam_search, greedy_decode
from minitransformer.optim import Adam, WarmupInverseSqrtSchedule, schedule_factor
from minitransformer.train import train_step

PAD, BOS, EOS, FIRST_SYMBOL = 0, 2, 3, 4


def make_batch(rng: np.random.Generator, batch_size: int, vocab: int, min_len: int, max_len: int,
               task: str):
    """Random sequences of symbols (ids >= 4), padded; targets are the copy or the reversal."""
    lengths = rng.integers(min_len, max_len + 1, size=batch_size)
    src = np.full((batch_size, max_len), PAD, dtype=np.int64)
    tgt = np.full((batch_size, max_len + 2), PAD, dtype=np.int64)
    for i, n in enumerate(lengths):
        seq = rng.integers(FIRST_SYMBOL, vocab, size=n)
        src[i, :n] = seq
        tgt[i, 0] = BOS
        tgt[i, 1: n + 1] = seq if task == "copy" else seq[::-1]
        tgt[i, n + 1] = EOS
    return src, tgt[:, :-1], tgt[:, 1:], [tgt[i, 1: n + 1].tolist() for i, n in enumerate(lengths)]


def build(args) -> nn.Transformer:
    cfg = nn.TransformerConfig(
        vocab_size=args.vocab, d_model=args.d_model, d_ff=4 * args.d_model, h=args.heads,
        num_encoder_layers=args.layers, num_decoder_layers=args.layers, dropout=args.dropout,
        pad_id=PAD, bos_id=BOS, eos_id=EOS,
    )
    return nn.Transformer(cfg)


def exact_match(model, rng, args, n: int = 200, beam: int = 1) -> float:
    src, _, _, refs = make_batch(rng, n, args.vocab, args.min_len, args.max_len, args.task)
    src = mt.tensor(src, device=args.device)
    hyps = greedy_decode(model, src, max_len_extra=5) if beam == 1 else beam_search(model, src, beam, max_len_extra=5)
    return float(np.mean([h == r for h, r in zip(hyps, refs)]))


def train(model, args, rng: np.random.Generator, stop=None) -> list[float]:
    """Train ``model`` for ``args.steps`` steps of fresh random batches; returns the losses.

    Each step is ``train.train_step``, the textbook step: forward, label-smoothed loss,
    backward, then Adam with the paper's warmup schedule (section 5.3). ``stop(step)``, if
    given, is asked at each log line; True ends the training there (the tour stops once the
    cross-attention is diagonal)."""
    optimizer = Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    factor = schedule_factor(args.peak_lr, args.d_model, args.warmup) if args.peak_lr else 1.0  # 1: the paper's
    schedule = WarmupInverseSqrtSchedule(optimizer, args.d_model, warmup=args.warmup, factor=factor)
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        src, tgt_in, tgt_out, _ = make_batch(rng, args.batch_size, args.vocab, args.min_len, args.max_len, args.task)
        batch = tuple(mt.tensor(a, device=args.device) for a in (src, tgt_in, tgt_out))
        result = train_step(model, optimizer, schedule, batch, label_smoothing=args.label_smoothing)
        losses.append(result.loss)
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step:5d}  loss {result.loss:.4f}  ppl {result.ppl:8.3f}  lr {result.lr:.2e}  "
                  f"{time.perf_counter() - start:6.1f}s")
            if stop is not None and stop(step):
                break
    return losses


def run(args) -> dict:
    mt.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = build(args).to(args.device)
    print(f"model: {model.num_parameters():,} parameters; task: {args.task}; device: {args.device}")
    losses = train(model, args, rng)
    eval_rng = np.random.default_rng(args.seed + 1)
    greedy = exact_match(model, eval_rng, args)
    beam = exact_match(model, np.random.default_rng(args.seed + 1), args, beam=4)
    chance = float(args.vocab - FIRST_SYMBOL) ** -args.min_len
    print(f"exact match on 200 held-out sequences: greedy {greedy:.1%}, beam 4 {beam:.1%} "
          f"(chance < {chance:.1e})")
    return {"losses": losses, "greedy_exact_match": greedy, "beam_exact_match": beam}


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=["copy", "reverse"], default="copy", help="what the target is")
    p.add_argument("--steps", type=cli.integer(1), default=1200, help="optimiser steps")
    p.add_argument("--batch-size", type=cli.integer(1), default=64, help="sequences per step")
    p.add_argument("--vocab", type=cli.integer(FIRST_SYMBOL + 1), default=20,
                   help=f"vocabulary size, including {FIRST_SYMBOL} special ids")
    p.add_argument("--min-len", type=cli.integer(1), default=4, help="shortest sequence")
    p.add_argument("--max-len", type=cli.integer(1), default=10, help="longest sequence")
    p.add_argument("--d-model", type=cli.integer(1), default=64,
                   help="d_model (a multiple of --heads); d_ff is 4 x d_model")
    p.add_argument("--heads", type=cli.integer(1), default=4, help="attention heads h")
    p.add_argument("--layers", type=cli.integer(1), default=2, help="N, for the encoder and the decoder")
    p.add_argument("--dropout", type=cli.real(0.0, 1.0, high_open=True), default=0.1, help="P_drop, in [0, 1)")
    p.add_argument("--label-smoothing", type=cli.real(0.0, 1.0, high_open=True), default=0.1,
                   help="epsilon_ls, in [0, 1)")
    p.add_argument("--warmup", type=cli.integer(1), default=200, help="warmup steps of the schedule")
    p.add_argument("--peak-lr", type=cli.real(0.0, 1.0, low_open=True),
                   help="the schedule's largest rate, at the end of --warmup (default: the paper's schedule, "
                        "which peaks at (d_model * warmup)^-0.5)")
    p.add_argument("--device", default="cpu", type=cli.device, choices=backend.DEVICES, help="where the model trains")
    p.add_argument("--seed", type=cli.integer(0), default=0, help="seeds the model, the data and the evaluation")
    p.add_argument("--log-every", type=cli.integer(1), default=100, help="print the loss every N steps")
    p.add_removed("--lr-factor", "--peak-lr (the schedule's largest rate, at the end of --warmup)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.min_len > args.max_len:
        p.error(f"--min-len {args.min_len} is above --max-len {args.max_len}")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    return args


if __name__ == "__main__":
    cli.run(lambda argv: run(parse_args(argv)))
