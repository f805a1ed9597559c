"""Nsight Compute's counts of the fused attention kernels beside the emulator's: on a GPU, the
check of the prediction that `attn.py --counts` made without one.

    python benchmarks/attn.py --counts --json counts.json     # the emulator's counts (and times)
    python tools/kernels/ncu_counts.py --counts counts.json --json ncu.json

For each case of counts.json (dtype, head dim, mask), one forward and one backward at the
counted shape run under `ncu`, which collects, for every launch, the metrics of each kind the
emulator counts (minitransformer.emulated.emulator.KINDS): global requests and their 32-byte
sectors (loads, stores, atomics, cp.async's reads), shared-memory requests and their
wavefronts (loads, stores, ldmatrix, cp.async's writes), barriers and mma instructions. The
table puts each kind's two figures side by side, launch by launch, with the ratio of
Nsight Compute's to the emulator's. A ratio of 1 is a prediction held; another is where nvcc
chose an access width other than the source's (two 64-bit loads for one 128-bit, say), or
where the model of the hardware in emu.h is wrong: either is worth reading in the source.

The emulator counts at the tiles the launchers choose on sm_90, so the figures compare on an
H100 or H200; on another architecture the launchers may choose other tiles (the table says
which GPU ran). A metric this ncu does not know is left out and named, not fatal: metric names
move between Nsight Compute versions.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import csv
import json
import os
import re
import subprocess
import sys

import minitransformer as mt  # noqa: F401 - the backend, before attn's imports
from minitransformer import cli, files, kernels

# Nsight Compute's metrics for each kind the emulator counts: (requests, units), each summed
# over the names given; units are sectors for the global kinds, wavefronts for the shared
# ones, and none for barriers and mma (one unit a request). Requests are warp-level
# instructions for the shared kinds, barriers and mma, L1 requests for the global ones.
METRICS = {
    "global load": (["l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"],
                    ["l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"]),
    "global store": (["l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"],
                     ["l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum"]),
    "global atomic": (["l1tex__t_requests_pipe_lsu_mem_global_op_atom.sum",
                       "l1tex__t_requests_pipe_lsu_mem_global_op_red.sum"],
                      ["l1tex__t_sectors_pipe_lsu_mem_global_op_atom.sum",
                       "l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum"]),
    "cp.async read": (["l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum"],
                      ["l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum"]),
    "shared load": (["smsp__inst_executed_op_shared_ld.sum"],
                    ["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"]),
    "shared store": (["smsp__inst_executed_op_shared_st.sum"],
                     ["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"]),
    "ldmatrix": (["smsp__inst_executed_op_ldsm.sum"],
                 ["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum"]),
    "cp.async write": (["smsp__inst_executed_op_ldgsts.sum"],
                       ["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum"]),
    "barrier": (["smsp__inst_executed_op_barrier.sum"], []),
    "mma": (["smsp__inst_executed_pipe_tensor_op_hmma.sum"], []),
}
ALL_METRICS = list(dict.fromkeys(name for pair in METRICS.values() for names in pair for name in names))


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", type=cli.input_file,
                   help="the JSON file of `python benchmarks/attn.py --counts --json FILE` (required)")
    p.add_argument("--ncu", default="ncu", help="the Nsight Compute command (default: ncu on the PATH)")
    p.add_argument("--json", type=cli.output_file, help="also write the comparison to this file")
    p.add_argument("--launch", nargs=3, metavar=("DTYPE", "D", "CAUSAL"),
                   help="(what ncu runs) one forward and backward of a case at the counted shape, and exit")
    return p


def launch_case(dtype: str, D: int, causal: bool) -> None:
    """One forward and one backward of the fused attention at costs.SHAPE, as costs.attention
    counts them, with attn.py's inputs."""
    import cupy as cp

    from minitransformer.kernels import costs

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    from attn import case_arrays

    q, k, v, do = case_arrays(dtype, *(costs.SHAPE[x] for x in "BHT"), D)
    o, lse = kernels.attention_forward(q, k, v, causal=causal)
    kernels.attention_backward(q, k, v, o, lse, do, causal=causal)
    cp.cuda.Device().synchronize()


class NcuError(RuntimeError):
    """What ncu or the counts file gave that cannot be compared: told in one line (cli.run)."""


