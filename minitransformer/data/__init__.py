"""Data for translation: parallel corpora, their download, BPE tokenization, token batching.

    corpus      read Multi30k / WMT14 EN-DE (plain, .gz, .sgm), with checked alignment
    download    python -m minitransformer.data.download multi30k|wmt14 --dest DIR
    moses       the Multi30k literature's text: lowercased, normalized, Moses-tokenized (sacremoses)
    tokenizer   BPE, one vocabulary for both languages (sentencepiece, or subword-nmt); PAD/UNK/BOS/EOS = 0/1/2/3
    batching    batches of about max_tokens tokens, bucketed by length, sharded over ranks

A training script strings them together::

    from minitransformer import data
    from minitransformer.data.download import ensure_dataset

    data_dir = ensure_dataset("multi30k", "data/multi30k")  # downloads if files are missing
    train = data.load_corpus("multi30k", data_dir, "train")
    tok = data.load_or_train(train, config=data.PRESETS["multi30k"])
    batcher = data.TokenBatcher(tok.encode(train.src), tok.encode(train.tgt),
                                max_tokens=4096, max_len=256, seed=1, rank=0, world_size=1)
    for batch in batcher:                    # batch.src (B, S), batch.tgt_in / tgt_out (B, T)
        ...                                  # checkpoint batcher.state_dict() to resume

For WMT14, ``data.encode_packed(tok, train.src)`` instead of ``tok.encode(train.src)``
keeps the 4.5M tokenized pairs in one flat array rather than ~10 GB of Python lists.

The download module is not imported here, so that ``python -m minitransformer.data.download``
runs it once, as a script. This package uses NumPy (and sentencepiece, subword-nmt, tqdm) only; it
imports nothing from the model or the autograd engine.
"""

from . import moses
from .batching import Batch, PackedSequences, TokenBatcher, collate, encode_packed
from .corpus import (
    CorpusError, ParallelCorpus, decode_utf8, find_split_file, load_corpus, load_multi30k, load_wmt14,
    missing_files, read_lines, read_parallel, read_sgm,
)
from .tokenizer import (
    BOS_ID, EOS_ID, PAD_ID, PRESETS, SUBWORDS, UNK_ID, SubwordNmtConfig, SubwordNmtTokenizer, Tokenizer,
    TokenizerConfig, TokenizerError, load_or_train, open_tokenizer, train_subword_nmt, train_tokenizer,
)

__all__ = [
    "BOS_ID", "Batch", "CorpusError", "EOS_ID", "PAD_ID", "PRESETS", "PackedSequences",
    "ParallelCorpus", "SUBWORDS", "SubwordNmtConfig", "SubwordNmtTokenizer", "TokenBatcher", "Tokenizer",
    "TokenizerConfig", "TokenizerError", "UNK_ID", "collate", "decode_utf8", "encode_packed", "find_split_file",
    "load_corpus", "load_multi30k", "load_or_train", "load_wmt14", "missing_files", "moses", "open_tokenizer",
    "read_lines", "read_parallel", "read_sgm", "train_subword_nmt", "train_tokenizer",
]

