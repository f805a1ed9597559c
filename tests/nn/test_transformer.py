import re

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import functional as F
from minitransformer import nn
from minitransformer.nn.embedding import sinusoid_table
from minitransformer.gradcheck import gradcheck

SMALL = dict(vocab_size=23, d_model=16, d_ff=32, h=4, num_encoder_layers=2, num_decoder_layers=2)


def small_model(device="cpu", **overrides):
    mt.manual_seed(0)
    return nn.Transformer(nn.TransformerConfig(**{**SMALL, **overrides})).to(device)


def random_batch(seed=0, b=3, s=7, t=5, vocab=23, pad_tail=True):
    rng = np.random.default_rng(seed)
    src = rng.integers(4, vocab, (b, s))
    tgt = rng.integers(4, vocab, (b, t))
    if pad_tail:
        src[0, -2:] = 0
        tgt[1, -1:] = 0
    return src, tgt


@pytest.mark.parametrize("preset,expected", [("base", 63_082_496), ("big", 214_245_376)])
def test_paper_presets_parameter_counts(preset, expected):
    cfg = getattr(nn.TransformerConfig, preset)(vocab_size=37000)
    assert nn.expected_num_parameters(cfg) == expected
    assert nn.Transformer(cfg).num_parameters() == expected


@pytest.mark.parametrize("overrides", [{}, {"share_embeddings": False, "tgt_vocab_size": 19},
                                       {"norm_first": True}, {"learned_positions": True, "max_len": 32},
                                       {"d_k": 2, "d_v": 6}, {"h": 3, "d_k": 4, "d_v": 5}])
def test_module_count_equals_formula(overrides):
    cfg = nn.TransformerConfig(**{**SMALL, **overrides})
    assert nn.Transformer(cfg).num_parameters() == nn.expected_num_parameters(cfg)


def test_presets_follow_table_3():
    base, big = nn.TransformerConfig.base(), nn.TransformerConfig.big()
    assert (base.num_encoder_layers, base.d_model, base.d_ff, base.h, base.dropout, base.label_smoothing) == (6, 512, 2048, 8, 0.1, 0.1)
    assert (big.d_model, big.d_ff, big.h, big.dropout) == (1024, 4096, 16, 0.3)


def test_embeddings_are_shared_three_ways():
    m = small_model()
    assert m.src_embed is m.tgt_embed and m.out_proj is None
    src, tgt = random_batch()
    F.cross_entropy(m(src, tgt), tgt, 0.1, 0).backward()
    assert m.src_embed.weight.grad is not None
    assert sum(p is m.src_embed.weight for p in m.parameters()) == 1


@pytest.mark.parametrize("shared", [True, False])
def test_the_projector_for_decoding_is_project(shared):
    """Decoding's projection gives project's logits; tied, it holds a copy of W_emb^T made
    when it was made (a later change of the weights is a new projector's)."""
    m = small_model(share_embeddings=shared, **({} if shared else {"tgt_vocab_size": 23}))
    states = mt.tensor(np.random.default_rng(3).standard_normal((5, 1, m.config.d_model)).astype(np.float32))
    project = m.projector()
    before = m.project(states).numpy()
    assert project(states).shape == before.shape == (5, 1, m.config.target_vocab_size)
    np.testing.assert_allclose(project(states).numpy(), before, rtol=1e-6, atol=1e-6)
    (m.tgt_embed if shared else m.out_proj).weight.data += 1.0
    np.testing.assert_allclose(m.projector()(states).numpy(), m.project(states).numpy(), rtol=1e-6, atol=1e-6)
    assert np.array_equal(project(states).numpy(), before) == shared  # the tied copy is the old weights'


def test_embeddings_start_at_unit_scale_after_the_sqrt_d_model_factor():
    """Standard deviation d_model^-1/2 (not variance): times sqrt(d_model), unit scale."""
    d_model = 256
    weight = nn.Embedding(4000, d_model).weight.numpy()
    assert weight.std() == pytest.approx(d_model**-0.5, rel=0.02)
    assert (weight * d_model**0.5).std() == pytest.approx(1.0, rel=0.02)


