"""Runs named kernel cases against a build of the emulated kernels, in a process of its own:

    python sanitized_run.py MODULE CASE...

MODULE is a variant from minitransformer.emulated.emulator.compile_variant; a sanitized one
loads only with its runtime preloaded (emulator.sanitizer_environment), which is why
test_sanitizers.py runs this file instead of importing the module. A sanitizer's report ends
the process with its own message; a result that disagrees with the formulas ends it with
"MISMATCH" and exit status 1. Each case's name goes to stderr before it runs, so that a report
says which case it came from.

The cases are fixed shapes that reach every path of every kernel: for attention, several
query and key tiles with a ragged last one (every double-buffered shared-memory tile is
refilled), T > S and T < S, causal and not, padded keys and a batch entry with none, dropout;
for the row kernels, rows taken by warps and by whole blocks, blocks with rows to spare,
vectorised and scalar loads. Each dtype runs every case.
"""

from __future__ import annotations

import functools
import sys

if __name__ == "__main__":  # not when test_sanitizers.py imports this file for CASES
    # The driver needs NumPy only: no CuPy (a real one would load its CUDA libraries under the
    # sanitizer's runtime) and no emulated device (test_sanitizers.py sets MT_EMULATE_CUDA=0).
    sys.modules["cupy"] = None

import emulated  # noqa: E402
from checks import DTYPES  # noqa: E402

# name -> (check, arguments after the module and dtype); every name gets a -<dtype> suffix.
_SHAPES = {
    # D = 64: 3 x 3 tiles of 64 (the forward's K/V buffers and the backward's Q/dO buffers are
    # refilled), both ragged; one head, as the blocks of a second would do the same.
    "attention-tiles": (emulated.check_attention, dict(B=1, H=1, T=150, S=140, D=64, lens=None,
                                                       causal=False)),
    # D = 128 (other tile sizes; 3 key tiles again), causal with T > S (the first 30 queries
    # see no key), and a batch entry with no keys at all.
    "attention-causal": (emulated.check_attention, dict(B=2, H=1, T=160, S=130, D=128,
                                                        lens=[130, 0], causal=True)),
    # D = 32, causal with T < S, padded keys, dropout.
    "attention-dropout": (emulated.check_attention, dict(B=2, H=1, T=40, S=200, D=32,
                                                         lens=[200, 130], causal=True,
                                                         dropout_p=0.2)),
    # The naive kernels: every count of threads (scores, rows, outputs) short of a whole block
    # of 256; causal with T > S (the first 10 queries see no key), padded keys (their rows hold
    # NaN) and a batch entry with none; an odd head dim.
    "attention_naive-masks": (emulated.check_attention_naive, dict(B=2, H=3, T=25, S=15, D=7,
                                                                   lens=[11, 0], causal=True)),
    # The tiled kernel: 3 query tiles, the last short (T = 40 of 16s), causal with T > S (the
    # first 9 queries see no key), a key tile cut by padding (lens 27: NaN past it) and a batch
    # entry with no keys; D = 21, so each thread keeps one or two outputs, the tiles' loads cross
    # rows mid-warp, and the odd row stride adds no padding column: a read past a row's D
    # floats is the next row's, or, from the tile's last row, past the tile.
    "attention_tiled-masks": (emulated.check_attention_tiled, dict(B=2, H=3, T=40, S=31, D=21,
                                                                   lens=[27, 0], causal=True)),
    # 13 rows: the last block has idle warps, and the backward's 3 blocks loop twice.
    "layernorm-vector": (emulated.check_layernorm, dict(N=13, D=104, affine=True)),
    "layernorm-scalar": (emulated.check_layernorm, dict(N=6, D=1030, affine=False)),
    "softmax-warp": (emulated.check_softmax, dict(N=6, V=33, masked=True, scale=0.125)),
    "softmax-block": (emulated.check_softmax, dict(N=3, V=3000, masked=False, scale=1.0)),
    "cross_entropy-warp": (emulated.check_cross_entropy, dict(N=6, V=5, eps=0.0, use_ignore=False,
                                                              inplace=False, nll=False)),
    "cross_entropy-block": (emulated.check_cross_entropy, dict(N=7, V=1025, eps=0.1,
                                                               use_ignore=True, inplace=True, nll=True)),
}
CASES = {f"{name}-{dtype}": functools.partial(check, dtype=dtype, seed=0, **args)
         for name, (check, args) in _SHAPES.items() for dtype in DTYPES}


def main(module_path: str, names: list[str]) -> int:
    from minitransformer.emulated import emulator

    C = emulator.load(module_path)
    for name in names:
        print(f"case {name}", file=sys.stderr, flush=True)
        try:
            CASES[name](C)
        except AssertionError as e:
            seed = emulator.block_seed(module_path)
            print(f"MISMATCH in case {name} (blocks in the orders of MT_EMU_BLOCK_SEED={seed}): {e}",
                  file=sys.stderr, flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
