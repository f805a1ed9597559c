import gzip
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minitransformer.data import (
    CorpusError, find_split_file, load_corpus, load_multi30k, load_wmt14, missing_files,
    read_lines, read_parallel, read_sgm,
)
from minitransformer.data.corpus import WMT14_TRAIN_STEMS

WORDS = ["Ein", "Hund", "läuft", "über", "die", "Straße", "A", "dog", "runs", "café", "naïve",
         "größer", "€5", "—", "\"quoted\"", "l'eau", "日本", "🙂"]


def random_sentences(rng, n, empty_ok=False):
    lo = 0 if empty_ok else 1
    return [" ".join(rng.choice(WORDS, size=rng.integers(lo, 12))) for _ in range(n)]


def write(path: Path, lines, gz=False, newline="\n"):
    data = "".join(line + newline for line in lines).encode("utf-8")
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


line_text = st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)))


@settings(max_examples=40, deadline=None)
@given(lines=st.lists(line_text.filter(lambda s: not s.endswith("\r")), min_size=1, max_size=20),
       gz=st.booleans(), final_newline=st.booleans(), chunk_bytes=st.sampled_from([1, 2, 3, 7, 64, 1 << 26]))
def test_read_lines_round_trips_any_text(lines, gz, final_newline, chunk_bytes):
    # Small chunks cut inside lines and inside characters of several bytes.
    lines[0] = lines[0].lstrip("\ufeff")  # a leading byte-order mark is dropped by design
    text = "\n".join(lines) + ("\n" if final_newline else "")
    if text == "":
        return  # an empty file is an error, tested below
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("x.txt.gz" if gz else "x.txt")
        raw = text.encode("utf-8")
        path.write_bytes(gzip.compress(raw) if gz else raw)
        # Without a final "\n", a last empty line is indistinguishable from none.
        expected = lines if (final_newline or lines[-1] != "") else lines[:-1]
        assert read_lines(path, chunk_bytes) == expected


def test_a_byte_order_mark_is_dropped_at_the_start_only(tmp_path):
    path = tmp_path / "x.en"
    path.write_bytes("\ufeffone\n\ufefftwo\n".encode())
    for chunk_bytes in (2, 5, 64):
        assert read_lines(path, chunk_bytes) == ["one", "\ufefftwo"]
    path.write_bytes("\ufeff".encode())
    with pytest.raises(CorpusError, match="empty"):
        read_lines(path)


def test_crlf_and_lone_carriage_returns(tmp_path):
    path = tmp_path / "x.en"
    path.write_bytes(b"one\r\ntwo has a \r inside\r\nthree\n\r")
    for chunk_bytes in (1, 4, 64):
        assert read_lines(path, chunk_bytes) == ["one", "two has a \r inside", "three", ""]


def test_plain_and_gzip_read_the_same(tmp_path):
    lines = random_sentences(np.random.default_rng(), 50, empty_ok=True)
    assert read_lines(write(tmp_path / "a.de", lines)) == lines
    assert read_lines(write(tmp_path / "a.de.gz", lines, gz=True)) == lines


def test_mismatched_line_counts_name_both_files_and_counts(tmp_path):
    rng = np.random.default_rng()
    n, m = rng.integers(5, 50, size=2)
    m = n + 1 + m
    src = write(tmp_path / "train.en", random_sentences(rng, n))
    tgt = write(tmp_path / "train.de.gz", random_sentences(rng, m), gz=True)
    with pytest.raises(CorpusError) as err:
        read_parallel(src, tgt)
    msg = str(err.value)
    assert str(src) in msg and str(tgt) in msg
    assert f"{n} lines" in msg and f"{m} lines" in msg


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope.en")):
        read_lines(tmp_path / "nope.en")
    with pytest.raises(FileNotFoundError, match="train.en") as err:
        load_multi30k(tmp_path, "train")
    assert "minitransformer.data.download multi30k" in str(err.value)


