"""The emulated kernels under the compilers' sanitizers, and planted bugs that each must flag.

Three checks (emu.h says how each works, and what it cannot see):
  AddressSanitizer + UndefinedBehaviorSanitizer   accesses past the end of global buffers,
      of static shared arrays and of each array carved from dynamic shared memory; misaligned
      accesses; indices past fixed-size arrays
  ThreadSanitizer   races between the threads of a block and between blocks, on shared and
      global memory
  poisoned shared memory and cp.async destinations, and blocks in shuffled order (every
      variant)   reads of shared memory the block has not written, of a copy before its wait,
      or of another block's output, turn the results into NaN or into a huge number (the
      poison alternates); a write past a carved array, or a kernel carving more than its
      launch asked for, aborts

Every kernel, forward and backward, in every dtype, runs clean under each sanitizer on the
fixed shapes of sanitized_run.py, and matches the formulas there. A check that cannot fail
is no check: for each, bugs planted in the real csrc/ (textual mutations before the build)
must be flagged. The planted bugs of one check share a build (one per ``build`` name), each in
a kernel that the others of its build leave alone, so that each case sees only its own bug.

Sanitized modules load only in a process whose sanitizer runtime came first, so every run
here is a subprocess running sanitized_run.py.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import emulated
import sanitized_run
from minitransformer.emulated import emulator
from minitransformer.emulated.emulator import Mutation

pytestmark = pytest.mark.slow  # the kernels under AddressSanitizer/UBSan, ThreadSanitizer and poisoning

emulated.require_emulator()

DRIVER = Path(sanitized_run.__file__)
KERNELS = ["attention", "attention_naive", "attention_tiled", "layernorm", "softmax", "cross_entropy"]
# A run's CPU seconds (the slowest, attention under either sanitizer, takes about 40 on a quiet
# machine): CPU time, which a busy machine does not inflate as it does the wall clock.
CPU_SECONDS = 900


@dataclass(frozen=True)
class Planted:
    why: str             # what the bug is (the test's id)
    case: str            # a sanitized_run case that reaches it
    mutation: Mutation | tuple[Mutation, ...]
    report: str          # a pattern that the run's output must match
    build: str = ""      # bugs of one check and build name share a build

    @property
    def mutations(self) -> tuple[Mutation, ...]:
        return self.mutation if isinstance(self.mutation, tuple) else (self.mutation,)


# Blocks that count on running in index order: each adds the previous block's column sums to its
# own, and the weight-gradient kernel then reads the last block's alone.
CHAINED_PARTIALS = (
    Mutation("layernorm.cu", "        out[c] = sw;\n        out[D + c] = sb;\n",
             "        out[c] = sw + (blockIdx.x ? out[c - 2 * D] : 0.f);\n"
             "        out[D + c] = sb + (blockIdx.x ? out[c - D] : 0.f);\n"),
    Mutation("layernorm.cu", "for (int blk = 0; blk < blocks; ++blk) {", "for (int blk = blocks - 1; blk < blocks; ++blk) {"),
)


# The backward's dO tile one row longer than its array: the row lands in the scores, carved
# next, which the next phase overwrites (and the padding columns, which nothing reads).
DO_PAST_ITS_END = Mutation(
    "attention.cu", "load_tile<T, D, BR>(sdO, L::LDT, static_cast<const T*>(p.dout) + q_off, q_valid);",
    "load_tile<T, D, BR + 1>(sdO, L::LDT, static_cast<const T*>(p.dout) + q_off, q_valid);")

RACE = "WARNING: ThreadSanitizer: data race"
OVERFLOW = "AddressSanitizer: heap-buffer-overflow"
POISONED = "AddressSanitizer: use-after-poison"
MISMATCH = "MISMATCH in case"  # any disagreement with the formulas (sanitized_run.py)

PLANTED = {
    "thread": [
        Planted("no-barrier-before-kv-refill", "attention-tiles-float16", Mutation(
            "attention.cu",
            "        __syncthreads();  // every warp is done with this buffer before it is refilled\n",
            ""), RACE),
        Planted("no-barrier-before-f32-kv-reload", "attention-tiles-float32", Mutation(
            "attention.cu", "sV, L::LDT, sO, L::LDO);\n        __syncthreads();\n",
            "sV, L::LDT, sO, L::LDO);\n"), RACE),
        Planted("no-barrier-after-static-smem-write", "softmax-block-float32", Mutation(
            "common.cuh", "        if (lane == 0) part[warp] = v;\n        __syncthreads();\n",
            "        if (lane == 0) part[warp] = v;\n"), RACE),
        # between blocks (emu.h: each block's threads are fibers TSan sees in no order)
        Planted("block-reads-another-blocks-output", "layernorm-vector-float32", CHAINED_PARTIALS, RACE),
        # the forward, which every float32 case also runs, has a bug above: a build of its own
        Planted("dq-accumulated-across-blocks-without-atomics", "attention-tiles-float32", Mutation(
            "attention.cu", "atomicAdd(p.dq_accum + q_off + size_t(r) * D + d, sdQ[r * L::LDQ + d]);",
            "p.dq_accum[q_off + size_t(r) * D + d] += sdQ[r * L::LDQ + d];"), RACE, build="between-blocks"),
    ],
    "address": [
        Planted("cp-async-reads-a-row-past-the-end", "attention-tiles-float16", Mutation(
            "attention.cu", "const bool ok = r < valid;\n        __pipeline_memcpy_async",
            "const bool ok = r <= valid;\n        __pipeline_memcpy_async"), OVERFLOW),
        # each carved shared-memory array with a poisoned gap after it (emu.h: SharedMemory)
        Planted("do-tile-loaded-a-row-past-its-end", "attention-tiles-float32", DO_PAST_ITS_END,
                POISONED),
        Planted("reads-past-a-static-smem-array", "softmax-block-float32", Mutation(
            "common.cuh", "v = lane < THREADS / 32 ? part[lane] : 0.f;",
            "v = lane <= THREADS / 32 ? part[lane] : 0.f;"), "runtime error: index 8 out of bounds"),
        Planted("vector-loads-of-unaligned-rows", "layernorm-scalar-float16", Mutation(
            "layernorm.cu", "if (D % kVec == 0)", "if (D % 2 == 0)"),
            "runtime error: .* misaligned address"),
    ],
    None: [  # caught by the poisoned shared memory of every variant (NaN or a huge number: the
        # poison alternates block by block, so either shows, as the blocks' order falls)
        Planted("output-accumulator-never-zeroed", "attention-tiles-float32", Mutation(
            "attention.cu", "    zero_tile<BR, D>(sO, L::LDO);\n", ""), MISMATCH),
        Planted("static-smem-written-by-block-0-only", "softmax-block-float32", Mutation(
            "common.cuh", "if (lane == 0) part[warp] = v;",
            "if (lane == 0 && blockIdx.x == 0) part[warp] = v;"), MISMATCH),
        # blocks run in a shuffled order, never in index order (emu.h)
        Planted("block-reads-another-blocks-output", "layernorm-vector-float32", CHAINED_PARTIALS, MISMATCH),
        # cp.async in flight until its wait (emu.h): the last key tile's group left pending
        Planted("last-kv-tile-waits-for-all-but-one-group", "attention-tiles-float16", Mutation(
            "attention.cu", "            __pipeline_wait_prior(0);\n        }\n        __syncthreads();  // this tile's",
            "            __pipeline_wait_prior(1);\n        }\n        __syncthreads();  // this tile's"),
            MISMATCH),
        # a second build, for bugs in kernels that the ones above already break (the backward
        # cases also run the forward)
        Planted("query-tile-read-before-its-copies-land", "attention-tiles-float16", Mutation(
            "attention.cu", "last iteration\n                __pipeline_wait_prior(1);\n", "last iteration\n"),
            r"attention_grad \(float16\): error", build="second"),
        Planted("do-tile-loaded-a-row-past-its-end", "attention-tiles-float32", DO_PAST_ITS_END,
                "a block wrote dynamic shared memory outside the arrays it carved", build="second"),
        Planted("layernorm-launch-asks-for-too-little-shared-memory", "layernorm-vector-float32",
                Mutation("layernorm.cu", "2 * size_t(D) * W * sizeof(float)",
                         "2 * size_t(D - 1) * W * sizeof(float)"),
                "a kernel carves bytes .* of dynamic shared memory, but its launch asked for",
                build="second"),
        # a barrier that only lane 0 of each warp reaches, while the other lanes wait for it in
        # a warp collective: a hang on the GPU, and before the fibers (emu.h) in the emulator
        Planted("barrier-inside-a-branch-of-lane-0", "softmax-block-float32", Mutation(
            "common.cuh", "        if (lane == 0) part[warp] = v;\n        __syncthreads();\n",
            "        if (lane == 0) {\n            part[warp] = v;\n            __syncthreads();\n        }\n"),
            "deadlock in block .* waits at a barrier", build="second"),
        # the row maximum reading sS's first padding column, which nothing writes: NaN poison
        # goes unseen there (fmaxf drops a NaN), the large finite poison of every other block
        # does not (emu.h)
        Planted("row-max-reads-a-padding-column", "attention-tiles-float32", Mutation(
            "attention.cu", "for (int c = sub; c < BC; c += TPR) {\n            float s = key_visible",
            "for (int c = sub; c <= BC; c += TPR) {\n            float s = key_visible"),
            MISMATCH, build="third"),
    ],
}


@pytest.fixture(scope="module")
def variants():
    """Builds, on first use: (sanitize, planted bugs) -> module path."""
    built = {}

    def variant(sanitize, planted=()):
        emulated.require_emulator(sanitize)
        key = (sanitize, tuple(planted))
        if key not in built:
            built[key] = emulator.compile_variant(sanitize, [m for p in planted for m in p.mutations])
        return built[key]

    return variant


def run(module: Path, sanitize: str | None, cases: list[str]):
    # This checkout's minitransformer, without its emulated cuda device: that would load the
    # plain build beside the sanitized one, and the kernels' template instantiations (vague
    # linkage, bound process-wide) then ran uninstrumented: a planted overrun went unreported.
    env = dict(os.environ, PYTHONPATH=str(emulator.ROOT), MT_EMULATE_CUDA="0")
    if sanitize:
        env.update(emulator.sanitizer_environment(sanitize))
    return emulator.run_limited([sys.executable, str(DRIVER), str(module), *cases], CPU_SECONDS,
                                env=env, capture_output=True, text=True)


# ThreadSanitizer looks for races, which neither the element type nor the head dim changes,
# and its runs cost several times the plain build's: bfloat16 instantiates the templates of
# float16, indices and barriers alike, and the float32 kernels at D = 128 are those at D = 64
# (attention-tiles) with other constants. The causal case still runs in float16, for the mma kernels' smaller backward tiles.
THREAD_SKIPS = {name for name in sanitized_run.CASES
                if name.endswith("-bfloat16") or name == "attention-causal-float32"}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("sanitize", emulator.SANITIZERS)
def test_kernels_are_clean(variants, sanitize, kernel):
    cases = [name for name in sanitized_run.CASES if name.startswith(f"{kernel}-")
             and not (sanitize == "thread" and name in THREAD_SKIPS)]
    result = run(variants(sanitize), sanitize, cases)
    assert result.returncode == 0, result.stderr[-6000:]


@pytest.mark.parametrize("sanitize, planted", [
    pytest.param(sanitize, planted, id=f"{sanitize or 'poison'}-{planted.why}")
    for sanitize, bugs in PLANTED.items() for planted in bugs])
def test_planted_bug_is_flagged(variants, sanitize, planted):
    build = [p for p in PLANTED[sanitize] if p.build == planted.build]
    result = run(variants(sanitize, build), sanitize, [planted.case])
    assert result.returncode != 0 and re.search(planted.report, result.stderr), result.stderr[-6000:]


def test_the_runs_are_limited_by_cpu_time_not_by_the_wall_clock():
    """A child that sleeps past its CPU limit finishes; one that computes past it is stopped."""
    sleeper = emulator.run_limited([sys.executable, "-c", "import time; time.sleep(2.5)"], 1)
    assert sleeper.returncode == 0
    spinner = emulator.run_limited([sys.executable, "-c", "while True: pass"], 1, wall_seconds=60)
    assert spinner.returncode == -signal.SIGXCPU
