"""All-reduce bandwidth per message size, reported the way nccl-tests reports it.

    mpiexec -n 2 python benchmarks/allreduce.py --device cpu      MPI, NumPy buffers
    mpiexec -n 8 python benchmarks/allreduce.py --device cuda     NCCL, one GPU per rank
    python benchmarks/allreduce.py --device cuda                  NCCL on one GPU (world size 1)

It goes through ``minitransformer.distributed``'s own communicators, the ones training uses.
For a message of S bytes that takes t seconds on n ranks:

    algbw = S / t
    busbw = algbw * 2 (n - 1) / n

A ring all-reduce (reduce-scatter, then all-gather) makes each rank send and receive
2 (n - 1) / n * S bytes, so busbw is the bandwidth each link achieved: comparable across n, and
with the hardware's link bandwidth (NCCL reaches about 370-480 GB/s on 8 H200s over NVLink).
With n = 1 nothing crosses a link: busbw is 0 and algbw only times NCCL's local copy.

Timing, as nccl-tests does it: after a barrier, ``--warmup`` untimed all-reduces (they also
bring the ranks into step), then ``--iters`` all-reduces issued back to back and timed together
(CUDA events around the loop on the GPU, perf_counter on the CPU), five such groups; t is the
median group time over ``--iters``, the largest over ranks. Timing each call alone after its
own barrier would count the barrier's exit skew and, on the GPU, the host's time to issue the call (the start event
fires at once on an idle GPU), which swamp small messages. The buffer holds zeros while timed
(sums stay finite); one more all-reduce of ones then checks the result: every element is n.
On MPI, float16 and bfloat16 are reduced through a float32 copy (see ``MPICommunicator``): their
rows time twice the bytes they report, plus the two copies.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import json
import statistics
import sys
import time

import numpy as np

from minitransformer import backend, cli, files, records
from minitransformer import distributed as dist

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
# The message sizes benchmarks/records/allreduce.jsonl keeps, of those a run measures.
RECORDED = {4 << 10: "4 KiB", 64 << 10: "64 KiB", 1 << 20: "1 MiB", 4 << 20: "4 MiB", 64 << 20: "64 MiB"}


def parse_bytes(text: str) -> int:
    """'64M' -> 67108864; plain integers are bytes."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])


_AT_LEAST_ONE_BYTE = cli.integer(1)


def byte_size(text: str) -> int:
    """An argparse type: a message size of 1 byte to 2G - 1 (MPI counts are C ints), as
    ``parse_bytes`` reads it."""
    try:
        size = parse_bytes(text)
    except (ValueError, OverflowError):  # not a number, nan, inf
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (4096, 64K, 1.5M, 1G)") from None
    try:
        return _AT_LEAST_ONE_BYTE(str(size))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text}: must be from 1 byte to {_AT_LEAST_ONE_BYTE.high} (2G - 1)") from None


# The bounds, as cli.integer's carry them (a test tries every option at 0, -1, nan and inf).
byte_size.kind, byte_size.low, byte_size.high, byte_size.low_open, byte_size.high_open = (
    "integer", 1, _AT_LEAST_ONE_BYTE.high, False, False)


