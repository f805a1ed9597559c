"""The measurements beside the paper's Table 1 (section 4, "Why Self-Attention"), for the
reading's page on it: this project's attention, one head of d = 64, against the length n.

    python docs/why_self_attention.py            # both parts, into docs/why-self-attention.json
    python docs/why_self_attention.py --counts   # one part, the other kept as it was
    python docs/why_self_attention.py --times

- counts: one forward of the fused kernel (float32, and bfloat16, the tensor cores' rung) at
  each n of COUNTED, counted on the emulated device (minitransformer.kernels.costs): the
  bytes of global memory its requests fetch, in 32-byte sectors, and its mma instructions,
  4,096 FLOPs each (m16n8k16: 16 x 8 x 16 multiply-adds). Exact and the same on every
  machine, but every access of every emulated thread is counted: a minute or two of CPU up to
  n = 256 (minutes for n = 1,024 alone), so counted once and kept; the build only reads them.
- times: the CPU time of one forward of ``F.scaled_dot_product_attention``, the composite op
  NumPy runs, on one BLAS thread, at each n of LENGTHS: the least of several runs (the one
  least disturbed by whatever else the machine ran), with the machine's name beside it.

The page's picture (docs/figures.py, why_self_attention) draws both, with the path lengths it
computes from the masks themselves.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import datetime
import json
import os
import subprocess
import sys
import time

if not any(v in os.environ for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")):
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread: the times compare lengths, not cores

import numpy as np  # noqa: E402

from minitransformer import cli, files, records  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "why-self-attention.json")
COMMAND = "python docs/why_self_attention.py"
D = 64
LENGTHS = [16, 32, 64, 128, 256, 512, 1024]
COUNTED = LENGTHS[:5]  # the emulated device's lengths: to 256, four of the kernel's tiles of 64
FLOPS_PER_MMA = 2 * 16 * 8 * 16  # mma.sync.m16n8k16: 16 x 8 x 16 multiply-adds
DTYPES = ("float32", "bfloat16")
REPEATS = 7  # forwards timed at each length; the least is kept

# One forward of each length, in one process: launch i of the log is length LENGTHS[i].
_COUNT = """
import numpy as np
from minitransformer import backend
from minitransformer.kernels import launch
cupy = backend._cupy
rng = np.random.default_rng(0)
arrays = {{n: [cupy.asarray(rng.standard_normal((1, 1, n, {d}), dtype=np.float32)).astype({dtype!r})
              for _ in range(3)] for n in {lengths}}}
with emulator.logged_launches() as log:
    for n in {lengths}:
        launch.attention_forward(*arrays[n], causal=False)
"""


def counts(dtype: str, lengths=COUNTED) -> list[dict]:
    """One forward of the fused kernel in ``dtype`` at each length, counted: global bytes (and
    the fewest their requests could take), mma instructions and the FLOPs they do."""
    from minitransformer.kernels import costs

    launches = costs.counted(_COUNT.format(d=D, dtype=dtype, lengths=list(lengths)))
    if len(launches) != len(lengths):
        raise RuntimeError(f"expected one launch per length, got {len(launches)} for {len(lengths)}")
    rows = []
    for n, launch in zip(lengths, launches):
        t = costs.rung_totals([launch])
        rows.append(dict(n=n, global_bytes=t["global_bytes"], global_ideal_bytes=t["global_ideal_bytes"],
                         mma=t["mma"], mma_flops=t["mma"] * FLOPS_PER_MMA))
    return rows


def times(lengths=LENGTHS, repeats: int = REPEATS) -> list[dict]:
    """The least CPU time, in milliseconds, of ``repeats`` forwards of the composite op at each
    length (q, k, v of shape (1, 1, n, D), float32)."""
    import minitransformer as mt
    from minitransformer import functional as F

    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        q, k, v = (mt.tensor(rng.standard_normal((1, 1, n, D), dtype=np.float32)) for _ in range(3))
        F.scaled_dot_product_attention(q, k, v)  # warm: the first call pays for allocation
        best = np.inf
        for _ in range(repeats):
            start = time.process_time()
            F.scaled_dot_product_attention(q, k, v)
            best = min(best, time.process_time() - start)
        rows.append(dict(n=n, forward_ms=round(best * 1e3, 4)))
    return rows


def commit() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


def load(path: str | None = None) -> dict:
    """The kept measurements (default: DATA), checked: every part present, one row per length,
    in order."""
    path = path or DATA
    data = json.load(open(path, encoding="utf-8"))
    for part in ("counts", "times"):
        if part not in data:
            raise ValueError(f"{path}: no {part!r} ({COMMAND})")
    for dtype in DTYPES:
        if [r["n"] for r in data["counts"]["rows"][dtype]] != data["counted"]:
            raise ValueError(f"{path}: the {dtype} counts are not one row per length ({COMMAND} --counts)")
    if [r["n"] for r in data["times"]["rows"]] != data["lengths"]:
        raise ValueError(f"{path}: the times are not one row per length ({COMMAND} --times)")
    return data


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", action="store_true", help="count on the emulated device only (minutes)")
    p.add_argument("--times", action="store_true", help="time the NumPy path only (seconds)")
    p.add_argument("--out", type=cli.output_file, default=DATA,
                   help="the JSON file, its other part kept (default: docs/why-self-attention.json)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    both = not (args.counts or args.times)
    data = json.load(open(args.out, encoding="utf-8")) if os.path.isfile(args.out) else {}
    data.update(d=D, lengths=LENGTHS, counted=COUNTED)
    stamp = dict(date=datetime.date.today().isoformat(), commit=commit())
    if both or args.times:
        data["times"] = dict(stamp, command=f"{COMMAND} --times", machine=records.machine(), repeats=REPEATS,
                             rows=times())
        print("times:", [r["forward_ms"] for r in data["times"]["rows"]], flush=True)
    if both or args.counts:
        start = time.perf_counter()
        data["counts"] = dict(stamp, command=f"{COMMAND} --counts", device="the emulated device (sm_90's tiles)",
                              rows={dtype: counts(dtype) for dtype in DTYPES})
        print(f"counts in {time.perf_counter() - start:.0f} s", flush=True)
    with files.atomic_write(args.out) as f:  # a run stopped halfway leaves the kept file whole
        f.write(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