def test_sinusoid_matches_section_3_5_and_grows():
    table = sinusoid_table(50, 8)
    pos, i = 17, 3
    assert table[pos, 2 * i] == pytest.approx(np.sin(pos / 10000 ** (2 * i / 8)))
    assert table[pos, 2 * i + 1] == pytest.approx(np.cos(pos / 10000 ** (2 * i / 8)))
    pe = nn.PositionalEncoding(8, max_len=4)
    x = mt.randn(1, 9, 8)
    np.testing.assert_allclose(pe(x).numpy()[0], x.numpy()[0] + table[:9], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pe(x[:, :2], offset=7).numpy()[0], x.numpy()[0, :2] + table[7:9],
                               rtol=1e-6, atol=1e-6)
    learned = nn.PositionalEncoding(8, max_len=4, learned=True)
    with pytest.raises(ValueError, match="4 positions"):
        learned(x)


def test_post_norm_layer_structure():
    """LayerNorm(x + Dropout(Sublayer(x))): every sublayer output has zero mean, unit variance."""
    m = small_model(dropout=0.0).eval()
    src, _ = random_batch()
    layer = m.encoder.layers[0]
    out = layer(m._embed(m.src_embed, src), m.src_key_mask(src)).numpy()
    np.testing.assert_allclose(out.mean(-1), 0, atol=1e-5)
    np.testing.assert_allclose(out.var(-1), 1, atol=1e-3)


def test_padding_does_not_change_other_positions():
    m = small_model().eval()
    src, tgt = random_batch(pad_tail=False)
    padded = np.concatenate([src, np.zeros((3, 4), np.int64)], axis=1)
    np.testing.assert_allclose(m(src, tgt).numpy(), m(padded, tgt).numpy(), rtol=1e-5, atol=1e-6)


def test_decoder_is_causal():
    m = small_model().eval()
    src, tgt = random_batch()
    changed = tgt.copy()
    changed[:, 3:] = 5
    a, b = m(src, tgt).numpy(), m(src, changed).numpy()
    np.testing.assert_allclose(a[:, :3], b[:, :3], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, 3:], b[:, 3:])


def test_attention_weights_are_returned_for_plots():
    mha = nn.MultiHeadAttention(16, 4)
    x = mt.randn(2, 5, 16)
    real = np.ones((2, 5), bool)
    real[1, 3:] = False  # padding
    out, w = mha(x, x, x, key_mask=F.KeyMask(real), need_weights=True)
    assert out.shape == (2, 5, 16) and w.shape == (2, 4, 5, 5)
    np.testing.assert_allclose(w.numpy().sum(-1), 1, rtol=1e-5)
    np.testing.assert_array_equal(w.numpy()[1, :, :, 3:], 0)
    with pytest.raises(TypeError, match="key_mask must be an F.KeyMask"):
        mha(x, x, x, key_mask=real)


def test_whole_model_gradient_in_float64():
    """Finite differences through embedding, attention, layernorm and the tied projection."""
    m = small_model(d_model=8, d_ff=8, h=2, num_encoder_layers=1, num_decoder_layers=1, dropout=0.0)
    for p in m.parameters():
        p.data = p.data.astype(np.float64)
    src, tgt = random_batch(b=2, s=3, t=3)
    w = m.decoder.layers[0].cross_attn.q_proj.weight
    emb = m.src_embed.weight

    def loss(w_, emb_):
        return F.cross_entropy(m(src, tgt), tgt, 0.1, 0)

    gradcheck(loss, [w, emb], atol=1e-6)


def test_key_and_value_sizes_apart_from_d_model_over_h():
    """Table 3 row (B): a smaller d_k with d_v kept; h need not divide d_model then."""
    mha = nn.MultiHeadAttention(16, 4, d_k=2, d_v=6)
    assert mha.q_proj.weight.shape == mha.k_proj.weight.shape == (16, 8)  # d_model x h·d_k
    assert mha.v_proj.weight.shape == (16, 24) and mha.out_proj.weight.shape == (24, 16)
    x = mt.randn(2, 5, 16)
    out, w = mha(x, x, x, need_weights=True)
    assert out.shape == (2, 5, 16) and w.shape == (2, 4, 5, 5)
    assert nn.MultiHeadAttention(15, 4, d_k=3, d_v=3).q_proj.weight.shape == (15, 12)
    with pytest.raises(ValueError, match="not divisible by h=4"):
        nn.MultiHeadAttention(15, 4)
    with pytest.raises(ValueError, match="divisible by h=3"):
        nn.TransformerConfig(**{**SMALL, "h": 3})


