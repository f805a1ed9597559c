"""Benchmark the hand-written kernels against the composite ops and PyTorch.

    python benchmarks/attn.py                       all sizes (GPU), or the NumPy paths (no GPU)
    python benchmarks/attn.py --quick --json out.json

On a GPU, for every sequence length (512 ... 8192), head dim (64, 128), causal or not, and
dtype (bf16, fp32):
    fused   minitransformer.kernels.attention_forward/backward (csrc/attention.cu)
    naive_cuda  minitransformer.kernels.attention_naive_forward (csrc/attention_naive.cu):
            scores, softmax and P V as three kernels through the T x T matrix in memory
            (forward only)
    tiled_cuda  minitransformer.kernels.attention_tiled_forward (csrc/attention_tiled.cu): tiles
            of scores in shared memory, a pass for the rows' maxima and one for the rest
            (forward only)
    naive   F.scaled_dot_product_attention with MINITRANSFORMER_KERNELS=0: the CuPy composite
            that materialises the T x T probabilities (bf16 runs it in fp16: CuPy lacks bf16
            arithmetic)
    torch   torch.nn.functional.scaled_dot_product_attention, when torch with CUDA is installed
with the median time of forward and of forward+backward, TFLOP/s (forward 4 B H T S D, halved
when causal; backward 2.5 x forward, FlashAttention's convention), the ratio fused/torch in
throughput, and peak memory (torch's allocator peak; for CuPy the memory pool's high-water
mark after freeing its cache). Then layernorm, softmax and the fused cross-entropy in GB/s of
their minimal traffic (each input read once, each output written once) against the measured
device-to-device copy bandwidth.

Without a GPU it times the NumPy twins (minitransformer.kernels.reference) and the NumPy
composite at small sizes, so the command always runs; those numbers say nothing about GPUs.

    python benchmarks/attn.py --emulated

runs the GPU code path above on the emulated device (MT_EMULATE_CUDA=1: CuPy as a stand-in over
NumPy, csrc/ compiled for the CPU) at tiny sizes, so that this script is known to work before a
GPU sees it. Its timings measure the emulation, nothing else.

    python benchmarks/attn.py --emulated --counts

also prints, for each dtype, head dim and mask, every fused attention kernel's memory traffic
counted in the emulator's count variant (minitransformer.kernels.costs): global requests and
their 32-byte sectors, shared requests and their wavefronts, each beside the fewest its bytes
could take, barriers and mma.sync, with the time of its pass at the counted shape, which a GPU
fills (on a GPU, --counts counts the same way and times the passes there). Then the same for
the kernel ladder of the reading's fused-attention page, a forward of each rung (naive, tiled,
fused float32, tensor cores) at one shape; the page's table is this one, from
`python benchmarks/attn.py --emulated --counts --json docs/ladder.json`.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import time

import numpy as np

if "--emulated" in sys.argv[1:]:  # read once, when minitransformer is imported
    os.environ["MT_EMULATE_CUDA"] = "1"

import minitransformer as mt  # noqa: E402
import minitransformer.functional as F
from minitransformer import backend, cli, files, kernels, records  # noqa: E402
from minitransformer.kernels import reference  # noqa: E402

# Sizes of the bandwidth cases: the copy (float32 elements), layernorm (tokens x d_model),
# softmax and the loss (positions x vocabulary).
GPU_SIZES = {"copy": 256 * 2**20, "layernorm": (65536, 1024), "softmax": (8192, 37000)}
EMULATED_SIZES = {"copy": 2**16, "layernorm": (16, 256), "softmax": (4, 1500)}
# The attention cases and repeats when not given: a GPU's, fewer repeats with --quick, and tiny
# ones with --emulated.
DEFAULTS = dict(seqs=[512, 1024, 2048, 4096, 8192], head_dims=[64, 128], tokens=16384, heads=16, repeats=10, warmup=2)
QUICK = dict(repeats=5, warmup=1)
EMULATED = dict(seqs=[40, 130], head_dims=[32, 64], tokens=130, heads=2, repeats=1, warmup=0)


def sizes(name: str) -> str:
    """The defaults of option ``name``, for its --help."""
    def said(value) -> str:
        return " ".join(map(str, value)) if isinstance(value, list) else str(value)

    alternatives = [f"--{flag} {said(table[name])}" for flag, table in (("quick", QUICK), ("emulated", EMULATED))
                    if name in table]
    return f"(default: {said(DEFAULTS[name])}" + "".join(f"; with {a}" for a in alternatives) + ")"


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=cli.integer(1), nargs="+",
                   help=f"sequence lengths T (= S) of the attention cases {sizes('seqs')}")
    p.add_argument("--head-dims", type=cli.integer(1), nargs="+", help=f"head dims d {sizes('head_dims')}")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"],
                   help="dtypes of the GPU cases")
    p.add_argument("--causal", nargs="+", default=["no", "yes"], choices=["no", "yes"],
                   help="without and/or with the causal mask")
    p.add_argument("--tokens", type=cli.integer(1),
                   help=f"batch * seq, kept constant (the batch is at least 1) {sizes('tokens')}")
    p.add_argument("--heads", type=cli.integer(1), help=f"attention heads {sizes('heads')}")
    p.add_argument("--repeats", type=cli.integer(1), help=f"timed runs of each case (their median) {sizes('repeats')}")
    p.add_argument("--warmup", type=cli.integer(0), help=f"untimed runs of each case first {sizes('warmup')}")
    p.add_argument("--naive-max-seq", type=cli.integer(0), default=8192,
                   help="skip the naive composite and the naive kernels above this length (they store B h T^2 "
                        "floats; 0: never run them)")
    p.add_argument("--quick", action="store_true", help="fewer repeats by default (for gpu_check.sh)")
    p.add_argument("--counts", action="store_true",
                   help="also count each fused attention kernel's memory traffic on the emulated device (needs g++ "
                        "and the CUDA headers), beside its pass's time on this GPU; then each rung of the kernel "
                        "ladder's")
    p.add_argument("--cpu", action="store_true", help="time the NumPy paths even if a GPU is present")
    p.add_argument("--emulated", action="store_true",
                   help="run the GPU path on the emulated device, at tiny sizes unless given (a check "
                        "of this script, not a measurement)")
    p.add_argument("--json", type=cli.output_file, help="also write the results to this file")
    p.add_argument("--record", action="store_true",
                   help="append a line per dtype and mask to benchmarks/records/attn.jsonl")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    defaults = DEFAULTS | (QUICK if args.quick else {}) | (EMULATED if args.emulated else {})
    for name, value in defaults.items():  # what the command line gave is kept
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.sizes = EMULATED_SIZES if args.emulated else GPU_SIZES
    return args


# --------------------------------------------------------------------------- timing


def median_ms(fn, repeats: int, warmup: int, sync=lambda: None) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def attention_flops(B, H, T, S, D, causal, backward):
    fwd = 4.0 * B * H * T * S * D * (0.5 if causal else 1.0)
    return fwd * 3.5 if backward else fwd


class Table:
    def __init__(self, columns):
        self.columns, self.rows = columns, []

    def add(self, **row):
        self.rows.append(row)
        print("  ".join(self._fmt(row.get(c)).rjust(max(len(c), 9)) for c in self.columns), flush=True)

    def header(self):
        print("  ".join(c.rjust(max(len(c), 9)) for c in self.columns), flush=True)

    @staticmethod
    def _fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)


# --------------------------------------------------------------------------- GPU


def to_dtype(a, dtype: str):
    """A float32 CuPy array in the kernels' dtype ("bf16" as its bits: CuPy has no bfloat16)."""
    import cupy as cp

    return {"bf16": kernels.to_bfloat16_bits, "fp16": lambda x: x.astype(cp.float16), "fp32": lambda x: x}[dtype](a)


