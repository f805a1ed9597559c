"""Time one full training step (forward, backward, Adam) of a small Transformer, and the same
step of PyTorch's ``torch.nn.Transformer`` with a matching configuration, in the same run.

    python benchmarks/train_step.py                  # d_model 256, 3+3 layers, batch 64 x 20
    python benchmarks/train_step.py --device cuda --batch 128 --len 64
    python benchmarks/train_step.py --device cuda --precision bf16     # mixed precision, both sides
    python benchmarks/train_step.py --device cuda --base --breakdown   # the scaling model's inputs
    mpiexec -n 2 python benchmarks/train_step.py     # data parallel: a rank per core, each its rows

Both models: post-norm layers, ReLU feed-forward, dropout 0.1, sinusoidal positions, one
embedding matrix shared with the output projection, label-smoothed cross-entropy, Adam.
(``torch.nn.Transformer`` also puts a final LayerNorm after each stack: 2 x d_model x 2 extra
parameters, a negligible cost.) With ``--precision bf16`` or ``fp16`` ours runs under
``minitransformer.amp`` (float32 master weights, loss scaling for fp16) and torch under
``torch.autocast`` (with its GradScaler for fp16).

``--base`` is the paper's base model at ~3,100 target tokens (one GPU's share of a 25k-token
batch on 8 GPUs). ``--breakdown`` also times our step's phases (forward and loss, backward,
gradient all-reduce through DistributedDataParallel at world size 1, Adam), which with the
gradient size are what the README's 8-GPU scaling model needs. ``--ops`` times every autograd
op's forward and backward and the optimiser apart, in ms per step: where the step's time goes.

Under ``mpiexec -n W`` the step is data parallel as in train_wmt.py: every rank trains on its
share of each batch's sentences (the same batches, split by rows), DistributedDataParallel
all-reduces the gradients, and rank 0 reports; the floor and torch still run the whole batch,
on rank 0 with all the node's cores while the other ranks wait.

Also times the step's GEMM floor (``time_gemm_floor``): the same step's matrix products alone,
the paper's model as separate per-projection products, so a step that fused some (Q, K and V
as one product) could even go below it. Prints the median step time of each, the floor, and
the ratios step / floor and ours / torch; medians, because the first steps and a busy machine
give outliers.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import minitransformer as mt
from minitransformer import backend, cli, distributed, nn, records, train
from minitransformer.amp import PRECISIONS, scaler_for
from minitransformer.autograd import Function
from minitransformer.optim import Adam, grad_norm
from minitransformer.train import accumulated_step, compute_loss


FIRST_SYMBOL = 4  # ids 0-3: padding, unknown, BOS, EOS


def batch(rng, b, t, vocab):
    src = rng.integers(FIRST_SYMBOL, vocab, (b, t))
    tgt = rng.integers(FIRST_SYMBOL, vocab, (b, t + 1))
    tgt[:, 0] = 2
    return src, tgt[:, :-1], tgt[:, 1:]


def sync(device):
    if device == "cuda":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def rows_of(world, data) -> list:
    """This rank's share of every batch: a contiguous block of its sentences."""
    share = lambda a: np.array_split(a, world.world_size)[world.rank]  # noqa: E731
    return [tuple(share(a) for a in step) for step in data]


def time_ours(args, world, data) -> list[float]:
    mt.manual_seed(0)
    cfg = nn.TransformerConfig(vocab_size=args.vocab, d_model=args.d_model, d_ff=args.d_ff, h=args.heads,
                               num_encoder_layers=args.layers, num_decoder_layers=args.layers, dropout=0.1)
    model = nn.Transformer(cfg).to(args.device)
    opt = Adam(model.parameters(), lr=1e-4)
    amp_dtype = PRECISIONS[args.precision]
    scaler = scaler_for(amp_dtype)
    ddp = distributed.DistributedDataParallel(model, world) if world.world_size > 1 else None
    data = rows_of(world, data)
    times = []
    for src, tgt_in, tgt_out in data:
        src, tgt_in, tgt_out = (mt.tensor(a, device=args.device) for a in (src, tgt_in, tgt_out))
        sync(args.device)
        world.comm.barrier()
        start = time.perf_counter()
        accumulated_step(model, opt, None, [(src, tgt_in, tgt_out)], label_smoothing=0.1, ddp=ddp,
                         amp_dtype=amp_dtype, scaler=scaler)
        sync(args.device)
        times.append(time.perf_counter() - start)
    if world.is_main:
        print(f"minitransformer: {model.num_parameters():,} parameters, {world.world_size} rank(s)")
    if args.ops:
        op_times(args, world, ddp, model, opt, amp_dtype, scaler, data)
    if args.breakdown:  # last: the DDP it adds hooks the model's gradients
        breakdown(args, world, model, opt, amp_dtype, scaler, data)
    return times