def test_explicit_d_model_over_h_is_the_default_model():
    default, explicit = small_model(), small_model(d_k=4, d_v=4)
    src, tgt = random_batch()
    np.testing.assert_array_equal(default.eval()(src, tgt).numpy(), explicit.eval()(src, tgt).numpy())


def test_gradient_with_d_k_apart_from_d_v_and_learned_positions():
    """Finite differences through heads of unequal key and value sizes (the scale is
    1/sqrt(d_k)) and through the learned position table of row (E)."""
    m = small_model(d_model=8, d_ff=8, h=2, d_k=3, d_v=5, num_encoder_layers=1, num_decoder_layers=1,
                    dropout=0.0, learned_positions=True, max_len=4)
    for p in m.parameters():
        p.data = p.data.astype(np.float64)
    src, tgt = random_batch(b=2, s=3, t=3)
    attn = m.decoder.layers[0].cross_attn
    tensors = [attn.q_proj.weight, attn.v_proj.weight, attn.out_proj.weight, m.positions.weight]

    def loss(*_):
        return F.cross_entropy(m(src, tgt), tgt, 0.1, 0)

    gradcheck(loss, tensors, atol=1e-6)


def _one_line_error(kind, match, fn, *args, **kwargs):
    with pytest.raises(kind, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field,bad,edge,rule", [
    ("vocab_size", 0, 5, "an integer >= 1"),
    ("tgt_vocab_size", 0, 1, "an integer >= 1"),  # 0 was read as "joint"
    ("d_model", 128.0, 4, "an integer >= 1"),  # float: would fail later in NumPy
    ("d_model", True, 4, "an integer >= 1"),
    ("d_ff", 0, 1, "an integer >= 1"),
    ("h", 0, 1, "an integer >= 1"),  # was a ZeroDivisionError
    ("h", -4, 1, "an integer >= 1"),
    ("d_k", 2.5, 1, "an integer >= 1"),
    ("num_encoder_layers", -1, 0, "an integer >= 0"),  # 0: the decoder attends to the embeddings
    ("num_decoder_layers", 0, 1, "an integer >= 1"),
    ("max_len", 0, 1, "an integer >= 1"),
    ("pad_id", -1, 0, "an integer >= 0"),
    ("bos_id", -2, 0, "an integer >= 0"),
    ("eos_id", 3.0, 0, "an integer >= 0"),
    ("dropout", 1.0, 0.0, r"a number in \[0, 1\)"),
    ("dropout", -0.1, 0.99, r"a number in \[0, 1\)"),
    ("attention_dropout", float("nan"), 0.5, r"a number in \[0, 1\)"),
    ("label_smoothing", 1.5, 0.0, r"a number in \[0, 1\)"),
    ("label_smoothing", "0.1", 0.1, r"a number in \[0, 1\)"),
    ("layer_norm_eps", 0.0, 1e-12, "a finite number > 0"),
    ("layer_norm_eps", float("inf"), 1.0, "a finite number > 0"),
])
def test_config_refuses_fields_out_of_range(field, bad, edge, rule):
    joint = {"share_embeddings": False} if field == "tgt_vocab_size" else {}
    nn.TransformerConfig(**{**SMALL, **joint, field: edge})
    _one_line_error(ValueError, rf"^TransformerConfig: {field} must be {rule}, got {re.escape(repr(bad))}$",
                    nn.TransformerConfig, **{**SMALL, **joint, field: bad})


