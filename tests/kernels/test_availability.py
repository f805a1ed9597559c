"""What works without a GPU: importing, the switch, clear errors, the limits, the binding's
and launchers' argument checks (they run before any CUDA call), and the bfloat16 bit
conversions."""

from __future__ import annotations

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import kernels


def test_import_never_fails_and_says_why_kernels_are_off():
    if kernels.available():
        assert kernels.unavailable_reason() is None
    else:
        assert isinstance(kernels.unavailable_reason(), str) and kernels.unavailable_reason()
        assert not kernels.enabled()


def test_launchers_without_the_gpu_raise_a_clear_python_error():
    if kernels.available():
        pytest.skip("kernels are available here")
    x = np.ones((2, 8), dtype=np.float32)
    for call in (lambda: kernels.softmax_forward(x), lambda: kernels.layernorm_forward(x),
                 lambda: kernels.attention_forward(x, x, x)):
        with pytest.raises(RuntimeError, match="unavailable"):
            call()


def test_switch_and_cpu_arrays_keep_the_composite_ops(monkeypatch):
    monkeypatch.setenv("MINITRANSFORMER_KERNELS", "0")
    assert not kernels.enabled()
    monkeypatch.delenv("MINITRANSFORMER_KERNELS")
    assert not kernels.enabled_for(np.ones(3, dtype=np.float32))
    x = mt.tensor(np.random.default_rng().standard_normal((2, 3, 8, 32)), requires_grad=True)
    assert F.scaled_dot_product_attention(x, x, x)._ctx.fn.__name__ == "ScaledDotProductAttention"
    assert F.layer_norm(x)._ctx.fn.__name__ == "LayerNorm"
    assert F.softmax(x)._ctx.fn.__name__ == "Softmax"


needs_extension = pytest.mark.skipif(not kernels.extension_built(),
                                     reason="minitransformer.kernels._C is not built (no nvcc at install)")


@needs_extension
def test_limits_are_what_the_launchers_enforce():
    from minitransformer.kernels import _C

    head_dims = kernels.limits()["attention_head_dims"]
    assert head_dims
    for D in range(1, 257):
        if D in head_dims:
            assert _C.launch_configs("attention_forward", 0, D)
        else:
            with pytest.raises(ValueError, match=f"head dim {D} is not supported"):
                _C.launch_configs("attention_forward", 0, D)


@needs_extension
def test_binding_and_launchers_reject_bad_arguments_before_any_launch():
    """The binding checks pointers, dtype codes and sizes; the launchers throw past
    csrc/limits.cuh (head dim, B * H, layernorm rows) as the last guard."""
    from minitransformer.kernels import _C

    ok = dict(q=256, k=256, v=256, o=256, lse=256, kv_lens=0, dtype=0, B=1, H=1, T=8, S=8, D=64,
              scale=0.125, causal=False, dropout_p=0.0, seed=0, smem_limit=232448, stream=0)
    cases = [
        (dict(D=48), "head dim 48"),
        (dict(q=0), "q is required"),
        (dict(k=8), "k must be 16-byte aligned"),
        (dict(dtype=5), "dtype code 5"),
        (dict(T=0), "T must be positive"),
        (dict(B=300, H=300), "exceeds 65535"),
        (dict(dropout_p=1.0), "dropout_p"),
        (dict(smem_limit=0), "smem_limit must be positive"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            _C.attention_forward(**{**ok, **change})
    # A device whose blocks cannot hold any tile configuration: refused before the launch.
    with pytest.raises(_C.SharedMemoryLimitError, match="attention_forward: attention_forward_f32_kernel<64, "):
        _C.attention_forward(**{**ok, "smem_limit": 48 * 1024})
    with pytest.raises(ValueError, match="label smoothing"):
        _C.cross_entropy_forward(logits=256, target=256, loss=256, nll=0, grad=0, dtype=0, N=1, V=5,
                                 smoothing=1.5, has_ignore=False, ignore_index=0, stream=0)
    with pytest.raises(ValueError, match="blocks must be positive"):
        _C.layernorm_backward(x=256, weight=0, mean=256, rstd=256, grad=256, dx=256, dweight=0,
                              dbias=0, partial=256, blocks=0, dtype=0, N=4, D=8, smem_limit=232448,
                              stream=0)
    with pytest.raises(ValueError, match="exceeds 4096"):
        _C.layernorm_backward(x=256, weight=0, mean=256, rstd=256, grad=256, dx=256, dweight=0,
                              dbias=0, partial=256, blocks=1, dtype=0, N=4, D=4097,
                              smem_limit=232448, stream=0)


def test_bfloat16_bits_round_to_nearest_even():
    x = np.array([1.0, -2.5, 3.140625, np.inf, -np.inf, 0.0], dtype=np.float32)
    np.testing.assert_array_equal(kernels.from_bfloat16_bits(kernels.to_bfloat16_bits(x)), x)
    # 1 + 2^-8 lies halfway between bfloat16 neighbours 1 and 1 + 2^-7: ties go to even (1).
    # 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties go to even (1 + 2^-6).
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8], dtype=np.float32)
    np.testing.assert_array_equal(kernels.from_bfloat16_bits(kernels.to_bfloat16_bits(halfway)),
                                  np.array([1.0, 1 + 2**-6], dtype=np.float32))
    r = np.random.default_rng().standard_normal(10_000).astype(np.float32)
    back = kernels.from_bfloat16_bits(kernels.to_bfloat16_bits(r))
    assert (np.abs(back - r) <= np.abs(r) * 2.0**-8).all()
    assert np.isnan(kernels.from_bfloat16_bits(kernels.to_bfloat16_bits(np.array([np.nan], np.float32)))).all()
    assert kernels.dtype_code(np.uint16) == 2 and kernels.dtype_code(np.float16) == 1
    assert kernels.dtype_code(np.float64) is None
