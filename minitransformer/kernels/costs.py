"""What the kernels cost in memory traffic, counted on the emulated device.

    python -m minitransformer.kernels.costs          # every launch of the attention cases, then
                                                     # the kernel ladder's rungs

The count variant of the emulated module (emu.h's Counting) counts, for each launch and each
line of csrc/, the warp requests to global memory and the 32-byte sectors they fetch, the
wavefronts of shared-memory requests (one more than ideal for each bank conflict), barriers
and mma instructions: what Nsight Compute reports on a GPU, read off the addresses the kernels
touch, so that the first GPU run checks a prediction. Counting slows every access, so the
variant runs in a process of its own (MT_EMULATED_KERNELS), on small shapes: the costs per
request do not depend on how many there are.
"""

from __future__ import annotations

import functools
import os

from ..emulated import emulator
from ..emulated.emulator import CSRC, Count, LoggedLaunch
from .resources import SHARED_MEMORY_PER_BLOCK, kernel_name

# The attention cases: (dtype, head dim, causal), each a forward and a backward at one shape,
# with the tiles the launchers choose on an H100/H200 (sm_90).
ATTENTION_CASES = [(dtype, D, causal) for dtype in ("float32", "bfloat16") for D in (64, 128)
                   for causal in (False, True)]
SHAPE = dict(B=1, H=2, T=128)
# A count variant to count in instead of csrc/'s as it is (the mutation tester's, of a mutant).
KERNELS_VARIABLE = "MT_EMULATED_COUNT_KERNELS"

_ATTENTION = """
import numpy as np
from minitransformer import backend
from minitransformer.kernels import launch
cupy = backend._cupy
rng = np.random.default_rng(0)
def array(*shape):
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype({dtype!r})
q, k, v, do = (array({B}, {H}, {T}, {D}) for _ in range(4))
with emulator.logged_launches() as log:
    o, lse = launch.attention_forward(q, k, v, causal={causal})
    launch.attention_backward(q, k, v, o, lse, do, causal={causal})
"""


def counted(code: str, arch: int = 90) -> list[LoggedLaunch]:
    """The launches, with their counts, of ``code``: Python run on the emulated device (as it
    is on ``arch``) in a process of its own, which fills ``log`` inside ``with
    emulator.logged_launches() as log:``."""
    module = os.environ.get(KERNELS_VARIABLE) or str(emulator.compile_variant("count"))
    code = "\n".join(["import json", "from dataclasses import asdict", "from minitransformer.emulated import emulator",
                      code, "print(json.dumps([asdict(launch) for launch in log]))"])
    launches = emulator.run_configured(code, SHARED_MEMORY_PER_BLOCK[arch], "counting",
                                       env={"MT_EMULATED_KERNELS": module})
    return [LoggedLaunch(d["kernel"], tuple(d["grid"]), tuple(d["block"]), d["smem"],
                         tuple(Count(**c) for c in d["counts"])) for d in launches]


def attention(dtype: str, D: int, causal: bool, arch: int = 90, **shape) -> list[LoggedLaunch]:
    """The launches of one forward and backward of the fused attention at SHAPE (or with the
    sizes of ``shape`` in its place: B, H, T)."""
    return counted(_ATTENTION.format(dtype=dtype, D=D, causal=causal, **{**SHAPE, **shape}), arch)


# The kernel ladder of the reading's fused-attention page, rung by rung: each rung's forward at
# one shape, (rung, dtype, launcher of minitransformer.kernels.launch).
LADDER = [("naive", "float32", "attention_naive_forward"), ("tiled", "float32", "attention_tiled_forward"),
          ("fused", "float32", "attention_forward"), ("tensor cores", "bfloat16", "attention_forward")]
LADDER_SHAPE = dict(B=1, H=2, T=128, D=64)

_FORWARD = """
import numpy as np
from minitransformer import backend
from minitransformer.kernels import launch
cupy = backend._cupy
rng = np.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal(({B}, {H}, {T}, {D}), dtype=np.float32)).astype({dtype!r})
           for _ in range(3))
with emulator.logged_launches() as log:
    launch.{launcher}(q, k, v, causal={causal})
"""


def ladder(causal: bool = False, arch: int = 90) -> list[tuple[str, str, list[LoggedLaunch]]]:
    """(rung, dtype, its launches) for each rung of LADDER: one forward at LADDER_SHAPE."""
    return [(rung, dtype, counted(_FORWARD.format(dtype=dtype, launcher=launcher, causal=causal, **LADDER_SHAPE),
                                  arch))
            for rung, dtype, launcher in LADDER]


def rung_totals(launches: list[LoggedLaunch]) -> dict[str, int]:
    """A rung's costs, summed over its launches: global bytes fetched (32-byte sectors) and the
    fewest that its requests' bytes could take, shared-memory requests and their wavefronts (and
    the fewest), barriers and mma instructions."""
    g = [launch.total(*emulator.GLOBAL_KINDS) for launch in launches]
    s = [launch.total(*emulator.SHARED_KINDS) for launch in launches]
    return dict(launches=len(launches), global_bytes=32 * sum(c.units for c in g),
                global_ideal_bytes=32 * sum(c.ideal for c in g), shared_requests=sum(c.requests for c in s),
                wavefronts=sum(c.units for c in s), ideal_wavefronts=sum(c.ideal for c in s),
                barriers=sum(launch.total("barrier").requests for launch in launches),
                mma=sum(launch.total("mma").requests for launch in launches))