@pytest.mark.parametrize("make,message", [
    (lambda: nn.MultiHeadAttention(16, 0), "MultiHeadAttention: h must be an integer >= 1, got 0"),
    (lambda: nn.MultiHeadAttention(16, -4), "MultiHeadAttention: h must be an integer >= 1, got -4"),
    (lambda: nn.MultiHeadAttention(0, 4), "MultiHeadAttention: d_model must be an integer >= 1, got 0"),
    (lambda: nn.MultiHeadAttention(16, 4, d_k=0, d_v=4), "MultiHeadAttention: d_k must be an integer >= 1, got 0"),
    (lambda: nn.MultiHeadAttention(16, 4, dropout=1.0),
     r"MultiHeadAttention: dropout must be a number in \[0, 1\), got 1.0"),
])
def test_multi_head_attention_refuses_bad_sizes(make, message):
    _one_line_error(ValueError, "^" + message + "$", make)


@pytest.mark.parametrize("shared", [True, False])
def test_fairseq_init_is_fairseq_0_9_s(shared):
    """init="fairseq" (fairseq v0.9.0's transformer.py and multihead_attention.py): W^Q, W^K, W^V
    Xavier-uniform with gain 1/sqrt(2) and biases U(+-1/sqrt(d_model)); W^O and the feed-forward
    layers Xavier-uniform with zero biases; the PAD row of the embeddings zero, the others
    N(0, d_model^-1/2); an untied output projection N(0, d_model^-1/2); LayerNorm ones and zeros."""
    d = 64
    overrides = dict(d_model=d, d_ff=128, vocab_size=400, init="fairseq")
    if not shared:
        overrides.update(share_embeddings=False, tgt_vocab_size=300)
    m = small_model(**overrides)
    plain = small_model(**{**overrides, "init": "plain"})
    xavier = np.sqrt(6 / (d + d))
    for layer in list(m.encoder.layers) + list(m.decoder.layers):
        attns = [layer.self_attn] + ([layer.cross_attn] if hasattr(layer, "cross_attn") else [])
        for attn in attns:
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                w, b = proj.weight.numpy(), proj.bias.numpy()
                assert np.abs(w).max() <= xavier / np.sqrt(2) and np.abs(w).max() > 0.98 * xavier / np.sqrt(2)
                assert np.abs(b).max() <= d ** -0.5 and np.abs(b).max() > 0.8 * d ** -0.5
            assert np.abs(attn.out_proj.weight.numpy()).max() > 0.98 * xavier  # gain 1
            assert not attn.out_proj.bias.numpy().any()
        assert not layer.ffn.w_1.bias.numpy().any() and not layer.ffn.w_2.bias.numpy().any()
        assert np.all(layer.sub1.norm.weight.numpy() == 1) and not layer.sub1.norm.bias.numpy().any()
    for embed in {id(e): e for e in (m.src_embed, m.tgt_embed)}.values():
        table = embed.weight.numpy()
        assert not table[m.config.pad_id].any()
        assert table[1:].std() == pytest.approx(d ** -0.5, rel=0.03)
    if not shared:
        assert m.out_proj.weight.numpy().std() == pytest.approx(d ** -0.5, rel=0.03)
    # The plain init, for contrast: zero attention biases, gain 1, no zero row.
    q = plain.encoder.layers[0].self_attn.q_proj
    assert not q.bias.numpy().any() and np.abs(q.weight.numpy()).max() > 0.98 * xavier
    assert plain.src_embed.weight.numpy()[plain.config.pad_id].any()
    # What fairseq draws as we do keeps the plain draws of the same seed.
    np.testing.assert_array_equal(m.encoder.layers[0].ffn.w_1.weight.numpy(),
                                  plain.encoder.layers[0].ffn.w_1.weight.numpy())


def test_the_decoder_start_is_bos_unless_eos_and_an_old_config_is_bos():
    assert small_model().config.start_id == nn.TransformerConfig().bos_id
    assert small_model(decoder_start="eos").config.start_id == nn.TransformerConfig().eos_id
    old = {k: v for k, v in nn.TransformerConfig(**SMALL).to_dict().items() if k not in ("init", "decoder_start")}
    cfg = nn.TransformerConfig.from_dict(old)  # a checkpoint from before the two fields
    assert (cfg.start_id, cfg.init) == (cfg.bos_id, "plain")
    for field, bad in (("init", "xavier"), ("decoder_start", "pad"), ("decoder_start", 3)):
        with pytest.raises(ValueError, match=field):
            nn.TransformerConfig(**{**SMALL, field: bad})