def gpu_attention(args, results):
    import cupy as cp

    try:
        import torch
        has_torch = torch.cuda.is_available()
    except Exception:  # not installed, or a CPU-only build
        torch, has_torch = None, False
    sync = cp.cuda.Device().synchronize
    pool = cp.get_default_memory_pool()
    table = Table(["dtype", "causal", "d", "seq", "batch", "pass", "fused_ms", "fused_TF",
                   "tiled_cuda_ms", "tiled_cuda_TF", "naive_cuda_ms", "naive_cuda_TF", "naive_ms", "naive_TF",
                   "torch_ms", "torch_TF", "vs_torch", "fused_MB", "tiled_cuda_MB", "naive_cuda_MB", "naive_MB",
                   "torch_MB"])
    print("\n== attention (B * T = %d tokens, %d heads) ==" % (args.tokens, args.heads))
    table.header()
    for dtype in args.dtypes:
        for causal in (c == "yes" for c in args.causal):
            for D in args.head_dims:
                for T in args.seqs:
                    B, H = max(1, args.tokens // T), args.heads
                    rng = np.random.default_rng(0)
                    host = [rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(4)]
                    dev32 = [cp.asarray(a) for a in host]
                    q, k, v, do = (to_dtype(a, dtype) for a in dev32)
                    naive_inputs = [a.astype(cp.float32 if dtype == "fp32" else cp.float16) for a in dev32]
                    for backward in (False, True):
                        flops = attention_flops(B, H, T, T, D, causal, backward)
                        row = dict(dtype=dtype, causal="yes" if causal else "no", d=D, seq=T,
                                   batch=B, **{"pass": "fwd+bwd" if backward else "fwd"})

                        def fused():
                            o, lse = kernels.attention_forward(q, k, v, causal=causal)
                            if backward:
                                kernels.attention_backward(q, k, v, o, lse, do, causal=causal)

                        row["fused_ms"], row["fused_MB"] = _run_cupy(fused, args, sync, pool)
                        if not backward:  # forward only; no T x T array
                            row["tiled_cuda_ms"], row["tiled_cuda_MB"] = _run_cupy(
                                lambda: kernels.attention_tiled_forward(q, k, v, causal=causal), args, sync, pool)
                        if T <= args.naive_max_seq and not backward:  # forward only
                            row["naive_cuda_ms"], row["naive_cuda_MB"] = _run_cupy(
                                lambda: kernels.attention_naive_forward(q, k, v, causal=causal), args, sync, pool)
                        if T <= args.naive_max_seq:
                            row["naive_ms"], row["naive_MB"] = _run_cupy(
                                _naive_attention(naive_inputs, causal, backward), args, sync, pool)
                        if has_torch:
                            row["torch_ms"], row["torch_MB"] = _run_torch(
                                torch, host, dtype, causal, backward, args)
                        for name in ("fused", "tiled_cuda", "naive_cuda", "naive", "torch"):
                            ms = row.get(f"{name}_ms")
                            row[f"{name}_TF"] = flops / ms / 1e9 if isinstance(ms, float) else None
                        if isinstance(row.get("torch_ms"), float) and isinstance(row.get("fused_ms"), float):
                            row["vs_torch"] = row["torch_ms"] / row["fused_ms"]
                        table.add(**row)
                        results["attention"].append(row)
                    pool.free_all_blocks()


def _run_cupy(fn, args, sync, pool):
    import cupy as cp

    try:
        sync()
        pool.free_all_blocks()
        base = pool.used_bytes()  # the inputs
        fn()
        sync()
        # The pool now caches every block the run allocated: what it needed at most at once.
        peak = (pool.total_bytes() - base) / 2**20
        return median_ms(fn, args.repeats, args.warmup, sync), peak
    except cp.cuda.memory.OutOfMemoryError:
        pool.free_all_blocks()
        return "oom", None


def _naive_attention(arrays, causal, backward):
    def run():
        os.environ["MINITRANSFORMER_KERNELS"] = "0"
        try:
            q, k, v = (mt.Tensor(a, requires_grad=backward) for a in arrays[:3])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if backward:
                out.backward(arrays[3])
        finally:
            del os.environ["MINITRANSFORMER_KERNELS"]
    return run


def _run_torch(torch, host, dtype, causal, backward, args):
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    q, k, v, do = (torch.tensor(a, device="cuda", dtype=tdt, requires_grad=i < 3)
                   for i, a in enumerate(host))

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if backward:
            out.backward(do)

    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        return median_ms(run, args.repeats, args.warmup, torch.cuda.synchronize), peak
    except torch.cuda.OutOfMemoryError:
        return "oom", None
    finally:
        torch.cuda.empty_cache()


def counted_attention(args, results):
    """Each fused attention kernel's memory traffic, counted in the emulator's count variant
    (minitransformer.kernels.costs) at one small shape per dtype, head dim and mask, beside the
    time of its pass at that shape, which only a GPU fills: sectors (of 32 bytes) of its global
    requests and wavefronts of its shared ones, each with the fewest its bytes could take."""
    from minitransformer.kernels import costs
    from minitransformer.kernels.resources import kernel_name

    B, H, T = (costs.SHAPE[k] for k in "BHT")
    table = Table(["dtype", "causal", "d", "kernel", "gl_req", "sectors", "ideal", "sh_req", "wavefronts",
                   "ideal_wf", "barriers", "mma", "pass_ms"])
    print(f"\n== attention kernels' memory traffic, counted on the emulated device (B={B}, H={H}, T={T}) ==")
    table.header()
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    for dtype in args.dtypes:
        for causal in (c == "yes" for c in args.causal):
            for D in args.head_dims:
                times = {} if args.emulated else _pass_times(dtype, B, H, T, D, causal, args)
                for launch in costs.attention(names[dtype], D, causal):
                    name = kernel_name(launch.kernel)
                    g, sh = launch.total(*costs.emulator.GLOBAL_KINDS), launch.total(*costs.emulator.SHARED_KINDS)
                    row = dict(dtype=dtype, causal="yes" if causal else "no", d=D, kernel=name.split("<")[0],
                               gl_req=g.requests, sectors=g.units, ideal=g.ideal, sh_req=sh.requests,
                               wavefronts=sh.units, ideal_wf=sh.ideal, barriers=launch.total("barrier").requests,
                               mma=launch.total("mma").requests,
                               pass_ms=times.get("forward" if "forward" in name else "backward"))
                    table.add(**row)
                    kinds = {kind: {f: getattr(c, f) for f in ("requests", "units", "ideal")}
                             for kind in costs.emulator.KINDS if (c := launch.total(kind)).requests}
                    results["counts"].append(row | {"instance": name, "shape": dict(B=B, H=H, T=T), "kinds": kinds})


def counted_ladder(args, results):
    """The kernel ladder's rungs (costs.LADDER: naive, tiled, fused float32, tensor cores), a
    forward each at costs.LADDER_SHAPE, counted as counted_attention counts, beside its time
    there, which only a GPU fills: the reading's fused-attention page shows this table."""
    from minitransformer.kernels import costs
    from minitransformer.kernels.resources import kernel_name

    shape = costs.LADDER_SHAPE
    table = Table(["rung", "dtype", "launches", "global_KB", "ideal_KB", "sh_req", "wavefronts", "ideal_wf",
                   "barriers", "mma", "fwd_ms"])
    print(f"\n== the kernel ladder, a forward of each rung counted on the emulated device "
          f"({', '.join(f'{k}={v}' for k, v in shape.items())}) ==")
    table.header()
    for rung, dtype, launches in costs.ladder():
        t = costs.rung_totals(launches)
        ms = None if args.emulated else _rung_time(rung, dtype, args)
        row = dict(rung=rung, dtype=dtype, launches=t["launches"], global_KB=t["global_bytes"] / 1024,
                   ideal_KB=t["global_ideal_bytes"] / 1024, sh_req=t["shared_requests"], wavefronts=t["wavefronts"],
                   ideal_wf=t["ideal_wavefronts"], barriers=t["barriers"], mma=t["mma"], fwd_ms=ms)
        table.add(**row)
        results["ladder"].append(row | {"kernels": [kernel_name(launch.kernel) for launch in launches],
                                        "shape": shape, "totals": t})


def _rung_time(rung, dtype, args) -> float:
    """Median milliseconds of one rung's forward at the ladder's shape (GPU)."""
    import cupy as cp

    from minitransformer.kernels import costs

    B, H, T, D = (costs.LADDER_SHAPE[k] for k in "BHTD")
    rng = np.random.default_rng(0)
    q, k, v = (to_dtype(cp.asarray(rng.standard_normal((B, H, T, D), dtype=np.float32)),
                        {"float32": "fp32", "bfloat16": "bf16"}[dtype]) for _ in range(3))
    forward = {"naive": kernels.attention_naive_forward, "tiled": kernels.attention_tiled_forward}.get(
        rung, kernels.attention_forward)
    return median_ms(lambda: forward(q, k, v), args.repeats, args.warmup, cp.cuda.Device().synchronize)


def case_arrays(dtype, B, H, T, D):
    """q, k, v and dO of one counted case, standard normal in the kernels' dtype (GPU)."""
    import cupy as cp

    rng = np.random.default_rng(0)
    return [to_dtype(cp.asarray(rng.standard_normal((B, H, T, D), dtype=np.float32)), dtype) for _ in range(4)]


def _pass_times(dtype, B, H, T, D, causal, args) -> dict[str, float]:
    """Median milliseconds of the fused forward and of the backward alone at one shape (GPU)."""
    import cupy as cp

    q, k, v, do = case_arrays(dtype, B, H, T, D)
    sync = cp.cuda.Device().synchronize
    o, lse = kernels.attention_forward(q, k, v, causal=causal)
    return {"forward": median_ms(lambda: kernels.attention_forward(q, k, v, causal=causal), args.repeats,
                                 args.warmup, sync),
            "backward": median_ms(lambda: kernels.attention_backward(q, k, v, o, lse, do, causal=causal),
                                  args.repeats, args.warmup, sync)}


def gpu_bandwidth(args, results):
    import cupy as cp

    sync = cp.cuda.Device().synchronize
    n = args.sizes["copy"]
    src, dst = cp.ones(n, dtype=cp.float32), cp.empty(n, dtype=cp.float32)
    ms = median_ms(lambda: cp.copyto(dst, src), args.repeats, args.warmup, sync)
    copy = 2 * n * 4 / ms / 1e6  # GB/s: read + write
    print(f"\n== bandwidth (device-to-device copy: {copy:.0f} GB/s) ==")
    results["copy_GBps"] = copy
    table = Table(["kernel", "dtype", "rows", "cols", "ms", "GBps", "of_copy"])
    table.header()
    for dtype in args.dtypes:
        conv = functools.partial(to_dtype, dtype=dtype)
        size = 2 if dtype != "fp32" else 4
        cases = []
        N, D = args.sizes["layernorm"]
        x, g = conv(cp.random.standard_normal((N, D), dtype=cp.float32)), conv(cp.random.standard_normal((N, D), dtype=cp.float32))
        w, b = conv(cp.ones(D, dtype=cp.float32)), conv(cp.zeros(D, dtype=cp.float32))
        _, mean, rstd = kernels.layernorm_forward(x, w, b)
        cases.append(("layernorm_fwd", N, D, lambda: kernels.layernorm_forward(x, w, b), 2 * N * D * size))
        cases.append(("layernorm_bwd", N, D, lambda: kernels.layernorm_backward(x, w, mean, rstd, g),
                      3 * N * D * size))
        Ns, V = args.sizes["softmax"]
        z = conv(cp.random.standard_normal((Ns, V), dtype=cp.float32))
        t = cp.random.randint(0, V, Ns)
        y = kernels.softmax_forward(z)
        cases.append(("softmax_fwd", Ns, V, lambda: kernels.softmax_forward(z), 2 * Ns * V * size))
        cases.append(("softmax_bwd", Ns, V, lambda: kernels.softmax_backward(y, z), 3 * Ns * V * size))
        cases.append(("xent_fwd+grad", Ns, V, lambda: kernels.cross_entropy_forward(z, t, 0.1),
                      2 * Ns * V * size))
        for name, rows, cols, fn, nbytes in cases:
            ms = median_ms(fn, args.repeats, args.warmup, sync)
            row = dict(kernel=name, dtype=dtype, rows=rows, cols=cols, ms=ms,
                       GBps=nbytes / ms / 1e6, of_copy=nbytes / ms / 1e6 / copy)
            table.add(**row)
            results["bandwidth"].append(row)
        cp.get_default_memory_pool().free_all_blocks()


# --------------------------------------------------------------------------- the record


def record(argv: list[str], results: dict) -> None:
    """A line of benchmarks/records/attn.jsonl for each dtype and mask run, over its cases
    (sequence length x head dim, forward and backward together, what a training step pays):
    on a GPU (or the emulated one), the median over the cases of PyTorch SDPA's time over our
    fused kernels' (where torch ran) and the fused kernels' best TFLOP/s; with --counts, the
    fused kernels' global sectors and shared wavefronts over the fewest their bytes could take,
    summed over the head dims and both passes; on the CPU, the median of the NumPy composite's
    time over the NumPy twin's."""
    device = {"gpu": "cuda", "cpu": "cpu"}.get(results["device"], "emulated")
    lines: dict[tuple[str, str], list[dict]] = {}
    for row in results["attention"]:
        if row["pass"] == "fwd+bwd":
            lines.setdefault((row.get("dtype", "fp32"), row["causal"]), []).append(row)
    for (dtype, causal), rows in lines.items():
        if device == "cpu":
            ms = {(r["d"], r["seq"], r["path"]): r["ms"] for r in rows}
            cases = {(d, seq) for d, seq, _ in ms}
            figures = {"twin_speed_vs_composite": statistics.median(ms[(*c, "composite")] / ms[(*c, "twin")]
                                                                    for c in cases)}
        else:
            cases = rows
            ratios = [r["vs_torch"] for r in rows if "vs_torch" in r]
            tflops = [r["fused_TF"] for r in rows if r["fused_TF"] is not None]
            figures = ({"speed_vs_torch": statistics.median(ratios)} if ratios else {}) | (
                {"tflops_max": max(tflops)} if tflops else {})
            counted = [r for r in results["counts"] if (r["dtype"], r["causal"]) == (dtype, causal)]
            if counted:
                for key, units, fewest in (("global_sectors_vs_fewest", "sectors", "ideal"),
                                           ("shared_wavefronts_vs_fewest", "wavefronts", "ideal_wf")):
                    figures[key] = sum(r[units] for r in counted) / sum(r[fewest] for r in counted)
        figures["cases"] = len(cases)
        path = records.record(__file__, argv, {"device": device, "dtype": dtype, "causal": causal}, figures)
    print(f"recorded {len(lines)} line(s) in {path}")


# --------------------------------------------------------------------------- CPU


def cpu_paths(args, results):
    print("No GPU (or --cpu): timing the NumPy twins and the NumPy composite at small sizes.\n"
          "These figures describe this CPU, not the kernels.")
    table = Table(["path", "causal", "d", "seq", "batch", "pass", "ms"])
    table.header()
    for causal in (c == "yes" for c in args.causal):
        for D in args.head_dims:
            for T in (128, 256):
                B, H = 1, 4
                rng = np.random.default_rng(0)
                q, k, v, do = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(4))

                def twin():
                    o, lse = reference.attention_forward(q, k, v, causal=causal)
                    reference.attention_backward(q, k, v, o, lse, do, causal=causal)

                def composite():
                    tq, tk, tv = (mt.tensor(a, requires_grad=True) for a in (q, k, v))
                    F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).backward(do)

                for name, fn in (("twin", twin), ("composite", composite)):
                    row = dict(path=name, causal="yes" if causal else "no", d=D, seq=T, batch=B,
                               ms=median_ms(fn, 3, 1), **{"pass": "fwd+bwd"})
                    table.add(**row)
                    results["attention"].append(row)
    x = np.random.default_rng(1).standard_normal((4096, 512)).astype(np.float32)
    for name, fn in (("layernorm twin", lambda: reference.layernorm_forward(x)),
                     ("softmax twin", lambda: reference.softmax_forward(x))):
        row = dict(path=name, seq=4096, d=512, ms=median_ms(fn, 3, 1), **{"pass": "fwd"})
        table.add(**row)
        results["bandwidth"].append(row)


