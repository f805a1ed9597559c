"""examples/tour.py: its pictures, what they claim, and the observers it added to the library
(beam_search's ``observer``, the attention twin's ``observer``), which must change nothing.

The tour runs once per session (the ``tour`` fixture of tests/conftest.py)."""

import pathlib
import sys

import numpy as np
import pytest
from matplotlib import image

import minitransformer as mt
from minitransformer.decoding import BeamStep, beam_search
from minitransformer.kernels import reference
from tests.helpers import sharp_model, sources

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from tour import PICTURES  # noqa: E402


@pytest.mark.slow  # the whole tour
@pytest.mark.parametrize("name", PICTURES)
def test_every_picture_is_written_and_not_blank(tour, name):
    folder, _ = tour
    pixels = image.imread(folder / name)  # (height, width, RGBA) in [0, 1]
    assert pixels.shape[1] >= 700, "too narrow to read at 700 px"
    rgb = np.round(pixels[..., :3] * 255).astype(np.int64)
    colours = np.unique(rgb[..., 0] * 65536 + rgb[..., 1] * 256 + rgb[..., 2])
    assert rgb.std() > 10 and len(colours) > 50, f"{name} is (nearly) blank"


def test_the_copy_models_cross_attention_is_diagonal(tour):
    _, result = tour
    assert result.diagonal_mass >= 0.8


def test_online_softmax_ends_at_the_full_softmax(tour):
    _, result = tour
    assert result.online_softmax_error <= 1e-6  # NaN fails too


def test_the_beam_search_drawn_decodes_its_source(tour):
    _, result = tour
    assert result.beam_hypothesis == result.beam_source  # a trained copy model copies


@pytest.mark.parametrize("beam_size", [1, 3])
def test_beam_search_observer_changes_nothing_and_reports_the_search(beam_size):
    model, src = sharp_model(num_encoder_layers=1), mt.tensor(sources(n=5))
    plain = beam_search(model, src, beam_size, return_scores=True, max_len_extra=4)
    steps: list[BeamStep] = []
    traced = beam_search(model, src, beam_size, return_scores=True, max_len_extra=4, observer=steps.append)
    assert traced == plain
    assert [s.t for s in steps] == list(range(len(steps)))
    for step in steps:
        scores = step.candidate_scores
        assert (scores[:, :-1] >= scores[:, 1:]).all()  # best first
        assert step.kept_rows.shape == step.kept_words.shape == (len(step.kept_sentences), beam_size)
        for n, sid in enumerate(step.kept_sentences):  # every kept beam is one of its sentence's candidates
            slot = int(np.flatnonzero(step.sentences == sid)[0])
            candidates = set(zip(step.candidate_rows[slot].tolist(), step.candidate_words[slot].tolist()))
            assert set(zip(step.kept_rows[n].tolist(), step.kept_words[n].tolist())) <= candidates
    for sid, (hyp, score) in enumerate(plain):  # the winner is the best finished hypothesis reported
        finished = [(tokens, s) for step in steps for i, tokens, _, s in step.finished if i == sid]
        assert max(finished, key=lambda f: f[1]) == (hyp, score)


def test_attention_twin_observer_changes_nothing_and_sees_every_tile():
    rng = np.random.default_rng(0)
    B, H, T, S, D = 2, 2, 20, 37, 8
    q, k, v = (rng.standard_normal((B, H, n, D)).astype(np.float32) for n in (T, S, S))
    options = dict(kv_lens=[37, 21], causal=True, block_q=8, block_k=16)
    plain = reference.attention_forward(q, k, v, **options)
    calls = []
    traced = reference.attention_forward(
        q, k, v, **options, observer=lambda rows, cols, m, l, o: calls.append((rows, cols, l.copy(), o.copy())))
    assert all(np.array_equal(a, b) for a, b in zip(plain, traced))  # bit for bit
    # Causal, T < S: query tile [q0, q0 + 8) reads key tiles up to its last row's horizon q0 + 7 + S - T.
    expected = [(q0, k0) for q0 in range(0, T, 8) for k0 in range(0, min(q0 + 8, T) + S - T, 16)]
    assert [(int(r[0]), int(c[0])) for r, c, _, _ in calls] == expected
    for rows, cols, l, o_acc in calls:
        if cols[-1] + 1 >= min(rows[-1] + 1 + S - T, S):  # the tile's last: o_acc / l is its output
            np.testing.assert_allclose(o_acc / l[..., None], plain[0][:, :, rows], rtol=1e-6, atol=1e-7)