def parse_raw_csv(text: str) -> list[dict[str, str]]:
    """The launches of `ncu --csv --page raw` output: a row each, by column name. ncu's own lines
    (==PROF==) come first; the row after the header gives units and has no ID."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise NcuError("ncu printed no table (no line starting with \"ID\")")
    return [row for row in csv.DictReader(lines[start:]) if row["ID"].strip().isdigit()]


def value(row: dict[str, str], metric: str) -> float | None:
    text = row.get(metric, "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:  # "n/a", or not collected
        return None


def profile(ncu: str, case: tuple[str, str, int], kernel_names: list[str], metrics: list[str]):
    """(one row of metrics for each launch of ``kernel_names``' kernels, in launch order; the
    metrics ncu refused) for one case, run under ncu. A refused metric is dropped and ncu run
    again without it."""
    dtype, causal, D = case
    refused: list[str] = []
    while True:
        wanted = [m for m in metrics if m not in refused]
        command = [ncu, "--csv", "--page", "raw", "--print-units", "base", "--print-metric-name", "name",
                   "--kernel-name-base", "function",
                   "-k", "regex:" + "|".join(dict.fromkeys(kernel_names)), "--metrics", ",".join(wanted),
                   sys.executable, os.path.abspath(__file__), "--launch", dtype, str(D), causal]
        done = subprocess.run(command, capture_output=True, text=True)
        said = done.stdout + done.stderr
        if "ERR_NVGPUCTRPERM" in said:
            raise NcuError("ncu may not read this GPU's performance counters (ERR_NVGPUCTRPERM): run as root or "
                           "allow it (NVreg_RestrictProfilingToAdminUsers=0)")
        errors = [line for line in said.splitlines() if "ERROR" in line]
        named = [m for m in wanted if any(re.search(rf"\b{re.escape(m.split('.')[0])}(?!\w)", line) for line in errors)]
        if done.returncode == 0:
            return parse_raw_csv(done.stdout), refused
        if not named:
            raise NcuError(f"{' '.join(command[:3])}... exited {done.returncode}:\n{said[-2000:]}")
        refused += named


def compare(counted: list[dict], measured: list[dict[str, str]]) -> list[dict]:
    """Rows of the comparison, one for each launch and kind that either side counted."""
    if [r["kernel"] for r in counted] != [_base(m["Kernel Name"], counted) for m in measured]:
        raise NcuError("ncu's launches are not the counted ones: counted "
                       f"{[r['kernel'] for r in counted]}, ncu saw {[m['Kernel Name'] for m in measured]}")
    rows = []
    for emulated, seen in zip(counted, measured):
        for kind, (requests, units) in METRICS.items():
            mine = emulated["kinds"].get(kind, {})
            theirs = {what: _sum(seen, names) for what, names in (("requests", requests), ("units", units))}
            if not mine and not any(theirs.values()):
                continue
            rows.append(dict(kernel=emulated["kernel"], kind=kind, emu_requests=mine.get("requests", 0),
                             ncu_requests=theirs["requests"], emu_units=mine.get("units", 0) if units else None,
                             ncu_units=theirs["units"] if units else None))
    for row in rows:
        row["ratio"] = _ratio(row["ncu_units"], row["emu_units"]) if row["emu_units"] is not None else \
            _ratio(row["ncu_requests"], row["emu_requests"])
    return rows


def _base(kernel: str, counted: list[dict]) -> str:
    """The counted kernel whose name ncu's ``kernel`` names (ncu may add a namespace)."""
    return max((r["kernel"] for r in counted if r["kernel"] in kernel), key=len, default=kernel)


def _sum(row: dict[str, str], names: list[str]) -> float | None:
    """The sum of these metrics in ``row``, or None if ncu gave none of them."""
    values = [v for v in (value(row, m) for m in names) if v is not None]
    return sum(values) if values else None


def _ratio(a, b):
    return None if a is None or not b else a / b


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.launch:
        dtype, D, causal = args.launch
        launch_case(dtype, int(D), causal == "yes")
        return 0
    if args.counts is None:
        parser.error("--counts FILE is required: the JSON of `python benchmarks/attn.py --counts --json FILE`")
    with open(args.counts, encoding="utf-8") as f:
        record = json.load(f)
    cases: dict[tuple, list[dict]] = {}
    for row in record.get("counts", []):
        if "kinds" not in row:
            raise NcuError(f"{args.counts}: its counts have no per-kind figures (an older attn.py's): run attn.py "
                           "--counts again")
        cases.setdefault((row["dtype"], row["causal"], row["d"]), []).append(row)
    if not cases:
        raise NcuError(f"{args.counts}: no counts (was attn.py run with --counts, and could it count?)")
    out = {"gpu": record.get("gpu"), "metrics": ALL_METRICS, "refused": [], "cases": []}
    print(f"Nsight Compute against the emulator's counts, on {record.get('gpu')} (ratio: ncu / emulated; units are "
          f"sectors for global kinds, wavefronts for shared ones)")
    columns = ["kernel", "kind", "emu_requests", "ncu_requests", "emu_units", "ncu_units", "ratio"]
    try:
        for case, counted in cases.items():
            measured, refused = profile(args.ncu, case, [r["kernel"] for r in counted], ALL_METRICS)
            out["refused"] = sorted(set(out["refused"]) | set(refused))
            rows = compare(counted, measured)
            out["cases"].append({"dtype": case[0], "causal": case[1], "d": case[2], "rows": rows})
            print(f"\n== {case[0]} causal={case[1]} d={case[2]} ==")
            print("  ".join(c.rjust(12) for c in columns))
            for row in rows:
                print("  ".join(_fmt(row[c]).rjust(12) for c in columns))
        if out["refused"]:
            print(f"\nmetrics this ncu does not know (left out): {', '.join(out['refused'])}")
    finally:
        if args.json:
            with files.atomic_write(args.json) as f:
                json.dump(out, f, indent=1)
    return 0


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if v < 1000 else f"{v:.0f}"
    return str(v)


if __name__ == "__main__":
    sys.exit(cli.run(main, user_errors=(NcuError,)))
