import numpy as np
import pytest

import minitransformer as mt
from minitransformer import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 2, bias=False)
        self.tied = self.first  # the same module twice: its parameters are listed once
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.second(self.drop(self.first(x).relu()))


def test_parameters_are_registered_with_dotted_names_once():
    m = Tiny()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["first.weight", "first.bias", "second.weight"]
    assert m.num_parameters() == 3 * 4 + 4 + 4 * 2
    assert [type(c).__name__ for c in m.children()] == ["Linear", "Linear", "Linear", "Dropout"]


def test_train_eval_and_zero_grad():
    m = Tiny()
    m.eval()
    assert not m.drop.training and not m.first.training
    x = mt.randn(5, 3)
    np.testing.assert_array_equal(m(x).numpy(), m(x).numpy())  # no dropout in eval
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    m.train()
    assert m.drop.training


def test_state_dict_round_trip_and_errors():
    a, b = Tiny(), Tiny()
    stale = b(mt.randn(2, 3)).sum()
    b.load_state_dict(a.state_dict())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(pa.numpy(), pb.numpy())
    with pytest.raises(RuntimeError):  # its graph saved the weights load_state_dict replaced
        stale.backward()
    state = a.state_dict()
    state["extra.weight"] = np.zeros(1)
    del state["second.weight"]
    with pytest.raises(KeyError, match=r"missing keys \['second.weight'\].*unexpected keys \['extra.weight'\]"):
        b.load_state_dict(state)
    missing, unexpected = b.load_state_dict(state, strict=False)
    assert missing == ["second.weight"] and unexpected == ["extra.weight"]
    state = a.state_dict()
    state["first.weight"] = np.zeros((2, 2))
    with pytest.raises(ValueError, match=r"first.weight: checkpoint \(2, 2\) vs model \(3, 4\)"):
        b.load_state_dict(state)


def test_a_registered_name_keeps_its_kind():
    """A plain Tensor over a Parameter would leave parameters() and state_dict() (untrained,
    unsaved): refused, as in PyTorch, with the module as it was; so is a non-Module over a
    submodule. A Parameter replaces a Parameter, and None removes it."""
    m = Tiny()
    before = [id(p) for p in m.parameters()]
    for name, value in (("weight", mt.zeros(3, 4)), ("weight", np.zeros((3, 4))), ("bias", 1.0)):
        with pytest.raises(TypeError) as e:
            setattr(m.first, name, value)
        assert "\n" not in str(e.value)
    with pytest.raises(TypeError):
        m.second = mt.zeros(4, 2)
    assert [id(p) for p in m.parameters()] == before and list(m.state_dict()) == list(Tiny().state_dict())
    new = m.first.weight = nn.Parameter(mt.zeros(3, 4))
    assert next(m.parameters()) is new
    m.first.bias = None
    assert [n for n, _ in m.named_parameters()] == ["first.weight", "second.weight"]
    m.first.bias = mt.zeros(4)  # no longer registered: a plain attribute again
    bias = m.first.bias = nn.Parameter(mt.zeros(4))  # registered again, not hidden by the attribute
    assert m.first.bias is bias and "first.bias" in m.state_dict()
    m.register_buffer("scale", mt.ones(1))
    m.scale = mt.full(1, 2.0)
    assert dict(m.named_buffers())["scale"].item() == 2.0
    with pytest.raises(TypeError):
        m.scale = 2.0


def test_to_keeps_parameter_objects(device):
    m = Tiny()
    params = list(m.parameters())
    m.to(device)
    assert all(p is q for p, q in zip(params, m.parameters()))
    assert all(p.device == device for p in m.parameters())


def test_linear_is_xavier_uniform_and_xw_plus_b():
    mt.manual_seed(0)
    lin = nn.Linear(300, 200)
    w = lin.weight.numpy()
    bound = np.sqrt(6 / 500)
    assert w.shape == (300, 200) and np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
    np.testing.assert_allclose(w.var(), bound**2 / 3, rtol=0.05)
    x = mt.randn(7, 300)
    np.testing.assert_allclose(lin(x).numpy(), x.numpy() @ w + lin.bias.numpy(), rtol=1e-5)


def test_embedding_starts_at_standard_deviation_one_over_sqrt_d_model():
    """Scaled by sqrt(d_model) at the input (section 3.4), a row then has unit-scale entries,
    the positional encodings' scale; unscaled at the output, logits of variance about 1."""
    mt.manual_seed(0)
    d_model = 256
    w = nn.Embedding(4000, d_model).weight.numpy()
    np.testing.assert_allclose(w.std(), d_model**-0.5, rtol=0.01)
    np.testing.assert_allclose((w * np.sqrt(d_model)).std(), 1.0, rtol=0.01)
    assert abs(w.mean()) < 0.01 * d_model**-0.5


def test_manual_seed_makes_init_reproducible():
    mt.manual_seed(3)
    a = Tiny().state_dict()
    mt.manual_seed(3)
    b = Tiny().state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("make,message", [
    (lambda: nn.Linear(0, 4), "Linear: in_features must be an integer >= 1, got 0"),  # was 6 / 0
    (lambda: nn.Linear(2.5, 4), "Linear: in_features must be an integer >= 1, got 2.5"),
    (lambda: nn.Linear(3, -1), "Linear: out_features must be an integer >= 1, got -1"),
    (lambda: nn.Embedding(0, 4), "Embedding: num_embeddings must be an integer >= 1, got 0"),
    (lambda: nn.Embedding(5, 0), "Embedding: d_model must be an integer >= 1, got 0"),
    (lambda: nn.PositionalEncoding(8, max_len=-1), "PositionalEncoding: max_len must be an integer >= 1, got -1"),
    (lambda: nn.LayerNorm(0), "LayerNorm: d_model must be an integer >= 1, got 0"),
    (lambda: nn.LayerNorm(4, eps=0.0), "LayerNorm: eps must be a finite number > 0, got 0.0"),
    (lambda: nn.LayerNorm(4, eps=-1e-5), "LayerNorm: eps must be a finite number > 0, got -1e-05"),
    (lambda: nn.Dropout(1.5), r"Dropout: p must be a number in \[0, 1\], got 1.5"),
    (lambda: nn.Dropout(-0.1), r"Dropout: p must be a number in \[0, 1\], got -0.1"),
    (lambda: nn.Dropout(float("nan")), r"Dropout: p must be a number in \[0, 1\], got nan"),
])
def test_layers_refuse_bad_sizes_and_rates(make, message):
    with pytest.raises(ValueError, match="^" + message + "$") as e:
        make()
    assert "\n" not in str(e.value)
    assert nn.Dropout(1.0).p == 1.0  # F.dropout's p = 1 zeroes everything, as in PyTorch
