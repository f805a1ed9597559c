"""Subword tokenizers: BPE with one vocabulary shared by both languages, by sentencepiece (the
default) or by subword-nmt (``SubwordNmtTokenizer``, the Multi30k literature's).

The paper (section 5.1) encodes WMT14 EN-DE "using byte-pair encoding, which has a shared
source-target vocabulary of about 37000 tokens". One vocabulary for both sides lets the
model tie the source embedding, the target embedding and the pre-softmax projection
(section 3.4), and copies names and numbers straight across. BPE (Sennrich et al., 2016)
starts from characters and merges the most frequent adjacent pair until the vocabulary has
``vocab_size`` pieces; sentencepiece runs it on raw text (a space becomes the "▁" that
starts a word), so decoding gives detokenized text that goes to sacreBLEU as is (NFKC
normalized, runs of spaces collapsed: the only changes a round trip makes).

Fixed ids, whatever the vocabulary size, so every layer can name them:

    PAD_ID = 0   padding; masked out of attention and of the loss
    UNK_ID = 1   a character never seen in training
    BOS_ID = 2   first decoder input (the batcher puts it in front of each target), unless
                 the model starts from EOS (``TransformerConfig.decoder_start``)
    EOS_ID = 3   ends every source and target sequence; decoding stops at it

Sizes: ``PRESETS["multi30k"]`` uses 8,000 pieces (29,000 short caption pairs; in the main
job's hour 4,000 and 16,000 both scored lower on validation: docs/guide/reproducing.md),
``PRESETS["wmt14"]`` 37,000 as in the paper, trained on a 4M-sentence random sample of the
9M training sentences (both sides), which sentencepiece draws itself.

``load_or_train`` caches the model beside the data, in a file named by a fingerprint of the
settings and of the training sentences, so changing ``vocab_size`` (or the data) trains a
new model and never silently reuses the old one. Under data parallelism, call it on rank 0
first and on the other ranks after a barrier, so that one process trains.

subword-nmt (Sennrich et al.'s own tool, which the Multi30k literature's fairseq recipes use)
learns ``merges`` merges on the text of both sides as it is given (words split on spaces:
Moses-tokenized for that literature), marks every piece but a word's last with "@@", and its
vocabulary is every piece of the training text segmented (fairseq's ``--joined-dictionary``
with no threshold), most frequent first. ``open_tokenizer`` opens either from its file:
``.model`` is sentencepiece's, ``.bpe`` subword-nmt's (JSON: the merges and the vocabulary).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from .. import schema
from ..files import atomic_write
from ..settings import SettingsError
from .corpus import CorpusError, ParallelCorpus

logger = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIAL_PIECES = ("<pad>", "<unk>", "<s>", "</s>")  # their pieces, in both tokenizers
_FORMAT = 1  # bump when a change here changes what a cached model would contain


@dataclass(frozen=True)
class TokenizerConfig:
    """How to train the BPE model.

    vocab_size: pieces in the shared vocabulary, the four special ids included.
    character_coverage: share of characters kept as pieces; 1.0 keeps every character of
        the training text (right for alphabetic scripts; rarer ones would become <unk>).
    input_sentence_size: train on a random sample of this many sentences (0: all of them).
    seed: seeds sentencepiece's sampling, so a sampled model is reproducible.
    """

    vocab_size: int = 8000
    character_coverage: float = 1.0
    input_sentence_size: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.vocab_size <= EOS_ID + 1:
            raise SettingsError(f"vocab_size must exceed the 4 special ids, got {self.vocab_size}")
        if not 0.0 < self.character_coverage <= 1.0:
            raise SettingsError(f"character_coverage must be in (0, 1], got {self.character_coverage}")
        if self.input_sentence_size < 0:
            raise SettingsError(f"input_sentence_size must be >= 0, got {self.input_sentence_size}")


PRESETS = {
    "multi30k": TokenizerConfig(vocab_size=8000),
    # For Moses-tokenized, lowercased Multi30k (data.moses): as many types as the literature's
    # joint subword-nmt BPE of 10,000 merges (9,708; sentencepiece's 10,000 pieces use 9,592).
    "multi30k-tiny": TokenizerConfig(vocab_size=10000),
    "wmt14": TokenizerConfig(vocab_size=37000, input_sentence_size=4_000_000),
    "smoke": TokenizerConfig(vocab_size=1000),  # 2,000 pairs: a few minutes' run
}


SUBWORDS = ("sentencepiece", "subword-nmt")  # the tokenizers, as train_wmt.py's --subwords names them


@dataclass(frozen=True)
class SubwordNmtConfig:
    """How to learn subword-nmt's BPE: ``merges`` merge operations (the literature's 10,000
    give Multi30k's lowercased Moses tokens about 9,700 types)."""

    merges: int = 10000

    def __post_init__(self):
        if self.merges < 1:
            raise SettingsError(f"merges must be at least 1, got {self.merges}")