def breakdown(args, world, model, opt, amp_dtype, scaler, data) -> None:
    """Median time of each phase of a step (synchronised between phases, so their sum exceeds
    the step's time a little), with the gradients all-reduced by DDP as on 8 GPUs (world size
    1 here: NCCL's copy on a GPU, nothing on the CPU), and the bytes that all-reduce moves."""
    ddp = distributed.DistributedDataParallel(model, world)
    phases = {"forward+loss": [], "backward": [], "all-reduce (DDP)": [], "grad norm + Adam": []}
    for src, tgt_in, tgt_out in data[args.warmup:]:
        src, tgt_in, tgt_out = (mt.tensor(a, device=args.device) for a in (src, tgt_in, tgt_out))
        opt.zero_grad()
        marks = [time.perf_counter()]

        def mark():
            sync(args.device)
            marks.append(time.perf_counter())

        loss_sum, _, n = compute_loss(model, src, tgt_in, tgt_out, 0.1, amp_dtype)
        loss = loss_sum / max(n, 1)  # the per-token mean, as accumulated_step scales it alone
        mark()
        (scaler.scale(loss) if scaler else loss).backward()
        mark()
        assert ddp.reduce_gradients(1).finite  # 1: the loss is already a mean
        mark()
        if scaler:
            scaler.unscale_(opt.params)
        grad_norm(opt.params)
        opt.step()
        mark()
        for (name, times), a, b in zip(phases.items(), marks, marks[1:]):
            times.append(b - a)
    grad_mb = sum(f.nbytes for f in ddp.flats) / 2**20
    print(f"phases of our step (median of {len(data) - args.warmup}; gradient {grad_mb:,.1f} MiB in "
          f"{len(ddp.buckets)} buckets, {ddp.flats[0].dtype}):")
    for name, times in phases.items():
        print(f"  {name:18} {statistics.median(times) * 1e3:8.2f} ms")


def all_functions(cls=Function) -> list:
    """Every ``Function`` subclass defined so far (the differentiable ops)."""
    return [c for sub in cls.__subclasses__() for c in (sub, *all_functions(sub))]


def op_times(args, world, ddp, model, opt, amp_dtype, scaler, data) -> None:
    """Total time in each op's ``forward`` and ``backward`` (every ``Function``, wrapped with a
    timer for these steps only), in the gradient norm, in Adam, and in the rest (Python between
    ops, the walk, the all-reduce), in ms per step, over the steps after --warmup, on rank 0. The
    wrappers cost a few microseconds per call, charged to "the rest"."""
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a):
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                sync(args.device)
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return staticmethod(wrapper)

    originals = {}
    for fn in all_functions():
        originals[fn] = (fn.__dict__["forward"], fn.__dict__["backward"])
        fn.forward = timed(f"{fn.__name__} forward", fn.forward)
        fn.backward = timed(f"{fn.__name__} backward", fn.backward)
    opt.step = timed("Adam", opt.step).__func__
    train.grad_norm = timed("grad norm", grad_norm).__func__

    try:
        steps = data[args.warmup:]
        start = time.perf_counter()
        for src, tgt_in, tgt_out in steps:
            src, tgt_in, tgt_out = (mt.tensor(a, device=args.device) for a in (src, tgt_in, tgt_out))
            accumulated_step(model, opt, None, [(src, tgt_in, tgt_out)], label_smoothing=0.1, ddp=ddp,
                             amp_dtype=amp_dtype, scaler=scaler)
            sync(args.device)
        total = time.perf_counter() - start
    finally:
        for fn, (forward, backward) in originals.items():
            fn.forward, fn.backward = forward, backward
        del opt.step
        train.grad_norm = grad_norm
    spent["the rest (Python, all-reduce, timers)"] = total - sum(spent.values())
    if not world.is_main:
        return
    print(f"where the step's time goes (ms per step, mean of {len(steps)} steps of {total / len(steps) * 1e3:.1f} ms):")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:36} {seconds / len(steps) * 1e3:8.2f}")


