import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minitransformer as mt
from minitransformer.nn import KVCache
from tests.helpers import seeds


@settings(deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.just("append"), st.integers(1, 5)),
                              st.tuples(st.just("select"), st.integers(0, 7))), min_size=1, max_size=24),
       rows=st.integers(1, 6), seed=seeds)
def test_kv_cache_holds_what_concatenation_and_gathering_give(device, ops, rows, seed):
    """Any sequence of appends (of 1-5 positions) and row selections (fewer, as many or more
    rows, repeated rows) leaves the cache equal to the plain concat and gather it replaces,
    across the buffers' growth."""
    rng = np.random.default_rng(seed)
    h, d_k, d_v = 2, 3, 4
    cache, k_ref, v_ref = KVCache(), None, None
    with mt.no_grad():
        for op, size in ops:
            if op == "append":
                k, v = rng.standard_normal((rows, h, size, d_k)), rng.standard_normal((rows, h, size, d_v))
                k_ref = k if k_ref is None else np.concatenate([k_ref, k], axis=2)
                v_ref = v if v_ref is None else np.concatenate([v_ref, v], axis=2)
                k_all, v_all = cache.append(mt.tensor(k, device=device), mt.tensor(v, device=device))
                np.testing.assert_array_equal(k_all.numpy(), k_ref)
                np.testing.assert_array_equal(v_all.numpy(), v_ref)
            elif k_ref is not None:
                index = rng.integers(0, rows, size)
                cache.select(mt.tensor(index, device=device).data)
                k_ref, v_ref, rows = k_ref[index], v_ref[index], size
                if not rows:
                    break
            if k_ref is not None:
                np.testing.assert_array_equal(cache.k.numpy(), k_ref)
                np.testing.assert_array_equal(cache.v.numpy(), v_ref)


def test_kv_cache_refuses_gradients_and_a_step_of_other_rows():
    cache = KVCache()
    k = mt.randn(2, 1, 1, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="no_grad"):
        cache.append(k, k)
    with mt.no_grad():
        cache.append(k, k)
        with pytest.raises(ValueError, match="a step of 3 rows for a cache of 2"):
            cache.append(mt.randn(3, 1, 1, 4), mt.randn(3, 1, 1, 4))
