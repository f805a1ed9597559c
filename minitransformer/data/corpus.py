"""Readers for parallel text: Multi30k and WMT14 English-German as their authors publish them.

A parallel corpus is two files with one sentence a line, line i of the source translating
line i of the target. Readers return Python strings exactly as written (less the line
terminator), so the test references reach sacreBLEU untouched.

Layouts on disk (``python -m minitransformer.data.download NAME --dest DIR`` lays them out):

    Multi30k (task 1, github.com/multi30k/dataset, data/task1/raw/)
        DIR/{split}.{lang}[.gz]     split: train (29,000 pairs), val (1,014),
                                    test_2016_flickr (1,000); lang: en, de
    WMT14 EN-DE (www.statmt.org/wmt14/translation-task.html), files as extracted:
        train   europarl-v7.de-en.{lang}, commoncrawl.de-en.{lang},
                news-commentary-v9.de-en.{lang}     (about 4.5M pairs, concatenated)
        val     newstest2013.{lang}                 (3,000 pairs)
        test    newstest2014-deen-src.{src}.sgm and newstest2014-deen-ref.{tgt}.sgm
                                                    (3,003 pairs, the "full" test set)

Bad input raises ``CorpusError`` (a ``ValueError``) or ``FileNotFoundError`` naming the file:
a missing or empty file, bytes that are not UTF-8 (with the line number), source and target
files of different lengths (both files, both counts), a side whose every line is empty. In a
corpus folder, a file's name that holds something other than a regular file (a FIFO, a device,
a dangling link) is refused as what it is, never taken for a missing file to download over.

Lines are split on "\\n" only. Opening the files in text mode would also split on a lone
"\\r" (universal newlines), and a stray carriage return inside a Common Crawl sentence
would then shift every later line against its translation.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path

MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")
WMT14_SPLITS = ("train", "val", "test")
DATASETS = ("multi30k", "wmt14")

# The three WMT14 training corpora, in the order they are concatenated.
WMT14_TRAIN_STEMS = ("europarl-v7.de-en", "commoncrawl.de-en", "news-commentary-v9.de-en")
LANGS = ("en", "de")  # the pair both datasets are read for

_SEG = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)
_SPACES = re.compile(r"\s+")


class CorpusError(ValueError):
    """A corpus file is present but unusable: empty, not UTF-8, or misaligned."""


@dataclass(frozen=True)
class ParallelCorpus:
    """Aligned sentence pairs and the files they came from.

    ``src[i]`` translates to ``tgt[i]``. ``src_paths``/``tgt_paths`` list the files in the
    order they were concatenated (one each for Multi30k, three each for WMT14 train).
    """

    src: list[str]
    tgt: list[str]
    src_paths: tuple[Path, ...]
    tgt_paths: tuple[Path, ...]

    def __len__(self) -> int:
        return len(self.src)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of every pair, in order (hex, 16 digits): a run keeps it to tell, when it is
        resumed, whether it is given the data it was trained on. Computed once (WMT14's pairs
        take seconds)."""
        h = hashlib.sha256()
        for src, tgt in zip(self.src, self.tgt):
            h.update(src.encode("utf-8") + b"\t" + tgt.encode("utf-8") + b"\n")
        return h.hexdigest()[:16]

    def subset(self, indices) -> ParallelCorpus:
        """The pairs at ``indices`` (in that order), e.g. a few hundred for a smoke test."""
        return ParallelCorpus(
            [self.src[i] for i in indices], [self.tgt[i] for i in indices],
            self.src_paths, self.tgt_paths,
        )


def _open(path: Path):
    """A binary file object on ``path``, plain or gzipped (``.gz``): a regular file, or a pipe
    read once (``score.py <(gunzip -c hyp.gz) ref``)."""
    if not path.exists():
        raise FileNotFoundError(f"corpus file not found: {path}")
    if path.is_dir():
        raise CorpusError(f"{path} is a folder, not a file of sentences")
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _read_bytes(path: Path) -> bytes:
    try:
        with _open(path) as f:
            return f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise CorpusError(f"{path}: not a valid gzip file ({e})") from e


