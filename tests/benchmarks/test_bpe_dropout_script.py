"""benchmarks/bpe_dropout.py: the paper's sampling and sentencepiece's, side by side, at a toy size."""

import sys
from pathlib import Path

import pytest

from minitransformer import data
from tests.helpers import pseudo_words, tiny_test_set

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bpe_dropout  # noqa: E402


def test_the_table_grows_with_the_rate_for_both_samplers(tmp_path, capsys):
    model = data.train_tokenizer(pseudo_words(300, 3), tmp_path / "spm.model", data.TokenizerConfig(vocab_size=100))
    folder = tiny_test_set(tmp_path, n=40, split="train")
    result = bpe_dropout.main(["--tokenizer", str(model.path), "--data-dir", str(folder), "--rates", "0.1,0.3,0.6"])
    for sampler in ("paper", "sentencepiece"):
        lengths = [result[rate][sampler] for rate in (0.1, 0.3, 0.6)]
        assert 1 < lengths[0] < lengths[1] < lengths[2]
    assert "40 training pairs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bpe_dropout.main(["--tokenizer", str(model.path), "--data-dir", str(folder), "--rates", "0.1,1.0"])
    assert "--rates" in capsys.readouterr().err
