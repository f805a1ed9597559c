import gc
import sys
import threading
import weakref

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import backend
from minitransformer import functional as F
from minitransformer.autograd import Context, Function
from minitransformer.gradcheck import gradcheck
from tests.helpers import randn


def test_tensor_used_several_times_accumulates(device):
    x = randn(device, 3, seed=1)
    y = x * x + x * 3.0 + F.exp(x)  # x reaches the output along four paths
    y.sum().backward()
    xn = x.numpy()
    np.testing.assert_allclose(x.grad.numpy(), 2 * xn + 3 + np.exp(xn), rtol=1e-12, atol=1e-12)


def test_diamond_graph_visits_shared_node_once(device):
    x = randn(device, 4, seed=2)
    h = F.exp(x)  # used by both branches: its backward must run once, with the summed gradient
    y = (h * 2.0 + h.sum() * h).sum()
    y.backward()
    hn = np.exp(x.numpy())
    np.testing.assert_allclose(x.grad.numpy(), (2 + hn.sum() + hn.sum()) * hn, rtol=1e-12, atol=1e-12)


def test_deep_chain_does_not_hit_the_recursion_limit(device):
    x = randn(device, 2, seed=3)
    y = x
    for _ in range(10_000):
        y = y * 1.0001
    assert 10_000 > sys.getrecursionlimit() / 2
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(2, 1.0001**10_000), rtol=1e-9)


def test_the_walk_is_the_forward_run_backwards_layer_by_layer():
    """The walk takes contexts newest first, so a decoder layer's gradients are all complete
    before the layer below gets any, its cross-attention's included (a depth-first order
    reached every layer's cross-attention K and V projections only after the whole decoder,
    which held data parallelism's first buckets back until then)."""
    from minitransformer import nn
    from minitransformer.distributed.grad_hooks import register_post_accumulate_grad_hook

    cfg = nn.TransformerConfig(vocab_size=20, d_model=16, d_ff=32, h=2, num_encoder_layers=2, num_decoder_layers=3)
    mt.manual_seed(0)
    model = nn.Transformer(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    done = []
    for p in model.parameters():
        register_post_accumulate_grad_hook(p, lambda q: done.append(names[id(q)]))
    src, tgt = mt.tensor(np.array([[4, 5, 6, 7]])), np.array([[1, 8, 9, 10, 11]])
    F.cross_entropy(model(src, mt.tensor(tgt[:, :-1])), mt.tensor(tgt[:, 1:])).backward()
    layer = [int(n.split(".")[2]) for n in done if n.startswith("decoder.layers.")]
    assert layer == sorted(layer, reverse=True) and len(set(layer)) == 3
    stacks = [n.split(".")[0] for n in done if n.startswith(("encoder", "decoder"))]
    assert stacks == sorted(stacks)  # the decoder (all of it) before the encoder


def test_gradients_accumulate_across_backward_calls(device):
    x = randn(device, 3, seed=4)
    (x * 2.0).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 5.0))


def test_leaf_grads_own_their_memory(device):
    a, b = randn(device, 3, seed=5), randn(device, 3, seed=6)
    (a + b).sum().backward()  # Add hands the same array to both inputs
    a.grad.data *= 10.0  # an optimiser scaling one gradient in place...
    np.testing.assert_allclose(b.grad.numpy(), np.ones(3))  # ...must not touch the other


def test_backward_on_non_scalar_needs_a_gradient(device):
    x = randn(device, 2, 3)
    y = x * 2.0
    with pytest.raises(RuntimeError, match=r"non-scalar tensor of shape \(2, 3\)"):
        y.backward()
    y.backward(mt.ones_like(y))
    np.testing.assert_allclose(x.grad.numpy(), np.full((2, 3), 2.0))
    with pytest.raises(RuntimeError, match="does not match"):
        (x * 2.0).backward(mt.ones(3, device=device))


