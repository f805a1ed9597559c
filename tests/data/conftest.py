"""Fixtures for the data tests: the shared Multi30k copy, random sentence pairs from it."""

from pathlib import Path

import numpy as np
import pytest

from minitransformer.data import load_multi30k
from tests.helpers import MULTI30K_DIR


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    if not (MULTI30K_DIR / "train.en.gz").is_file():
        pytest.skip(f"no Multi30k copy at {MULTI30K_DIR}")
    return MULTI30K_DIR


@pytest.fixture(scope="session")
def multi30k_train(multi30k_dir):
    return load_multi30k(multi30k_dir, "train")


@pytest.fixture(scope="session")
def sample_pairs(multi30k_train):
    """400 random training pairs (a new sample each session)."""
    rng = np.random.default_rng()
    return multi30k_train.subset(rng.choice(len(multi30k_train), size=400, replace=False))
