"""benchmarks/subwords.py --anchor: our preprocessed text against the anchor's own files."""

import sys
from pathlib import Path

import pytest

from minitransformer import data

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import subwords  # noqa: E402

RAW = {"en": ["A dog runs.", 'Two cats say "hi".'], "de": ["Ein Hund läuft.", 'Zwei Katzen sagen "hallo".']}
# The anchor's files: lowercased Moses tokens (the period inside the quotes) after their BPE; the
# second German line differs.
BPE = {"en": ["a dog r@@ uns .", "two cats say &quot; hi . &quot;"],
       "de": ["ein hund läu@@ ft .", "zwei katzen sagen &quot; hallo &quot;"]}


@pytest.fixture
def folders(tmp_path):
    ours, anchor = tmp_path / "ours", tmp_path / "anchor"
    ours.mkdir(), anchor.mkdir()
    for split, name in subwords.ANCHOR_FILES.items():
        for lang in ("en", "de"):
            (ours / f"{split}.{lang}").write_text("\n".join(RAW[lang]) + "\n")
            (anchor / f"{name}.{lang}").write_text("\n".join(BPE[lang]) + "\n")
    return ours, anchor


def test_lines_are_compared_with_the_anchor_s_bpe_undone(folders):
    differ, figures = subwords.against_anchor(*map(str, folders))
    assert [(d["split"], d["lang"], d["lines"], d["differ"]) for d in differ] == [
        (split, lang, 2, int(lang == "de")) for split in subwords.ANCHOR_FILES for lang in ("en", "de")]
    # Their BPE's figures come from their training files as they are: pieces split on spaces.
    pieces = {lang: [line.split() for line in BPE[lang]] for lang in BPE}
    assert figures == {"types": len({p for rows in pieces.values() for row in rows for p in row}),
                       "pieces_en": (5 + 7) / 2, "pieces_de": (5 + 6) / 2}


def test_an_anchor_file_of_other_sentences_is_refused_naming_it(folders):
    ours, anchor = folders
    (anchor / "valid.de").write_text("nur eine zeile .\n")
    with pytest.raises(data.CorpusError, match=r"valid\.de has 1 lines, our val\.de 2: not the same sentences"):
        subwords.against_anchor(str(ours), str(anchor))