def table(rows: list[tuple[str, LoggedLaunch]]) -> str:
    """A Markdown table: each launch's totals, by kind (sectors or wavefronts, and ideally)."""
    lines = ["case | kernel | global requests | sectors (ideal) | shared requests | wavefronts (ideal) | barriers | mma",
             "--- | --- | ---: | ---: | ---: | ---: | ---: | ---:"]
    for case, launch in rows:
        g, s = launch.total(*emulator.GLOBAL_KINDS), launch.total(*emulator.SHARED_KINDS)
        lines.append(f"{case} | `{kernel_name(launch.kernel)}` | {g.requests} | {g.units} ({g.ideal}) | "
                     f"{s.requests} | {s.units} ({s.ideal}) | {launch.total('barrier').requests} | "
                     f"{launch.total('mma').requests}")
    return "\n".join(lines)


def conflicts(launch: LoggedLaunch) -> list[Count]:
    """The lines of a launch whose shared-memory requests take more wavefronts than ideal."""
    return [c for c in launch.counts if c.kind in emulator.SHARED_KINDS and c.units > c.ideal]


# The bank conflicts the kernels keep, and why: (kernel, the line of csrc/ as written) -> (at
# most this many times the ideal wavefronts, the reason). Every other shared-memory request of
# the attention kernels takes its ideal wavefronts at the launchers' tiles (tests/kernels/
# test_costs.py).
_ROWS_OF_16 = ("the backward's row loops at BC = 16 (the float32 backward at D = 128 on sm_86, whose shared "
               "memory takes no wider key tile): a warp spans two rows of 16, which padded_ld's stride of 20 "
               "lays 20 banks apart, so 4 of each row's 16 banks meet the other row's and a request takes "
               "two wavefronts instead of one. A stride that is 16 mod 32 would part the two rows, but put "
               "the four rows 2 apart that smem_gemm touches in these arrays in one bank group: four "
               "wavefronts there")
LEDGER = {
    ("attention_forward_f32_kernel", "for (int i = 0; i < TM; ++i) a[i] = *at<LA>(A, lda, m0 + i, k);"): (
        2.0, "smem_gemm's A operand at BR = 64: a warp reads four rows 4 apart, which a stride of "
             "padded_ld's puts in distinct banks (the P V product, from sP); but Q's tile rows must "
             "be 16-byte aligned for load_tile's uint4 copies, a stride that is a multiple of 4 "
             "floats, and four rows 4 apart of that stride meet two to a bank: S = Q K^T reads Q "
             "in two wavefronts a request instead of one (at BR = 32, rows 2 apart do not meet)"),
    ("attention_backward_f32_kernel", "? __expf(sS[r * L::LDS + c] * p.scale - lse) : 0.f;"): (2.0, _ROWS_OF_16),
    ("attention_backward_f32_kernel", "sS[r * L::LDS + c] = prob;"): (2.0, _ROWS_OF_16),
    ("attention_backward_f32_kernel",
     "sP[r * L::LDP + c] = from_float<T>(prob * dropout_factor(p, bh, i, j));"): (2.0, _ROWS_OF_16),
    ("attention_backward_f32_kernel",
     "float dp = sdP[r * L::LDS + c] * dropout_factor(p, bh, q0 + r, k0 + c);"): (2.0, _ROWS_OF_16),
    ("attention_backward_f32_kernel",
     "sdS[r * L::LDP + c] = from_float<T>(sS[r * L::LDS + c] * (dp - sDelta[r]) * p.scale);"): (2.0, _ROWS_OF_16),
}


@functools.cache
def _csrc_lines(file: str) -> list[str]:
    return (CSRC / file).read_text().splitlines()


def source_line(line: str) -> str:
    """The text of "file:line" in csrc/, stripped."""
    file, number = line.rsplit(":", 1)
    return _csrc_lines(file)[int(number) - 1].strip()


def explained(launch: LoggedLaunch, count: Count) -> float | None:
    """The ledger's bound (times the ideal wavefronts) for a conflicting line, or None."""
    entry = LEDGER.get((kernel_name(launch.kernel).split("<")[0], source_line(count.line)))
    return None if entry is None else entry[0]


if __name__ == "__main__":
    reason = emulator.unavailable_reason("count")
    if reason:
        raise SystemExit(f"cannot count: {reason}")
    rows = []
    for dtype, D, causal in ATTENTION_CASES:
        case = f"{dtype} D={D}{' causal' if causal else ''}"
        rows += [(case, launch) for launch in attention(dtype, D, causal)]
    print(table(rows))
    print("\nrung | dtype | launches | global bytes (ideal) | shared requests | wavefronts (ideal) | barriers | mma")
    print("--- | --- | ---: | ---: | ---: | ---: | ---: | ---:")
    for rung, dtype, launches in ladder():
        t = rung_totals(launches)
        print(f"{rung} | {dtype} | {t['launches']} | {t['global_bytes']} ({t['global_ideal_bytes']}) | "
              f"{t['shared_requests']} | {t['wavefronts']} ({t['ideal_wavefronts']}) | {t['barriers']} | {t['mma']}")
    for case, launch in rows:
        for c in conflicts(launch):
            why = "ledgered" if explained(launch, c) else "NOT EXPLAINED"
            print(f"{case} {kernel_name(launch.kernel)} {c.line} {c.kind}: {c.units} wavefronts for {c.ideal} ({why})")
