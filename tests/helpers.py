"""Helpers shared by the tests: fresh random inputs, hypothesis strategies, a tiny trained run."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import minitransformer as mt
from minitransformer import data, files, nn, settings
from minitransformer.checkpoint import save_checkpoint

# The repository's sibling shared/ folder holds the official Multi30k task-1 files; CI has them.
MULTI30K_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"
needs_multi30k = pytest.mark.skipif(not (MULTI30K_DIR / "train.en.gz").is_file(),
                                    reason=f"no Multi30k copy at {MULTI30K_DIR}")

# Small shapes keep finite differences cheap (two forward passes per input element) while
# still covering size-1 axes, which is where broadcasting bugs hide.
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)
seeds = st.integers(0, 2**32 - 1)


def broadcastable_pair(min_dims=1, max_dims=3):
    """Two shapes that broadcast together, e.g. (3, 1, 4) and (2, 1)."""
    return hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=min_dims, max_dims=max_dims,
                                             min_side=1, max_side=4).map(lambda r: r.input_shapes)


def randn(device, *shape, seed=0, dtype=np.float64, requires_grad=True, scale=1.0, offset=0.0):
    """A fresh random tensor (normal samples, never all zeros) on ``device``."""
    data = np.random.default_rng(seed).standard_normal(shape) * scale + offset
    return mt.tensor(data.astype(dtype), device=device, requires_grad=requires_grad)


def positive(device, *shape, seed=0, requires_grad=True):
    """Random float64 values in [0.5, 2): safe inputs for log, sqrt, division and pow."""
    data = np.random.default_rng(seed).uniform(0.5, 2.0, shape)
    return mt.tensor(data, device=device, requires_grad=requires_grad)


def grad_flags(n):
    """Which of n inputs require grad: any mix with at least one (gradcheck needs one), so that
    each op's ``ctx.needs_input_grad`` branches are exercised, not only the all-True one."""
    return st.lists(st.booleans(), min_size=n, max_size=n).filter(any)


def requiring_grad(tensors, flags):
    """``tensors`` with ``requires_grad`` set from ``flags``."""
    for t, f in zip(tensors, flags):
        t.requires_grad = f
    return tensors


WORDS = "a man dog woman child runs walks sits in on the street park water red blue small big".split()


def sentences(n, seed):
    """``n`` short English-like sentences from a 17-word vocabulary."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 9))).capitalize() + "." for _ in range(n)]


def pseudo_words(n, seed):
    """``n`` sentences of 200 random words over eight letters: words that BPE cannot learn whole
    in 100 pieces, so that which merge comes first decides a segmentation."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("abcdefgh"), rng.integers(2, 9))) for _ in range(200)]
    return [" ".join(rng.choice(words, rng.integers(3, 9))) for _ in range(n)]


def tiny_run(folder, seed=0):
    """A run folder as train_wmt.py leaves it, in a second: a 60-piece tokenizer and an untrained
    d_model=16 model in averaged.npz that names it, with 32 positions. Its embeddings are scaled
    up so that decoding is decisive (few near ties between candidates)."""
    tok = data.train_tokenizer(sentences(300, seed), folder / f"spm-bpe60-{seed}.model",
                               data.TokenizerConfig(vocab_size=60))
    mt.manual_seed(seed)
    model = nn.Transformer(nn.TransformerConfig(vocab_size=tok.vocab_size, d_model=16, d_ff=32, h=2,
                                                num_encoder_layers=1, num_decoder_layers=1, max_len=32))
    model.src_embed.weight.data *= 4
    save_checkpoint(str(folder / "averaged.npz"), model, extra={"tokenizer": tok.path.name})
    return folder


def tiny_test_set(folder, n=12, split="test_2016_flickr"):
    """A Multi30k-shaped folder with only ``split``, of ``n`` pairs (random sentences)."""
    for lang, seed in (("en", 6), ("de", 7)):
        (folder / f"{split}.{lang}").write_text("\n".join(sentences(n, seed)) + "\n")
    return folder


DECODING_CFG = dict(vocab_size=13, d_model=16, d_ff=32, h=2, num_encoder_layers=2, num_decoder_layers=2, dropout=0.1)


def sharp_model(device="cpu", seed=0, **overrides):
    """A small Transformer for decoding tests, in eval mode."""
    mt.manual_seed(seed)
    m = nn.Transformer(nn.TransformerConfig(**{**DECODING_CFG, **overrides})).to(device)
    # Sharpen the output distribution so that decoding is not a coin toss between ties.
    m.src_embed.weight.data *= 4
    return m.eval()


def sources(seed=0, n=4, max_len=6):
    """(n, max_len) source ids: 2 to max_len real tokens (ids 4-12) each, then padding."""
    rng = np.random.default_rng(seed)
    src = np.zeros((n, max_len), np.int64)
    for i in range(n):
        k = rng.integers(2, max_len + 1)
        src[i, :k] = rng.integers(4, 13, k)
    return src


def micro_batches(seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Three micro-batches (src, tgt_in, tgt_out) of one step, for gradient accumulation: ids
    of a 17-token vocabulary, different lengths and numbers of sentences and of padded target
    tokens; the last has one sentence (a rank's share of it may be empty)."""
    rng = np.random.default_rng([seed, 11])
    batches = []
    for rows, src_len, tgt_len in ((3, 5, 6), (4, 4, 8), (1, 6, 4)):
        src = rng.integers(4, 17, (rows, src_len))
        tgt = rng.integers(4, 17, (rows, tgt_len + 1))
        tgt[:, 0] = 2
        tgt[0, -2:] = 0
        batches.append((src, tgt[:, :-1], tgt[:, 1:]))
    return batches


def union(batches) -> tuple[np.ndarray, ...]:
    """The micro-batches' sentences as one batch, padded to its longest."""
    def padded(arrays):
        width = max(a.shape[1] for a in arrays)
        return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays])
    return tuple(padded([b[i] for b in batches]) for i in range(3))


def ended_process() -> tuple[int, str]:
    """The pid and start time of a process of this host that has ended: the owner of a killed
    write's leftovers (minitransformer.files)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = files._process_start(proc.pid)
    proc.kill()
    proc.wait()
    return proc.pid, start


@contextlib.contextmanager
def tmpfs(folder, options: str = "size=64k"):
    """A small tmpfs mounted at ``folder`` (made here): a disk that fills, or a read-only one.
    Mounting needs root: CI runs as root and requires it (MT_REQUIRE_TMPFS=1); elsewhere the
    test skips."""
    folder = Path(folder)
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        if settings.env_flag("MT_REQUIRE_TMPFS"):
            pytest.fail(f"MT_REQUIRE_TMPFS is set but a tmpfs cannot be mounted: {mounted.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(disk, leave: int = 0) -> None:
    """Fill the tmpfs ``disk`` but for about ``leave`` bytes (whole pages), with a file of its own."""
    fd = os.open(Path(disk) / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # full
        os.ftruncate(fd, max(os.fstat(fd).st_size - leave, 0))
    finally:
        os.close(fd)
