"""The attention kernels' memory traffic, counted in the emulator's count variant
(minitransformer.kernels.costs), at the tiles the launchers choose on an H100/H200, and on an
sm_86 GPU where those differ most (float32 at D = 128: 32-key tiles forward, 16 backward): no bank
conflicts but those the ledger explains, and the tiles' global loads coalesced."""

from __future__ import annotations

import emulated
import pytest

from minitransformer.kernels import costs
from minitransformer.kernels.resources import kernel_name

pytestmark = pytest.mark.slow  # every kernel's memory traffic, counted in the emulator's count builds

CASES = [("float32", 64, 90), ("float32", 128, 90), ("bfloat16", 64, 90), ("bfloat16", 128, 90),
         ("float32", 128, 86)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{dtype}-D{D}-sm_{arch}" for dtype, D, arch in CASES])
def launches(request):
    emulated.require_emulator()
    dtype, D, arch = request.param
    # One head of 64 queries and keys: several tiles at every tiling, and a request costs what it
    # costs at any size.
    return costs.attention(dtype, D, causal=False, arch=arch, H=1, T=64)


def test_every_attention_kernel_is_counted(launches):
    names = [kernel_name(launch.kernel).split("<")[0] for launch in launches]
    assert names[0].startswith("attention_forward_") and "attention_backward_delta_kernel" in names
    for launch in launches:
        assert launch.total().requests > 0, launch.kernel


def test_no_bank_conflicts_but_those_the_ledger_explains(launches):
    unexplained = []
    for launch in launches:
        for c in costs.conflicts(launch):
            bound = costs.explained(launch, c)
            if bound is None or c.units > bound * c.ideal:
                unexplained.append(f"{kernel_name(launch.kernel)} {c.line} {c.kind}: {c.units} wavefronts "
                                   f"for {c.ideal} ({costs.source_line(c.line)!r})")
    assert not unexplained, "\n".join(unexplained)


def test_the_tiles_global_loads_are_coalesced(launches):
    """Q, K, V, O and dO (and lse, delta) come in with the fewest sectors their bytes can take."""
    loads = ("global load", "cp.async read")
    wasteful = [f"{kernel_name(launch.kernel)} {c.line}: {c.units} sectors for {c.ideal}"
                for launch in launches for c in launch.counts if c.kind in loads and c.units > c.ideal]
    assert not wasteful, "\n".join(wasteful)


# The tiled kernel (csrc/attention_tiled.cu) causal with T = S, so that block 0's last key ends
# a tile (16), and with one batch entry's keys full (40) and one's ending mid-tile (20).
B, H, T, S, D, LENS = 2, 1, 40, 40, 21, [40, 20]
_TILED = f"""
import numpy as np
from minitransformer import backend
from minitransformer.kernels import launch
cupy = backend._cupy
rng = np.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal(({B}, {H}, {T}, {D}), dtype=np.float32)) for _ in range(3))
lens = cupy.asarray(np.array({LENS}, dtype=np.int32))
with emulator.logged_launches() as log:
    launch.attention_tiled_forward(q, k, v, lens, causal=True)
"""


def test_the_tiled_kernel_visits_the_key_tiles_its_queries_see_and_no_more():
    """Each block of BR = 16 queries visits the key tiles up to the last key its last query sees,
    with six barriers a tile (two around the scores for the maximum, four around the weights and
    P V), each counted once per warp; its shared memory is its Q, K/V and score tiles at the odd
    row stride, each carved to 128 bytes. A tile more or a byte more is paid on every launch."""
    emulated.require_emulator()
    (tiled,) = costs.counted(_TILED)
    BR = BC = 16
    tiles = sum(-(-max(0, min(LENS[b], min(q0 + BR, T) + S - T)) // BC)
                for b in range(B) for _ in range(H) for q0 in range(0, T, BR))
    assert tiled.total("barrier").requests == 6 * (tiled.block[0] // 32) * tiles
    ld = D | 1
    assert tiled.smem == sum(-(-floats * 4 // 128) * 128 for floats in (BR * ld, BC * ld, BR * BC))