def step_gemms(args, b: int, s: int, t: int) -> list[tuple[int, int, int, int]]:
    """(count, m, k, n) of every matrix product of one training step of the paper's model on a
    batch of b sentences, s source and t target tokens (padding included): ``count`` independent
    (m, k) @ (k, n) products. Each linear map is its own product (W^Q, W^K, W^V, W^O apart, as
    the paper writes them), each head's attention two (Q K^T, then P V), and the output
    projection one. Backward repeats each forward product C = A @ B twice at the same cost:
    dA = dC @ B^T and dB = A^T @ dC."""
    d, d_ff, h = args.d_model, args.d_ff, args.heads
    d_k = d // h
    forward = []

    def linear(rows, d_in, d_out):
        forward.append((1, rows, d_in, d_out))

    def attention(queries, keys):
        forward.append((b * h, queries, d_k, keys))  # Q K^T
        forward.append((b * h, queries, keys, d_k))  # P V

    for _ in range(args.layers):  # encoder
        for _ in range(4):
            linear(b * s, d, d)
        attention(s, s)
        linear(b * s, d, d_ff)
        linear(b * s, d_ff, d)
    for _ in range(args.layers):  # decoder
        for _ in range(4):
            linear(b * t, d, d)  # self-attention
        attention(t, t)
        for rows in (b * t, b * s, b * s, b * t):
            linear(rows, d, d)  # cross-attention: W^Q on the target, W^K and W^V on the memory, W^O
        attention(t, s)
        linear(b * t, d, d_ff)
        linear(b * t, d_ff, d)
    linear(b * t, d, args.vocab)  # the output projection (the shared embedding, transposed)
    d_a = [(c, m, n, k) for c, m, k, n in forward]
    d_b = [(c, k, m, n) for c, m, k, n in forward]
    return forward + d_a + d_b


def floor_dtype(args) -> np.dtype:
    """float32, or float16 under mixed precision: a GPU's tensor cores multiply bfloat16 at
    float16's rate, and float16 is the 16-bit type every CuPy and NumPy multiplies."""
    return np.dtype(np.float32 if args.precision == "fp32" else np.float16)


def time_gemm_floor(args, data) -> tuple[list[float], float]:
    """The GEMM floor of each step of ``data``: every product of ``step_gemms`` for that step's
    batch shape alone, in ``floor_dtype``, into preallocated outputs (NumPy's BLAS on the CPU,
    cuBLAS through CuPy on a GPU), one timing per pass. Returns the times after --warmup and the
    mean FLOPs of a step. What the step spends above this floor goes to everything that is not a
    matrix product (softmaxes, layernorm, dropout masks, elementwise temporaries, the optimiser,
    Python). The floor counts the paper's products: the fused attention kernel's backward also
    recomputes Q K^T, one product more per attention, which the step pays and the floor does not."""
    xp = mt.backend.get_array_module(args.device)
    rng = np.random.default_rng(1)
    dtype = floor_dtype(args)
    times, flops = [], []
    operands = {}  # by product shape, allocated outside the timing once: real batches differ in shape
    for src, tgt_in, _ in data:
        gemms = step_gemms(args, src.shape[0], src.shape[1], tgt_in.shape[1])
        for shape in set(gemms) - operands.keys():
            c, m, k, n = shape
            a, b = (xp.asarray(rng.standard_normal(dims, dtype=np.float32).astype(dtype))
                    for dims in ((c, m, k), (c, k, n)))
            operands[shape] = (a, b, xp.empty((c, m, n), dtype=dtype))
        sync(args.device)
        start = time.perf_counter()
        for shape in gemms:
            a, b, out = operands[shape]
            xp.matmul(a, b, out=out)
        sync(args.device)
        times.append(time.perf_counter() - start)
        flops.append(sum(2.0 * c * m * k * n for c, m, k, n in gemms))
    return times[args.warmup:], statistics.fmean(flops[args.warmup:])