class TokenizerError(CorpusError):
    """A tokenizer model file that cannot be used: not a sentencepiece model, a damaged one, or
    one with other special ids (a CorpusError: every program that reads data says it in one line)."""


def _content(batch: Iterable[Sequence[int]] | np.ndarray) -> list[list[int]]:
    """Each row of model output cut at its first EOS, PAD and BOS dropped."""
    rows = []
    for row in batch:
        row = [int(i) for i in row]
        if EOS_ID in row:
            row = row[: row.index(EOS_ID)]
        rows.append([i for i in row if i != PAD_ID and i != BOS_ID])
    return rows


class Tokenizer:
    """A trained sentencepiece model: text batches to id lists and back.

    ``encode`` gives the pieces only; the batcher adds BOS/EOS. ``decode`` accepts model
    output as it comes (lists or a padded (B, T) integer array): each row is cut at its
    first EOS, PAD and BOS are dropped, and the pieces are joined into plain text.
    """

    kind = "sentencepiece"

    def __init__(self, model_path: str | Path):
        self.path = Path(model_path)
        if not self.path.exists():
            raise FileNotFoundError(f"tokenizer model not found: {self.path}")
        if not self.path.is_file():  # a device or a FIFO would be read without end
            raise TokenizerError(f"{self.path} is not a regular file, so not a sentencepiece model")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError, ValueError) as e:
            raise TokenizerError(f"{self.path} is not a sentencepiece model, or a damaged one "
                                 f"({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})") from None
        ids = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise TokenizerError(
                f"{self.path} has special ids pad/unk/bos/eos = {ids}; this package needs "
                f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)} (train it with train_tokenizer)"
            )
        self.vocab_size = self._sp.get_piece_size()
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
        self._word_start = self._sp.piece_to_id("\u2581")  # "▁" alone, before an unknown word

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Piece ids of each sentence, without BOS/EOS."""
        if isinstance(texts, str):
            raise TypeError("encode takes a batch (a list of sentences), not one str")
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, batch: Iterable[Sequence[int]] | np.ndarray) -> list[str]:
        """Detokenized text of each row of ids (cut at the first EOS; PAD and BOS dropped)."""
        return self._sp.decode(_content(batch))

    def knows_nothing_of(self, ids: Sequence[int]) -> bool:
        """True when ``ids`` (one encoded sentence, not empty) are all <unk> and bare word
        starts: text none of whose characters were in the training data."""
        return all(i in (UNK_ID, self._word_start) for i in ids)

    def pieces(self, text: str) -> list[str]:
        """The subword pieces of one sentence, for reading what BPE made of it."""
        return self._sp.encode(text, out_type=str)

    def id_to_piece(self, ids: Sequence[int]) -> list[str]:
        """The piece of each id (labels for attention plots)."""
        return [self._sp.id_to_piece(int(i)) for i in ids]


# A subword-nmt tokenizer's file: its merges as learn_bpe writes them, and its vocabulary in id order.
_BPE_FILE = schema.Schema({
    "type": "object", "required": ["format", "codes", "vocab"],
    "properties": {"format": {"const": "subword-nmt"}, "codes": {"type": "string"},
                   "vocab": {**schema.STRINGS, "minItems": len(SPECIAL_PIECES) + 1, "uniqueItems": True}},
})


class SubwordNmtTokenizer:
    """subword-nmt's BPE, with ``Tokenizer``'s interface: ``encode`` splits each sentence on
    spaces and each word into its pieces (every piece but a word's last ends in "@@"), a piece
    the vocabulary lacks becoming <unk>; ``decode`` cuts and cleans rows as ``Tokenizer`` does,
    joins the pieces with spaces and removes each "@@ " (fairseq's ``--remove-bpe``)."""

    kind = "subword-nmt"

    def __init__(self, path: str | Path):
        from subword_nmt.apply_bpe import BPE  # here, not on top: 20 ms every import of the package would pay

        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"tokenizer model not found: {self.path}")
        if not self.path.is_file():
            raise TokenizerError(f"{self.path} is not a regular file, so not a subword-nmt tokenizer")
        saved = schema.load_json(self.path, _BPE_FILE, TokenizerError)
        codes, self._pieces = saved["codes"], saved["vocab"]
        if tuple(self._pieces[:len(SPECIAL_PIECES)]) != SPECIAL_PIECES:
            raise TokenizerError(f"{self.path} has the special pieces {self._pieces[:len(SPECIAL_PIECES)]}; this "
                                 f"package needs {list(SPECIAL_PIECES)} (learn it with train_subword_nmt)")
        header, *merges = codes.rstrip("\n").split("\n")
        # apply_bpe's BPE ends the process (sys.exit) on a malformed merge: refused here first.
        if not header.startswith("#version:") or any(len(m.split(" ")) != 2 or "" in m.split(" ") for m in merges):
            raise TokenizerError(f"{self.path}: its codes are not subword-nmt merges (two pieces a line)")
        self._bpe = BPE(io.StringIO(codes))
        self._ids = {piece: i for i, piece in enumerate(self._pieces)}
        self.vocab_size = len(self._pieces)
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __repr__(self) -> str:
        return f"SubwordNmtTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    def pieces(self, text: str) -> list[str]:
        return self._bpe.segment_tokens(text.split())

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Piece ids of each sentence, without BOS/EOS."""
        if isinstance(texts, str):
            raise TypeError("encode takes a batch (a list of sentences), not one str")
        return [[self._ids.get(p, UNK_ID) for p in self.pieces(text)] for text in texts]

    def decode(self, batch: Iterable[Sequence[int]] | np.ndarray) -> list[str]:
        """The text of each row of ids (cut at the first EOS; PAD and BOS dropped), pieces joined."""
        return [(" ".join(self.id_to_piece(row)) + " ").replace("@@ ", "").rstrip() for row in _content(batch)]

    def knows_nothing_of(self, ids: Sequence[int]) -> bool:
        """True when ``ids`` (one encoded sentence, not empty) are all <unk>."""
        return all(i == UNK_ID for i in ids)

    def id_to_piece(self, ids: Sequence[int]) -> list[str]:
        return [self._pieces[int(i)] for i in ids]


def open_tokenizer(path: str | Path) -> Tokenizer | SubwordNmtTokenizer:
    """The tokenizer in ``path``: subword-nmt's for a ``.bpe`` file, sentencepiece's otherwise."""
    return SubwordNmtTokenizer(path) if Path(path).suffix == ".bpe" else Tokenizer(path)


def train_tokenizer(sentences: Iterable[str], model_path: str | Path,
                    config: TokenizerConfig = TokenizerConfig()) -> Tokenizer:
    """Train a BPE model on ``sentences`` (both languages) and write it to ``model_path``.

    The file appears whole or not at all (written beside, then renamed), so a process that
    is killed mid-training never leaves a truncated model for the cache to pick up.
    """
    model_path = Path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    proto = io.BytesIO()  # sentencepiece writes the serialized model here
    counted = _Counter(sentences)
    spm.set_random_generator_seed(config.seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(counted), model_writer=proto,
            model_type="bpe", vocab_size=config.vocab_size,
            character_coverage=config.character_coverage,
            input_sentence_size=config.input_sentence_size,
            shuffle_input_sentence=True,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            **dict(zip(("pad_piece", "unk_piece", "bos_piece", "eos_piece"), SPECIAL_PIECES)),
            num_threads=os.cpu_count() or 1, minloglevel=2,
        )
    except RuntimeError as e:
        if counted.stopped_by is not None:  # raised while sentencepiece read (Ctrl-C: "INTERNAL: KeyboardInterrupt")
            raise counted.stopped_by from None
        # sentencepiece's reason without its source location: "Vocabulary size too high (8000).
        # Please set it to a value <= 1083." for a corpus too small for the vocabulary
        reason = re.sub(r"^.*?\] ", "", str(e))
        raise CorpusError(
            f"sentencepiece could not train a {config.vocab_size}-piece BPE vocabulary on "
            f"{counted.count} sentences: {reason}"
        ) from None
    with atomic_write(model_path, "wb") as f:
        f.write(proto.getvalue())
    logger.info("trained a %d-piece BPE tokenizer on %d sentences: %s",
                config.vocab_size, counted.count, model_path)
    return Tokenizer(model_path)


def train_subword_nmt(sentences: Iterable[str], path: str | Path,
                      config: SubwordNmtConfig = SubwordNmtConfig()) -> SubwordNmtTokenizer:
    """Learn ``config.merges`` subword-nmt merges on ``sentences`` (both languages, as they are:
    words are what spaces separate), and write them with the vocabulary of the segmented
    sentences to ``path`` (whole or not at all): the special pieces, then every piece by
    frequency, most frequent first, ties in string order (as fairseq's dictionary sorts)."""
    from subword_nmt import learn_bpe as learning
    from subword_nmt.apply_bpe import BPE

    sentences = list(sentences)
    codes = io.StringIO()
    # learn_bpe wraps its merges in a tqdm bar, a line per update in a run's log: not wanted.
    bar, learning.tqdm = learning.tqdm, lambda merges, *args, **kwargs: merges
    try:
        learning.learn_bpe(io.StringIO("\n".join(sentences) + "\n"), codes, config.merges)
    finally:
        learning.tqdm = bar
    bpe = BPE(io.StringIO(codes.getvalue()))
    counts: dict[str, int] = {}
    for sentence in sentences:
        for piece in bpe.segment_tokens(sentence.split()):
            counts[piece] = counts.get(piece, 0) + 1
    if not counts:
        raise CorpusError(f"subword-nmt has no word to learn from in {len(sentences)} sentences")
    vocab = [*SPECIAL_PIECES, *sorted((p for p in counts if p not in SPECIAL_PIECES), key=lambda p: (-counts[p], p))]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        f.write(json.dumps({"format": "subword-nmt", "codes": codes.getvalue(), "vocab": vocab}) + "\n")
    logger.info("learnt %d subword-nmt merges on %d sentences (%d pieces): %s",
                config.merges, len(sentences), len(vocab), path)
    return SubwordNmtTokenizer(path)


def load_or_train(corpus: ParallelCorpus, cache_dir: str | Path | None = None,
                  config: TokenizerConfig | SubwordNmtConfig = TokenizerConfig()) -> Tokenizer | SubwordNmtTokenizer:
    """The tokenizer for this training corpus and config: loaded if cached, else trained.

    It is trained on the source and target sentences together (one shared vocabulary):
    sentencepiece's for a ``TokenizerConfig``, subword-nmt's for a ``SubwordNmtConfig``.
    ``cache_dir`` defaults to the directory of the corpus files; when that is read-only
    (a shared data set), to ``$XDG_CACHE_HOME/minitransformer/tokenizers``. The file name
    ``spm-bpe{vocab_size}-{fingerprint}.model`` (``nmt-bpe{merges}-{fingerprint}.bpe``)
    hashes the config and every training sentence; a ``.json`` beside it records what went in.
    """
    fingerprint = _fingerprint(corpus, config)
    directory = Path(cache_dir) if cache_dir is not None else _default_cache_dir(corpus)
    if isinstance(config, SubwordNmtConfig):
        model_path = directory / f"nmt-bpe{config.merges}-{fingerprint[:16]}.bpe"
    else:
        model_path = directory / f"spm-bpe{config.vocab_size}-{fingerprint[:16]}.model"
    if model_path.is_file():
        logger.info("using cached tokenizer %s", model_path)
        return open_tokenizer(model_path)
    train = train_subword_nmt if isinstance(config, SubwordNmtConfig) else train_tokenizer
    tokenizer = train(_both_sides(corpus), model_path, config)
    record = {"config": asdict(config), "fingerprint": fingerprint, "pairs": len(corpus),
              "src_files": [str(p) for p in corpus.src_paths],
              "tgt_files": [str(p) for p in corpus.tgt_paths]}
    with atomic_write(model_path.with_suffix(".json")) as f:
        f.write(json.dumps(record, indent=2) + "\n")
    return tokenizer


def _both_sides(corpus: ParallelCorpus) -> Iterable[str]:
    yield from corpus.src
    yield from corpus.tgt


def _fingerprint(corpus: ParallelCorpus, config: TokenizerConfig | SubwordNmtConfig) -> str:
    h = hashlib.sha256(json.dumps([_FORMAT, asdict(config)]).encode())
    for sentence in _both_sides(corpus):
        h.update(sentence.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def _default_cache_dir(corpus: ParallelCorpus) -> Path:
    beside_data = corpus.src_paths[0].parent if corpus.src_paths else Path.cwd()
    if os.access(beside_data, os.W_OK):
        return beside_data
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    fallback = cache_home / "minitransformer" / "tokenizers"
    logger.info("%s is read-only; caching the tokenizer in %s", beside_data, fallback)
    return fallback


class _Counter:
    """Passes sentences through, counting them (for error messages and the log), and keeps what
    stopped the reading: sentencepiece turns an exception raised in its iterator (an interrupt
    too) into a RuntimeError of its own, and the caller raises the original again."""

    def __init__(self, sentences: Iterable[str]):
        self._sentences = sentences
        self.count = 0
        self.stopped_by: BaseException | None = None

    def __iter__(self):
        try:
            for sentence in self._sentences:
                self.count += 1
                yield sentence
        except BaseException as e:
            self.stopped_by = e
            raise