def test_backward_of_a_scalar_takes_a_number():
    x = randn("cpu", 3)
    (x * 2.0).sum().backward(3.0)
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 6.0))


def test_backward_without_grad_is_an_error(device):
    x = randn(device, 2, requires_grad=False)
    with pytest.raises(RuntimeError, match="does not require grad"):
        (x * 2.0).sum().backward()


def test_graph_is_freed_unless_retained(device):
    x = randn(device, 3)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 4 * x.numpy())
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


def test_no_grad_builds_no_graph(device):
    x = randn(device, 3)
    with mt.no_grad():
        y = F.relu(x * 2.0).sum()
    assert y._ctx is None and not y.requires_grad
    z = x * 2.0
    assert z._ctx is not None and z.requires_grad

    @mt.no_grad()
    def f(t):
        return t * 3.0

    assert not f(x).requires_grad
    assert mt.is_grad_enabled()


def test_no_grad_decorator_is_reentrant(device):
    # A nested (here recursive) call must restore the mode its caller had, and the outermost
    # call the mode before it.
    x = randn(device, 3)

    @mt.no_grad()
    def depth(t, n):
        assert not mt.is_grad_enabled()
        return t * 2.0 if n == 0 else depth(t, n - 1)

    assert not depth(x, 3).requires_grad
    assert mt.is_grad_enabled()
    assert (x * 2.0).requires_grad
    with mt.no_grad():
        with mt.enable_grad():
            assert (x * 2.0).requires_grad
        assert not mt.is_grad_enabled()
    assert mt.is_grad_enabled()


def test_grad_mode_is_per_thread_and_overlapping_blocks_restore_it():
    """Thread A enters no_grad, then this thread; A leaves first, then this one: each thread
    sees only its own blocks, and both end recording again (one process-wide flag left it off)."""
    x = mt.ones(2, requires_grad=True)
    a_inside, main_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with mt.no_grad():
            a_inside.set()
            main_inside.wait(10)
            seen["inside"] = (x * 2.0).requires_grad
        a_left.set()
        seen["after"] = (x * 2.0).requires_grad

    thread = threading.Thread(target=a)
    thread.start()
    assert a_inside.wait(10)
    assert (x * 2.0).requires_grad  # A's block does not reach this thread
    with mt.no_grad():
        main_inside.set()
        assert a_left.wait(10)  # A has left its block while this one is open
        assert not (x * 2.0).requires_grad
    thread.join()
    assert seen == {"inside": False, "after": True}
    assert (x * 2.0).requires_grad
    with mt.no_grad():  # a new thread starts recording, whatever the thread that started it does
        fresh = []
        thread = threading.Thread(target=lambda: fresh.append((x * 2.0).requires_grad))
        thread.start()
        thread.join()
    assert fresh == [True]


def test_no_grad_on_a_generator_function_covers_its_body_not_its_caller():
    x = mt.ones(2, requires_grad=True)

    @mt.no_grad()
    def items(n):
        for _ in range(n):
            received = yield (x * 2.0).requires_grad
            assert received is None or not (x * received).requires_grad
        return "done"

    gen = items(3)
    assert next(gen) is False  # the body records nothing
    assert (x * 2.0).requires_grad  # the caller, between two items, records
    assert gen.send(3.0) is False
    with pytest.raises(StopIteration) as stop:
        next(gen), next(gen)
    assert stop.value.value == "done"
    assert mt.is_grad_enabled()

    @mt.enable_grad()
    def recorded():
        yield (x * 2.0).requires_grad

    with mt.no_grad():
        assert list(recorded()) == [True]
        assert not (x * 2.0).requires_grad
    unfinished = items(3)
    next(unfinished)
    unfinished.close()  # GeneratorExit runs the body's exit in its mode, and the caller's stays
    assert mt.is_grad_enabled()