def multi30k_batches(args) -> list:
    """The first batches of epoch 0 as train_wmt.py's multi30k preset cuts them (its BPE
    vocabulary, tokens a side and longest sentence; --max-tokens overrides the first), from the
    corpus in --data-dir; the vocabulary is read from, or trained into, --cache-dir. Sets
    ``args.vocab``."""
    from minitransformer import data

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from train_wmt import PRESETS

    preset = PRESETS["multi30k"]
    train = data.load_corpus(preset.corpus, args.data_dir, "train")
    tok = data.load_or_train(train, cache_dir=args.cache_dir, config=data.PRESETS[preset.tokenizer])
    args.vocab = tok.vocab_size
    batcher = data.TokenBatcher(data.encode_packed(tok, train.src), data.encode_packed(tok, train.tgt),
                                max_tokens=args.max_tokens or preset.max_tokens, max_len=preset.max_len, seed=1)
    batches = batcher.iter_epoch(0)
    return [(b.src, b.tgt_in, b.tgt_out) for b, _ in zip(batches, range(args.warmup + args.steps))]


def time_torch(args, data) -> list[float] | None:
    try:
        import torch
    except ImportError:
        print("torch is not installed: no peer to compare against (pip install 'minitransformer[bench]')")
        return None
    dev = "cuda" if args.device == "cuda" else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():  # a CPU-only build, or the emulated device
        print(f"torch {torch.__version__} cannot run on cuda here (a CPU-only build, or no GPU): no peer to "
              f"compare against")
        return None
    torch.manual_seed(0)

    class Peer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(args.vocab, args.d_model)
            self.core = torch.nn.Transformer(args.d_model, args.heads, args.layers, args.layers, args.d_ff,
                                             dropout=0.1, batch_first=True)
            pos = torch.arange(512)[:, None] * torch.exp(-math.log(1e4) * torch.arange(0, args.d_model, 2) / args.d_model)
            pe = torch.zeros(512, args.d_model)
            pe[:, 0::2], pe[:, 1::2] = torch.sin(pos), torch.cos(pos)
            self.register_buffer("pe", pe)
            self.drop = torch.nn.Dropout(0.1)

        def embed_(self, ids):
            return self.drop(self.embed(ids) * math.sqrt(args.d_model) + self.pe[: ids.shape[1]])

        def forward(self, src, tgt):
            causal = self.core.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
            h = self.core(self.embed_(src), self.embed_(tgt), tgt_mask=causal,
                          src_key_padding_mask=src == 0, memory_key_padding_mask=src == 0)
            return h @ self.embed.weight.T

    model = Peer().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(dev, enabled=args.precision == "fp16")
    times = []
    for src, tgt_in, tgt_out in data:
        src, tgt_in, tgt_out = (torch.as_tensor(a, device=dev) for a in (src, tgt_in, tgt_out))
        if dev == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad()
        with torch.autocast(dev, dtype=dtype, enabled=dtype is not None):
            logits = model(src, tgt_in)
            loss = loss_fn(logits.reshape(-1, args.vocab).float(), tgt_out.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(f"torch {torch.__version__}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{torch.get_num_threads()} threads")
    return times


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=cli.integer(1), default=256, help="d_model (a multiple of --heads)")
    p.add_argument("--d-ff", type=cli.integer(1), default=1024, help="inner width of the feed-forward layers")
    p.add_argument("--heads", type=cli.integer(1), default=4, help="attention heads h")
    p.add_argument("--layers", type=cli.integer(1), default=3, help="N for encoder and decoder")
    p.add_argument("--vocab", type=cli.integer(FIRST_SYMBOL + 1), default=8000,
                   help=f"joint vocabulary size (the random tokens are ids {FIRST_SYMBOL} and up)")
    p.add_argument("--batch", type=cli.integer(1), default=64, help="sentences per step")
    p.add_argument("--len", type=cli.integer(1), default=20, help="source and target tokens per sentence")
    p.add_argument("--steps", type=cli.integer(1), default=20, help="timed steps, after --warmup untimed ones")
    p.add_argument("--warmup", type=cli.integer(0), default=3, help="untimed steps first")
    p.add_argument("--device", default="cpu", type=cli.device, choices=backend.DEVICES, help="where both models run")
    p.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS),
                   help="mixed precision for both models (bf16/fp16 are meant for GPUs)")
    p.add_argument("--base", action="store_true",
                   help="the paper's base model (d_model 512, 6+6 layers, vocabulary 37,000), batch 100 x 31")
    p.add_argument("--breakdown", action="store_true", help="also time the phases of our step")
    p.add_argument("--ops", action="store_true", help="also time each op's forward and backward")
    p.add_argument("--data-dir", type=cli.data_folder, help="time real batches instead: Multi30k from this folder, cut as "
                   "train_wmt.py's multi30k preset cuts them (--batch, --len and --vocab are then ignored)")
    p.add_argument("--max-tokens", type=cli.integer(1), help="with --data-dir: tokens per step and side, all "
                   "ranks together (the preset's)")
    p.add_argument("--cache-dir", type=cli.output_folder, default="runs/multi30k", help="with --data-dir: where the BPE vocabulary "
                   "is read from or trained into (train_wmt.py's folder by default)")
    p.add_argument("--record", action="store_true", help="append the figures to benchmarks/records/train_step.jsonl")
    return p