@pytest.mark.parametrize("gz", [False, True])
def test_empty_file_names_the_path(tmp_path, gz):
    path = tmp_path / ("val.de.gz" if gz else "val.de")
    path.write_bytes(gzip.compress(b"") if gz else b"")
    with pytest.raises(CorpusError, match="empty") as err:
        read_lines(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("gz", [False, True])
def test_undecodable_bytes_name_file_and_line(tmp_path, gz):
    rng = np.random.default_rng()
    lines = random_sentences(rng, 30)
    bad = int(rng.integers(0, 30))
    raw = [line.encode() for line in lines]
    raw[bad] = raw[bad] + b" \xff\xfe broken"
    data = b"\n".join(raw) + b"\n"
    path = tmp_path / ("train.en.gz" if gz else "train.en")
    path.write_bytes(gzip.compress(data) if gz else data)
    for chunk_bytes in (int(rng.integers(1, 50)), 1 << 26):  # the line is counted across chunks
        with pytest.raises(CorpusError) as err:
            read_lines(path, chunk_bytes)
        assert str(path) in str(err.value)
        assert f"line {bad + 1}:" in str(err.value)


def test_corrupt_gzip_names_the_file(tmp_path):
    path = tmp_path / "train.en.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00garbage that is not deflate")
    with pytest.raises(CorpusError, match="gzip") as err:
        read_lines(path)
    assert str(path) in str(err.value)


def sgm(segments, docid="abc"):
    body = "".join(f'<seg id="{i + 1}">{s}</seg>\n' for i, s in enumerate(segments))
    return (f'<srcset setid="newstest2014" srclang="any">\n<doc sysid="ref" docid="{docid}" '
            f'genre="news" origlang="en">\n<p>\n{body}</p>\n</doc>\n</srcset>\n')


def test_read_sgm_extracts_segments_in_order(tmp_path):
    rng = np.random.default_rng()
    segments = random_sentences(rng, 25)
    path = tmp_path / "x.sgm"
    # Stray spacing inside a segment is collapsed, as sacreBLEU does for these files.
    padded = [f"  {s.replace(' ', '   ')} " for s in segments]
    path.write_text(sgm(padded))
    assert read_sgm(path) == segments


def test_sgm_errors(tmp_path):
    empty = tmp_path / "none.sgm"
    empty.write_text("<srcset>\n<doc docid='x'>\n</doc>\n</srcset>\n")
    with pytest.raises(CorpusError, match="no <seg> lines") as err:
        read_sgm(empty)
    assert str(empty) in str(err.value)
    broken = tmp_path / "broken.sgm"
    broken.write_text('<seg id="1">never closed\n')
    with pytest.raises(CorpusError, match="malformed"):
        read_sgm(broken)


def test_multi30k_layout_plain_or_gz(tmp_path):
    rng = np.random.default_rng()
    data = {}
    for split, n in (("train", 40), ("val", 7), ("test_2016_flickr", 9)):
        for lang in ("en", "de"):
            data[split, lang] = random_sentences(rng, n)
            write(tmp_path / (f"{split}.{lang}" + (".gz" if lang == "de" else "")),
                  data[split, lang], gz=lang == "de")
    assert missing_files("multi30k", tmp_path) == []
    for split in ("train", "val", "test_2016_flickr"):
        c = load_corpus("multi30k", tmp_path, split)
        assert c.src == data[split, "en"] and c.tgt == data[split, "de"]
        r = load_multi30k(tmp_path, split, "de", "en")
        assert r.src == data[split, "de"] and r.tgt == data[split, "en"]
    assert find_split_file(tmp_path, "val", "de").name == "val.de.gz"
    (tmp_path / "val.de.gz").unlink()
    assert missing_files("multi30k", tmp_path) == [tmp_path / "val.de"]
    with pytest.raises(ValueError, match="unknown multi30k split"):
        load_multi30k(tmp_path, "test")
    with pytest.raises(ValueError, match="two different languages"):
        load_multi30k(tmp_path, "train", "en", "en")


@pytest.mark.parametrize("kind", ["fifo", "dangling-link", "folder"])
@pytest.mark.parametrize("name", ["train.en", "val.de.gz"])
def test_a_corpus_file_that_is_not_a_file_is_named_as_what_it_is_never_taken_for_missing(tmp_path, kind, name):
    """A FIFO (or a dangling link, a folder) where a corpus file goes is not missing: a download
    would replace it. Refused, saying what it is, by the readers and by missing_files."""
    rng = np.random.default_rng(0)
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            write(tmp_path / f"{split}.{lang}", random_sentences(rng, 5))
    (tmp_path / name.removesuffix(".gz")).unlink()
    path = tmp_path / name
    {"fifo": lambda: os.mkfifo(path), "dangling-link": lambda: path.symlink_to(tmp_path / "gone"),
     "folder": path.mkdir}[kind]()
    what = {"fifo": "a FIFO", "dangling-link": "dangling", "folder": "a folder"}[kind]
    for read in (lambda: missing_files("multi30k", tmp_path), lambda: load_multi30k(tmp_path, name.split(".")[0])):
        with pytest.raises(CorpusError, match=f"{path}.* {what}"):
            read()


