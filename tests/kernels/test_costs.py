"""The attention kernels' memory traffic, counted in the emulator's count variant
(minitransformer.kernels.costs), at the tiles the launchers choose on an H100/H200, and on an
sm_86 GPU where those differ most (float32 at D = 128: 32-key tiles forward, 16 backward): no bank
conflicts but those the ledger explains, and the tiles' global loads coalesced."""

from __future__ import annotations

import emulated
import pytest

from minitransformer.kernels import costs
from minitransformer.kernels.resources import kernel_name

CASES = [("float32", 64, 90), ("float32", 128, 90), ("bfloat16", 64, 90), ("bfloat16", 128, 90),
         ("float32", 128, 86)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{dtype}-D{D}-sm_{arch}" for dtype, D, arch in CASES])
def launches(request):
    emulated.require_emulator()
    dtype, D, arch = request.param
    return costs.attention(dtype, D, causal=False, arch=arch)


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