def main(argv=None):
    args = parse_args(argv)
    on_gpu = kernels.available() and not args.cpu
    if args.emulated and not backend.is_emulated("cuda"):
        sys.exit("--emulated: the emulated device did not load (is MT_EMULATE_CUDA=0 set?)")
    device = ("gpu (EMULATED on the CPU)" if args.emulated else "gpu") if on_gpu else "cpu"
    results = {"device": device, "attention": [], "bandwidth": [], "counts": [], "ladder": []}
    # gpu_check.sh stops a slow run with `timeout` (SIGTERM): exit through the finally below, so
    # that the rows measured so far still reach the JSON file (also when a later case raises).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if on_gpu:
            import cupy as cp

            props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
            results["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            print(f"GPU: {results['gpu']}")
            if args.emulated:
                print("EMULATED: the GPU code path at tiny sizes on the CPU; the timings measure "
                      "the emulation, not a GPU")
            gpu_attention(args, results)
            gpu_bandwidth(args, results)
            if args.counts:
                from minitransformer.emulated import emulator

                reason = emulator.unavailable_reason("count")
                if reason:
                    print(f"\n(no counts: {reason})")
                else:
                    counted_attention(args, results)
                    counted_ladder(args, results)
        else:
            if not args.cpu:
                print(f"CUDA kernels unavailable: {kernels.unavailable_reason()}")
            cpu_paths(args, results)
    finally:
        if args.json:
            with files.atomic_write(args.json) as f:
                json.dump(results, f, indent=1, default=str)
    if args.record:
        record(sys.argv[1:] if argv is None else argv, results)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