def setup(args, parser, ranks: int) -> str:
    """The record's name for what was timed: the batches, every size that differs from the
    defaults (the sizes --data-dir ignores left out), and the processes."""
    if args.base:
        what, sizes = "the paper's base model", {}
    else:
        what = "the preset's real batches" if args.data_dir else "benchmark batch"
        ignored = ("vocab", "batch", "len") if args.data_dir else ("max_tokens",)
        sizes = {name: getattr(args, name) for name in ("d_model", "d_ff", "heads", "layers", "vocab", "batch", "len",
                                                        "max_tokens")
                 if name not in ignored and getattr(args, name) != parser.get_default(name)}
    processes = {1: "one process", 2: "two ranks"}.get(ranks, f"{ranks} ranks")
    return ", ".join([what, *(f"{name} {value}" for name, value in sizes.items()), processes])


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.base:
        args.d_model, args.d_ff, args.heads, args.layers = 512, 2048, 8, 6
        args.vocab, args.batch, args.len = 37000, 100, 31
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")

    world = distributed.init(args.device, "nccl" if args.device == "cuda" else None)
    if args.breakdown and world.world_size > 1:
        p.error("--breakdown times the phases of a one-rank step: run it without mpiexec")
    if args.data_dir:
        # Rank 0 first: it trains the BPE vocabulary if --cache-dir has none, the others load it.
        data = distributed.main_process_first(world, lambda: multi30k_batches(args))
        tokens = statistics.fmean(src.size + tgt.size for src, tgt, _ in data[args.warmup:])
        shape = f"Multi30k batches of the multi30k preset (mean {tokens:.0f} tokens, padding included)"
    else:
        rng = np.random.default_rng(0)
        data = [batch(rng, args.batch, args.len, args.vocab) for _ in range(args.warmup + args.steps)]
        shape = f"batch {args.batch} x {args.len} tokens"
    if min(len(src) for src, _, _ in data) < world.world_size:
        p.error(f"{world.world_size} ranks need at least as many sentences in every batch")
    ours = time_ours(args, world, data)[args.warmup:]
    with distributed.main_process_alone(world) as main:
        if not main:
            return
        floor, flops = time_gemm_floor(args, data)
        peer = time_torch(args, data)
    ms = statistics.median(ours) * 1e3
    floor_ms = statistics.median(floor) * 1e3
    figures = {"ours_ms": ms, "vs_gemm_floor": ms / floor_ms}
    print(f"\nstep: d_model {args.d_model}, d_ff {args.d_ff}, h {args.heads}, {args.layers}+{args.layers} layers, "
          f"vocab {args.vocab}, {shape}, {args.device}, {args.precision}, median of {args.steps}")
    print(f"  minitransformer  {ms:8.1f} ms")
    print(f"  GEMM floor       {floor_ms:8.1f} ms  ({floor_dtype(args)} products, {flops / 1e9:.1f} GFLOP a step "
          f"at {flops / floor_ms / 1e6:.0f} GFLOP/s)")
    print(f"  step / floor     {ms / floor_ms:8.2f}  (1.0: the step would be nothing but its matrix products)")
    if peer is not None:
        peer_ms = statistics.median(peer[args.warmup:]) * 1e3
        print(f"  torch            {peer_ms:8.1f} ms")
        print(f"  ratio            {ms / peer_ms:8.2f}  (minitransformer / torch; lower is better)")
        figures |= {"torch_ms": peer_ms, "time_vs_torch": ms / peer_ms}
    if args.record:
        device = "emulated" if backend.is_emulated(args.device) else args.device
        config = {"device": device, "setup": setup(args, p, world.world_size)}
        if args.precision != "fp32":
            config["precision"] = args.precision
        path = records.record(__file__, sys.argv[1:] if argv is None else argv, config, figures,
                              ranks=world.world_size)
        print(f"recorded in {path}")


if __name__ == "__main__":
    cli.run(main)