def decode_utf8(data: bytes, source, first_line: int = 1) -> str:
    """``data`` as UTF-8 text; invalid bytes raise ``CorpusError`` naming ``source`` (a path, or
    "stdin"), the line (counting from ``first_line``), the column and the byte."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise CorpusError(
            f"{source}, line {line}: byte 0x{data[e.start]:02x} at column {column} is not valid "
            f"UTF-8 ({e.reason})"
        ) from None
    # A byte-order mark opens a file; it is not part of the first sentence.
    return text.removeprefix("\ufeff") if first_line == 1 else text


# No sentence is this long: a "line" past it is a file of another kind, or an endless stream
# (a device such as /dev/zero), refused before it fills the memory.
MAX_LINE_BYTES = 1 << 20


def check_line_length(pending: bytes, name, line: int) -> None:
    """A ``CorpusError`` once the bytes of one unfinished line pass ``MAX_LINE_BYTES``."""
    if len(pending) > MAX_LINE_BYTES:
        raise CorpusError(f"{name}: line {line} runs past {MAX_LINE_BYTES >> 20} MiB without an end: "
                          f"not a file of sentences")


def read_lines(path: str | Path, chunk_bytes: int = 1 << 26) -> list[str]:
    """All lines of a plain or gzipped (``.gz``) UTF-8 file, without their "\\n" or "\\r\\n".

    Raises ``FileNotFoundError`` for a missing file and ``CorpusError`` for an empty one, for
    bytes that are not UTF-8, or a line longer than ``MAX_LINE_BYTES`` (naming the line).

    The file is read and decoded ``chunk_bytes`` at a time, cut after a line's "\\n" (which no
    other UTF-8 character contains), so that its bytes and its whole text never sit in memory
    beside its lines (4.5M generated pairs of WMT14's shape, both sides: 2.2 GB, not 2.7).
    """
    path = Path(path)
    lines, rest = [], b""
    try:
        with _open(path) as f:
            while chunk := f.read(chunk_bytes):
                data = rest + chunk
                cut = data.rfind(b"\n") + 1
                rest = data[cut:]
                if cut:
                    text = decode_utf8(data[:cut], path, first_line=len(lines) + 1).split("\n")
                    lines += [line.removesuffix("\r") for line in text[:-1]]  # text[-1]: "" after the last "\n"
                check_line_length(rest, path, len(lines) + 1)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise CorpusError(f"{path}: not a valid gzip file ({e})") from e
    last = decode_utf8(rest, path, first_line=len(lines) + 1)
    if last:  # the last line, without a "\n" (a file of a byte-order mark alone has none)
        lines.append(last.removesuffix("\r"))
    if not lines:
        raise CorpusError(f"corpus file is empty: {path}")
    return lines


def read_sgm(path: str | Path) -> list[str]:
    """The segments of a WMT "fake SGML" file, one per ``<seg id=...>...</seg>`` line.

    Other lines (``<doc>``, ``<p>``, headers) are skipped. Like sacreBLEU, which reads the
    same files, whitespace is stripped and runs of it collapsed to one space, and entities
    are left as written.
    """
    path = Path(path)
    text = decode_utf8(_read_bytes(path), path)
    segments = []
    for line in text.split("\n"):
        line = line.strip()
        if not line.lower().startswith("<seg"):
            continue
        match = _SEG.search(line)
        if match is None:
            raise CorpusError(f"{path}: malformed segment line (no closing </seg>): {line[:80]!r}")
        segments.append(_SPACES.sub(" ", match.group(1).strip()))
    if not segments:
        raise CorpusError(f"no <seg> lines in {path}")
    return segments


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


def _is_corpus_file(path: Path) -> bool:
    """Whether a corpus folder holds its file ``path``: a regular file (a link to one too), or
    nothing (False). Anything else there is a ``CorpusError`` saying what it is."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise CorpusError(f"{path} is a dangling symbolic link, not a file of sentences") from None
        return False
    if stat.S_ISREG(mode):
        return True
    raise CorpusError(f"{path} is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a file of sentences: "
                      f"a corpus folder holds regular files (plain or .gz)")


def _read_any(path: Path) -> list[str]:
    return read_sgm(path) if path.name.endswith((".sgm", ".sgm.gz")) else read_lines(path)


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> ParallelCorpus:
    """One source file and one target file (plain, ``.gz`` or ``.sgm``), checked aligned."""
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    src, tgt = _read_any(src_path), _read_any(tgt_path)
    if len(src) != len(tgt):
        raise CorpusError(
            f"source and target differ in length: {src_path} has {len(src)} lines, "
            f"{tgt_path} has {len(tgt)} lines"
        )
    for path, side in ((src_path, src), (tgt_path, tgt)):
        if not any(side):
            raise CorpusError(f"{path}: all {len(side)} lines are empty, so there is no sentence to read")
    return ParallelCorpus(src, tgt, (src_path,), (tgt_path,))


def concatenate(corpora: list[ParallelCorpus]) -> ParallelCorpus:
    """Corpora one after another, e.g. the three WMT14 training corpora."""
    return ParallelCorpus(
        [s for c in corpora for s in c.src], [t for c in corpora for t in c.tgt],
        tuple(p for c in corpora for p in c.src_paths),
        tuple(p for c in corpora for p in c.tgt_paths),
    )


def find_split_file(data_dir: str | Path, split: str, lang: str) -> Path:
    """``DIR/{split}.{lang}``, or ``DIR/{split}.{lang}.gz`` when only that one exists."""
    plain = Path(data_dir) / f"{split}.{lang}"
    gzipped = plain.with_name(plain.name + ".gz")
    if _is_corpus_file(plain):
        return plain
    if _is_corpus_file(gzipped):
        return gzipped
    raise FileNotFoundError(
        f"corpus file not found: {plain} (nor {gzipped.name}); "
        f"fetch the data with: python -m minitransformer.data.download multi30k --dest {data_dir}"
    )


def wmt14_files(split: str, src_lang: str = "en", tgt_lang: str = "de") -> list[tuple[str, str]]:
    """(source file name, target file name) pairs that make up a WMT14 EN-DE split."""
    _check_langs(src_lang, tgt_lang, "wmt14")
    if split == "train":
        return [(f"{stem}.{src_lang}", f"{stem}.{tgt_lang}") for stem in WMT14_TRAIN_STEMS]
    if split == "val":
        return [(f"newstest2013.{src_lang}", f"newstest2013.{tgt_lang}")]
    if split == "test":
        # The "deen" files hold one sentence set; -src and -ref name who wrote which side.
        return [(f"newstest2014-deen-src.{src_lang}.sgm", f"newstest2014-deen-ref.{tgt_lang}.sgm")]
    raise ValueError(f"unknown wmt14 split {split!r}; expected one of {WMT14_SPLITS}")


def _check_langs(src_lang: str, tgt_lang: str, name: str) -> None:
    if src_lang not in LANGS or tgt_lang not in LANGS or src_lang == tgt_lang:
        raise ValueError(
            f"{name} needs two different languages from {LANGS}, got {src_lang!r} -> {tgt_lang!r}"
        )


def load_multi30k(data_dir: str | Path, split: str, src_lang: str = "en",
                  tgt_lang: str = "de") -> ParallelCorpus:
    """A Multi30k task-1 split read from ``DIR/{split}.{lang}[.gz]``."""
    if split not in MULTI30K_SPLITS:
        raise ValueError(f"unknown multi30k split {split!r}; expected one of {MULTI30K_SPLITS}")
    _check_langs(src_lang, tgt_lang, "multi30k")
    return read_parallel(find_split_file(data_dir, split, src_lang),
                         find_split_file(data_dir, split, tgt_lang))


def load_wmt14(data_dir: str | Path, split: str, src_lang: str = "en",
               tgt_lang: str = "de") -> ParallelCorpus:
    """A WMT14 EN-DE split (see the module docstring for the files), checked aligned."""
    data_dir = Path(data_dir)
    pairs = wmt14_files(split, src_lang, tgt_lang)
    missing = [data_dir / n for pair in pairs for n in pair if not _is_corpus_file(data_dir / n)]
    if missing:
        raise FileNotFoundError(
            "WMT14 files not found: " + ", ".join(str(p) for p in missing)
            + f"; fetch them with: python -m minitransformer.data.download wmt14 --dest {data_dir}"
        )
    return concatenate([read_parallel(data_dir / s, data_dir / t) for s, t in pairs])


def load_corpus(name: str, data_dir: str | Path, split: str, src_lang: str = "en",
                tgt_lang: str = "de") -> ParallelCorpus:
    """``load_multi30k`` or ``load_wmt14`` by dataset name. Splits: for Multi30k train, val,
    test_2016_flickr; for WMT14 train, val (newstest2013), test (newstest2014)."""
    if name == "multi30k":
        return load_multi30k(data_dir, split, src_lang, tgt_lang)
    if name == "wmt14":
        return load_wmt14(data_dir, split, src_lang, tgt_lang)
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")


def missing_files(name: str, data_dir: str | Path) -> list[Path]:
    """The files ``load_corpus(name, data_dir, ...)`` needs for every split and direction
    that are absent from ``data_dir`` (empty when the data is ready to read)."""
    data_dir = Path(data_dir)
    if name == "multi30k":
        wanted = [f"{split}.{lang}" for split in MULTI30K_SPLITS for lang in LANGS]
        return [data_dir / w for w in wanted
                if not _is_corpus_file(data_dir / w) and not _is_corpus_file(data_dir / f"{w}.gz")]
    if name == "wmt14":
        wanted = {n for split in WMT14_SPLITS for src, tgt in (("en", "de"), ("de", "en"))
                  for pair in wmt14_files(split, src, tgt) for n in pair}
        return [data_dir / w for w in sorted(wanted) if not _is_corpus_file(data_dir / w)]
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