def test_views_share_their_tensor_s_version_and_new_arrays_do_not(device):
    w = randn(device, 3, 4)
    views = [w.detach(), w.transpose(0, 1), w.reshape(12), w[1:], w.astype(w.dtype)]
    w.bump_version()
    assert [v._version for v in views] == [1] * len(views)
    views[1].bump_version()  # a write through a view is a write of the tensor
    assert w._version == 2
    assert [t._version for t in (w * 2.0, w.astype(np.float32), w.transpose(0, 1).reshape(12))] == [0, 0, 0]


def test_a_backward_that_would_read_an_array_written_in_place_is_refused(device):
    """Linear saves its input and its weight (here a transposed view of W, as the tied output
    projection's), not its bias: an optimiser step on W before backward makes the gradient
    wrong, one on the bias does not."""
    from minitransformer.optim import Adam

    w, b = randn(device, 2, 3, seed=1), randn(device, 2, seed=2)
    x = randn(device, 4, 3, seed=3)

    def loss():
        return F.linear(x, F.transpose(w, 0, 1), b).sum()

    expected = loss()
    expected.backward()
    want = {"x": x.grad.numpy(), "w": w.grad.numpy()}
    x.grad = w.grad = None
    untouched = loss()
    b.grad = mt.ones(2, device=device, dtype=b.dtype)
    Adam([b], lr=0.1).step()
    untouched.backward()  # the bias is an input of Linear, but not saved by it
    np.testing.assert_allclose(x.grad.numpy(), want["x"])
    np.testing.assert_allclose(w.grad.numpy(), want["w"])

    stale = loss()
    Adam([w], lr=0.1).step()
    with pytest.raises(RuntimeError, match="Linear") as e:
        stale.backward()
    assert "\n" not in str(e.value)
    loss().backward()  # a new forward pass reads the new W: it runs


def test_training_steps_do_not_keep_previous_graphs_alive(device):
    """Count live autograd contexts across steps: they must not grow with the step count."""
    w = randn(device, 8, 8, seed=7)
    x = randn(device, 16, 8, seed=8, requires_grad=False)
    target = mt.tensor(np.arange(16) % 8, device=device)

    def live_contexts():
        gc.collect()
        return sum(isinstance(o, Context) for o in gc.get_objects())

    def step():
        loss = F.cross_entropy(F.relu(x @ w) @ w, target)
        loss.backward()
        w.data -= 0.1 * w.grad.data
        w.grad = None
        return loss

    kept = [step()]  # a caller that keeps each step's loss for logging
    baseline = live_contexts()
    ctx_refs = [weakref.ref(kept[0]._ctx)]
    for _ in range(20):
        kept.append(step())
    assert live_contexts() - baseline <= 20  # at most the freed root context of each kept loss
    assert all(len(ref().inputs) == 0 for ref in ctx_refs if ref() is not None)
    del kept
    assert live_contexts() < baseline


def test_custom_function_contract(device):
    class Cube(Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.save_for_backward(x)
            ctx.scale = scale
            return scale * x**3

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved
            return g * 3 * ctx.scale * x**2, None

    x = randn(device, 5, seed=9)
    gradcheck(lambda x: Cube.apply(x, 2.0), [x])


def test_wrong_number_of_gradients_is_reported(device):
    class Broken(Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(RuntimeError, match="returned 1 gradients for 2 inputs"):
        Broken.apply(randn(device, 2), randn(device, 2)).sum().backward()


@pytest.mark.skipif(not backend.has_cuda(), reason="no CUDA device (CuPy with a GPU)")
def test_mixing_devices_names_both():
    a = randn("cpu", 2, 3)
    b = randn("cuda", 2, 3)
    with pytest.raises(RuntimeError, match=r"cpu \(shape \(2, 3\)\).*cuda \(shape \(2, 3\)\)"):
        a + b


@pytest.mark.skipif(not backend.has_cuda(), reason="no CUDA device (CuPy with a GPU)")
def test_gradient_flows_across_devices():
    x = randn("cpu", 3)
    (x.to("cuda") * 2.0).sum().backward()
    assert x.grad.device == "cpu"
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 2.0))