@pytest.mark.parametrize("side", ["en", "de"])
def test_a_side_of_empty_lines_only_is_refused_saying_so(tmp_path, side):
    for lang in ("en", "de"):
        write(tmp_path / f"train.{lang}", ["", "", ""] if lang == side else ["A dog.", "", "Two men."])
    with pytest.raises(CorpusError, match=rf"train\.{side}: all 3 lines are empty"):
        read_parallel(tmp_path / "train.en", tmp_path / "train.de")


def make_wmt14(root: Path, rng):
    """Files as the WMT14 archives hold them; returns what each split should read."""
    expected = {}
    train = {"en": [], "de": []}
    for stem in WMT14_TRAIN_STEMS:
        n = int(rng.integers(3, 20))
        for lang in ("en", "de"):
            lines = random_sentences(rng, n)
            write(root / f"{stem}.{lang}", lines)
            train[lang] += lines
    expected["train"] = train
    expected["val"] = {lang: random_sentences(rng, 11) for lang in ("en", "de")}
    for lang in ("en", "de"):
        write(root / f"newstest2013.{lang}", expected["val"][lang])
    expected["test"] = {lang: random_sentences(rng, 13) for lang in ("en", "de")}
    for lang in ("en", "de"):
        for role in ("src", "ref"):
            (root / f"newstest2014-deen-{role}.{lang}.sgm").write_text(sgm(expected["test"][lang]))
    return expected


def test_wmt14_layout(tmp_path):
    expected = make_wmt14(tmp_path, np.random.default_rng())
    assert missing_files("wmt14", tmp_path) == []
    for split in ("train", "val", "test"):
        for src, tgt in (("en", "de"), ("de", "en")):
            c = load_wmt14(tmp_path, split, src, tgt)
            assert c.src == expected[split][src] and c.tgt == expected[split][tgt]
    train = load_corpus("wmt14", tmp_path, "train")
    assert [p.name for p in train.src_paths] == [f"{s}.en" for s in WMT14_TRAIN_STEMS]
    test = load_wmt14(tmp_path, "test")
    assert [p.name for p in test.src_paths + test.tgt_paths] == [
        "newstest2014-deen-src.en.sgm", "newstest2014-deen-ref.de.sgm"]


def test_wmt14_missing_files_are_all_named(tmp_path):
    make_wmt14(tmp_path, np.random.default_rng())
    (tmp_path / "commoncrawl.de-en.de").unlink()
    (tmp_path / "newstest2014-deen-ref.de.sgm").unlink()
    assert [p.name for p in missing_files("wmt14", tmp_path)] == [
        "commoncrawl.de-en.de", "newstest2014-deen-ref.de.sgm"]
    with pytest.raises(FileNotFoundError) as err:
        load_wmt14(tmp_path, "train")
    assert str(tmp_path / "commoncrawl.de-en.de") in str(err.value)
    assert "minitransformer.data.download wmt14" in str(err.value)
    with pytest.raises(FileNotFoundError, match="newstest2014-deen-ref.de.sgm"):
        load_wmt14(tmp_path, "test")
    assert len(load_wmt14(tmp_path, "val")) == 11


def test_wmt14_misaligned_training_corpus_is_named(tmp_path):
    make_wmt14(tmp_path, np.random.default_rng())
    path = tmp_path / "news-commentary-v9.de-en.de"
    path.write_text(path.read_text() + "one line too many\n")
    with pytest.raises(CorpusError, match="news-commentary-v9.de-en.de"):
        load_wmt14(tmp_path, "train")


def test_real_multi30k_sizes(multi30k_dir):
    # The published sizes of Multi30k task 1 (Elliott et al., 2016).
    for split, n in (("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)):
        c = load_multi30k(multi30k_dir, split)
        assert len(c) == n
        assert all(s.strip() for s in c.src) and all(t.strip() for t in c.tgt)
