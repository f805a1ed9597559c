"""The program each rank runs in the multi-process tests: ``mpiexec -n N python mpi_worker.py
SCENARIO OUT_DIR SEED --world-size N [options]``. Each rank writes what it saw to OUT_DIR/rank<r>.npz; the
tests in this folder compare those files with a single-process reference.

Every scenario runs on ``--device cpu`` (MPI) or ``cuda`` (NCCL; without a GPU, on the emulated
device, whose NCCL is carried over MPI: minitransformer/emulated/nccl.py).

Scenarios:
    collectives   all_reduce (sync, async; sum, max, min) of float32/float64/int64/float16 (and
                  bfloat16, saved as float32) buffers of odd sizes, broadcast from rank 1,
                  all_reduce_scalar, barrier
    train         a two-layer MLP trained for a few SGD steps with DistributedDataParallel,
                  each rank on batches of its own size (one rank's may be empty), recording
                  the order in which the gradient buckets were all-reduced
    state         a model with a frozen parameter and buffers that differ per rank: DDP's
                  broadcast must make them rank 0's
    nccl_ids      (cuda) each rank makes its own NCCL unique id instead of receiving rank 0's:
                  the communicator must refuse, on every rank
    raise         rank 1 raises while rank 0 waits in a collective
    exit          rank 1 calls sys.exit (inside distributed.run_main) while rank 0 waits
    interrupt     rank 0 waits in an all_reduce and a broadcast that rank 1 never joins, and
                  Ctrl-C reaches it there: it writes OUT_DIR/interrupted<k> for each
    accumulate    one optimiser step of train.accumulated_step over three micro-batches, each
                  rank on its share of every micro-batch's sentences (none for one of fewer
                  sentences than ranks): a float64 Transformer without dropout
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import numpy as np

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import backend, nn
from minitransformer import distributed as dist
from minitransformer.optim import Adam
from minitransformer.train import accumulated_step
from tests.helpers import micro_batches

PAD = -100  # ignore_index of the padded target positions
SIZES = (1, 3, 17, 1001, 65537)
DTYPES = ("float32", "float64", "int64", "float16") + (("bfloat16",) if backend.bfloat16 else ())
D_IN, HIDDEN, CLASSES = 7, 11, 5


def rank_input(seed: int, rank: int, size: int, dtype: str) -> np.ndarray:
    """The buffer rank ``rank`` contributes in the collectives scenario (the tests rebuild it)."""
    rng = np.random.default_rng([seed, rank, size, DTYPES.index(dtype)])
    if dtype == "int64":
        return rng.integers(-1000, 1000, size)
    return rng.standard_normal(size).astype(backend.resolve_dtype(dtype))


def init_params(seed: int) -> list[np.ndarray]:
    """Weights of the MLP; ranks start from different ones, which the broadcast must fix."""
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((D_IN, HIDDEN)) / np.sqrt(D_IN)).astype(np.float32),
        (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        (rng.standard_normal((HIDDEN, CLASSES)) / np.sqrt(HIDDEN)).astype(np.float32),
        (0.1 * rng.standard_normal(CLASSES)).astype(np.float32),
        (0.1 * rng.standard_normal(CLASSES)).astype(np.float32),  # "extra": see mlp_loss
    ]


EMPTY_STEP = 1  # the step at which --empty-rank has no batch


def batch(seed: int, step: int, rank: int, empty_rank: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s batch at ``step``: a different number of positions and of padded ones;
    none at all for ``empty_rank`` at EMPTY_STEP (a rank whose share of the data ran out)."""
    rng = np.random.default_rng([seed, step, rank, 7])
    if rank == empty_rank and step == EMPTY_STEP:
        return np.zeros((0, D_IN), np.float32), np.zeros(0, np.int64)
    n = int(rng.integers(3, 14))
    x = rng.standard_normal((n, D_IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, n)
    y[rng.random(n) < 0.3] = PAD
    y[0] = int(rng.integers(0, CLASSES))  # at least one real token
    return x, y


def mlp_loss(params, x, y, extra_rows, reduction: str):
    """Cross-entropy of a ReLU MLP. The last parameter is added to the logits of the rows where
    ``extra_rows`` (n,) is 1; with ``extra_rows=None`` it is not in the graph at all, the way a
    rank that takes another branch never produces that parameter's gradient."""
    w1, b1, w2, b2, extra = params
    device = w1.device
    logits = F.linear(F.linear(mt.tensor(x, device=device), w1, b1).relu(), w2, b2)  # (n, CLASSES)
    if extra_rows is not None:
        logits = logits + extra * mt.tensor(extra_rows[:, None].astype(np.float32), device=device)
    return F.cross_entropy(logits, mt.tensor(y, device=device), ignore_index=PAD, reduction=reduction)


def collectives(world, seed: int) -> dict:
    comm, out = world.comm, {}
    xp = backend.get_array_module(world.device)
    for dtype in DTYPES:
        for size in SIZES:
            key = f"{dtype}_{size}"
            buf = xp.asarray(rank_input(seed, world.rank, size, dtype))
            comm.all_reduce(buf)
            out[f"sum_{key}"] = buf
            buf = xp.asarray(rank_input(seed, world.rank, size, dtype))
            comm.all_reduce_async(buf, "max").wait()
            out[f"max_{key}"] = buf
            buf = xp.asarray(rank_input(seed, world.rank, size, dtype))
            comm.all_reduce(buf, "min")
            out[f"min_{key}"] = buf
            buf = xp.asarray(rank_input(seed, world.rank, size, dtype))
            comm.broadcast(buf, root=1)
            out[f"bcast_{key}"] = buf
    out = {key: backend.to_device(buf, "cpu") for key, buf in out.items()}
    if backend.bfloat16 is not None:  # np.savez cannot store bfloat16: saved as float32, exactly
        for key in [k for k in out if k.endswith(tuple(f"bfloat16_{n}" for n in SIZES))]:
            out[key] = out[key].astype(np.float32)
    comm.barrier()
    out["scalar_sum"] = comm.all_reduce_scalar(world.rank + 1)
    out["scalar_min"] = comm.all_reduce_scalar(10 + world.rank, "min")
    out["flag_max"] = comm.all_reduce_scalar(world.rank == 1, "max")
    out["float_sum"] = comm.all_reduce_scalar(0.25 * (world.rank + 1))
    return out


def train(world, seed: int, args) -> dict:
    params = [mt.tensor(a, requires_grad=True, device=world.device)
              for a in init_params(seed + 1000 * world.rank)]
    ddp = dist.DistributedDataParallel(params, world, bucket_bytes=args.bucket_bytes,
                                       overlap=bool(args.overlap))
    out = {f"init_{i}": p.numpy().copy() for i, p in enumerate(params)}
    finite, tokens, launched = [], [], []
    order = []  # (step, first element) of each gradient bucket's all-reduce, in issue order
    flat, start_all_reduce = ddp.flats[0], world.comm.all_reduce_async

    def recording_all_reduce(buf, op="sum"):
        if buf.dtype == flat.dtype and 0 <= address(buf) - address(flat) < flat.nbytes:
            order.append((step, (address(buf) - address(flat)) // flat.itemsize))
        return start_all_reduce(buf, op)

    world.comm.all_reduce_async = recording_all_reduce
    for step in range(args.steps):
        x, y = batch(seed, step, world.rank, args.empty_rank)
        if step == args.nan_step and world.rank == 1:
            x[0, 0] = np.nan
        n_tokens = int((y != PAD).sum())
        unused = args.unused_on_rank1 and world.rank == 1
        loss = mlp_loss(params, x, y, None if unused else np.ones(len(y)), reduction="sum")
        loss.backward()
        launched.append(ddp.launched_buckets)
        stats = ddp.reduce_gradients(n_tokens, loss)
        if stats.finite:
            for p in params:
                p.data -= args.lr * p.grad.data
        for p in params:
            p.grad = None
        finite.append(stats.finite)
        tokens.append(stats.num_tokens)
    out.update({f"final_{i}": p.numpy() for i, p in enumerate(params)})
    out.update(finite=np.array(finite), tokens=np.array(tokens), launched=np.array(launched),
               n_buckets=len(ddp.buckets), bucket_starts=np.array([b.start for b in ddp.buckets]),
               order=np.array(order).reshape(-1, 2))
    return out


ACCUMULATION_CONFIG = dict(vocab_size=17, d_model=16, d_ff=32, h=2, num_encoder_layers=1,
                           num_decoder_layers=1, dropout=0.0)


def accumulation_model(seed: int, device: str):
    """(model, Adam): the float64 Transformer of the accumulate scenario, seeded."""
    mt.manual_seed(seed)
    model = nn.Transformer(nn.TransformerConfig(**ACCUMULATION_CONFIG))
    for p in model.parameters():
        p.data = p.data.astype(np.float64)
    return model.to(device), Adam(model.parameters(), lr=1e-3)


def accumulate(world, seed: int) -> dict:
    model, optimizer = accumulation_model(seed, world.device)
    ddp = dist.DistributedDataParallel(model, world)
    shares = []
    for batch in micro_batches(seed):
        rows = np.array_split(np.arange(len(batch[0])), world.world_size)[world.rank]
        shares.append(tuple(mt.tensor(a[rows], device=world.device) for a in batch) if len(rows) else None)
    all_reduces, start_all_reduce = [], world.comm.all_reduce_async  # of the gradients' buckets

    def recording_all_reduce(buf, op="sum"):
        if any(0 <= address(buf) - address(flat) < flat.nbytes for flat in ddp.flats):
            all_reduces.append(buf.size)
        return start_all_reduce(buf, op)

    world.comm.all_reduce_async = recording_all_reduce
    result = accumulated_step(model, optimizer, None, shares, label_smoothing=0.1, ddp=ddp)
    out = {f"grad_{i}": p.grad.numpy() for i, p in enumerate(model.parameters())}
    return out | {"loss": result.loss, "tokens": result.num_tokens, "skipped": str(result.skipped),
                  "all_reduced": sum(all_reduces), "gradients": sum(f.size for f in ddp.flats)}


def address(a) -> int:
    """Where a NumPy or CuPy array's first element is."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def state(world, seed: int) -> dict:
    model = nn.Linear(3, 2)
    rng = np.random.default_rng([seed, world.rank])
    model.weight.data = rng.standard_normal((3, 2)).astype(np.float32)
    model.bias.data = rng.standard_normal(2).astype(np.float32)
    model.bias.requires_grad_(False)  # frozen
    model.register_buffer("stat", mt.tensor(rng.standard_normal(4).astype(np.float32)))
    model.register_buffer("flags", mt.tensor(rng.random(9) < 0.5))  # no reduction type: sent as bytes
    model.to(world.device)
    dist.DistributedDataParallel(model, world)
    return {name: getattr(model, name).numpy() for name in ("weight", "bias", "stat", "flags")}


def nccl_ids(world) -> dict:
    from minitransformer.distributed.comm import import_nccl

    nccl = import_nccl()
    try:
        nccl.NcclCommunicator(world.world_size, nccl.get_unique_id(), world.rank)
    except Exception as e:  # what a real NCCL does here is hang; the emulation says so
        return {"error": str(e)}
    return {"error": ""}


def blas_threads(world) -> dict:
    from threadpoolctl import threadpool_info

    threads = lambda: [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]  # noqa: E731
    with dist.main_process_alone(world) as main:
        alone = threads()
    return {"threads": threads(), "alone": alone, "main": main, "cores": len(os.sched_getaffinity(0))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=("collectives", "train", "state", "nccl_ids", "blas_threads", "raise",
                                               "exit", "interrupt", "accumulate"))
    ap.add_argument("out_dir")
    ap.add_argument("seed", type=int)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--bucket-bytes", type=int, default=dist.DEFAULT_BUCKET_BYTES)
    ap.add_argument("--overlap", type=int, default=1)
    ap.add_argument("--nan-step", type=int, default=-1)
    ap.add_argument("--unused-on-rank1", type=int, default=0)
    ap.add_argument("--empty-rank", type=int, default=-1)
    args = ap.parse_args()

    world = dist.init(args.device)
    if world.world_size != args.world_size:  # e.g. an mpiexec from another MPI than mpi4py's
        sys.exit(f"expected {args.world_size} ranks, got world size {world.world_size}")
    expected = {"cpu": "mpi", "cuda": "nccl"}[args.device]
    if world.comm.backend_name != expected:
        sys.exit(f"expected the {expected} communicator on {args.device}, got {world.comm.backend_name}")
    if args.scenario == "raise":
        world.comm.barrier()
        if world.rank == 1:
            raise ValueError("boom from rank 1")
        world.comm.barrier()  # rank 0 would wait here forever without the abort
        return
    if args.scenario == "exit":
        world.comm.barrier()
        if world.rank == 1:
            sys.exit("rank 1 gives up")  # SystemExit: sys.excepthook never sees it
        world.comm.barrier()
        return
    if args.scenario == "interrupt":
        world.comm.barrier()
        if world.rank == 1:
            time.sleep(60)  # ended by rank 0's MPI_Abort (run_main), or by the test's timeout
        for k, collective in enumerate((world.comm.all_reduce, lambda buf: world.comm.broadcast(buf, root=1))):
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            try:
                collective(np.zeros(3))
            except KeyboardInterrupt:
                open(os.path.join(args.out_dir, f"interrupted{k}"), "w").close()
        sys.exit(130)  # as cli.run ends an interrupted program
    if args.scenario == "collectives":
        out = collectives(world, args.seed)
    elif args.scenario == "state":
        out = state(world, args.seed)
    elif args.scenario == "nccl_ids":
        out = nccl_ids(world)
    elif args.scenario == "blas_threads":
        out = blas_threads(world)
    elif args.scenario == "accumulate":
        out = accumulate(world, args.seed)
    else:
        out = train(world, args.seed, args)
    np.savez(os.path.join(args.out_dir, f"rank{world.rank}.npz"), **out)


if __name__ == "__main__":
    dist.run_main(main)