def time_all_reduce(comm, buf, iters: int, warmup: int, repeats: int = 5) -> float:
    """Seconds per in-place sum all-reduce of ``buf`` on this rank: the median, over
    ``repeats`` groups, of the mean of ``iters`` all-reduces issued back to back."""
    xp = backend.array_module_of(buf)
    on_gpu = xp is not np
    buf.fill(0)
    comm.barrier()
    for _ in range(warmup):
        comm.all_reduce(buf)
    groups = []
    for _ in range(repeats):
        if on_gpu:
            start, stop = xp.cuda.Event(), xp.cuda.Event()
            start.record()
            for _ in range(iters):
                comm.all_reduce(buf)
            stop.record()
            stop.synchronize()
            seconds = xp.cuda.get_elapsed_time(start, stop) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(buf)
            seconds = time.perf_counter() - t0
        groups.append(seconds / iters)
    buf.fill(1)
    comm.all_reduce(buf)
    if not bool((buf == comm.world_size).all()):
        raise RuntimeError(
            f"all-reduce of {buf.size} elements gave a wrong sum on rank {comm.rank}")
    return statistics.median(groups)


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", type=cli.device, choices=backend.DEVICES,
                    help="cpu: MPI over NumPy buffers; cuda: NCCL, one GPU per rank")
    ap.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"),
                    default="float32", help="element type of the buffer")
    ap.add_argument("--min-bytes", type=byte_size, default="4K",
                    help="first message size (bytes, or with a K, M or G suffix)")
    ap.add_argument("--max-bytes", type=byte_size, default="64M", help="largest message size")
    ap.add_argument("--factor", type=cli.integer(2), default=4, help="size multiplier between rows")
    ap.add_argument("--iters", type=cli.integer(1), default=20, help="all-reduces timed together in a group")
    ap.add_argument("--warmup", type=cli.integer(0), default=3, help="untimed all-reduces first")
    ap.add_argument("--json", type=cli.output_file, help="also write the rows to this file (rank 0)")
    ap.add_argument("--record", action="store_true",
                    help=f"append the bus bandwidth at {', '.join(RECORDED.values())} to "
                         "benchmarks/records/allreduce.jsonl")
    return ap


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.min_bytes > args.max_bytes:
        ap.error(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}: no message to time")
    sizes = [args.min_bytes]
    while sizes[-1] * args.factor <= args.max_bytes:
        sizes.append(sizes[-1] * args.factor)
    if args.record and not set(sizes) & RECORDED.keys():
        ap.error(f"--record: the record keeps {', '.join(RECORDED.values())}, and these sizes include none of them")

    world = dist.init(args.device, "nccl" if args.device == "cuda" else None)  # NCCL even alone
    comm, n = world.comm, world.world_size
    if args.record and n == 1:
        ap.error("--record: with one rank nothing crosses a link (bus bandwidth 0): run under mpiexec -n 2 or more")
    xp = backend.get_array_module(args.device)
    dtype = backend.resolve_dtype(args.dtype)
    itemsize = dtype.itemsize
    rows = []
    if world.is_main:
        print(f"# all-reduce (sum, in place), {comm.backend_name}, {n} rank(s), {args.dtype}, "
              f"median of 5 groups of {args.iters} back to back, after {args.warmup} warm-up")
        print(f"{'bytes':>12} {'elements':>11} {'time_us':>10} {'algbw_GB/s':>11} "
              f"{'busbw_GB/s':>11}")
    for size in sizes:
        count = max(1, size // itemsize)
        buf = xp.empty(count, dtype=dtype)
        t = comm.all_reduce_scalar(time_all_reduce(comm, buf, args.iters, args.warmup), "max")
        nbytes = count * itemsize
        algbw = nbytes / t / 1e9
        busbw = algbw * 2 * (n - 1) / n
        rows.append(dict(bytes=nbytes, elements=count, time_us=t * 1e6, algbw_GBps=algbw,
                         busbw_GBps=busbw))
        if world.is_main:
            print(f"{nbytes:>12} {count:>11} {t * 1e6:>10.1f} {algbw:>11.3f} {busbw:>11.3f}",
                  flush=True)
    if world.is_main and args.json:
        meta = dict(backend=comm.backend_name, world_size=n, dtype=args.dtype, iters=args.iters)
        with files.atomic_write(args.json) as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    if world.is_main and args.record:
        config = {"device": "emulated" if backend.is_emulated(args.device) else args.device, "ranks": n}
        if args.dtype != "float32":
            config["dtype"] = args.dtype
        figures = {f"GB/s at {RECORDED[r['bytes']]}": r["busbw_GBps"] for r in rows if r["bytes"] in RECORDED}
        path = records.record(__file__, sys.argv[1:] if argv is None else argv, config, figures, ranks=n)
        print(f"recorded in {path}")


if __name__ == "__main__":
    dist.run_main(cli.run, main)
