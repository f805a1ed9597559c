"""The Multi30k literature's text: lowercased, normalized, Moses-tokenized (data.moses)."""

import gzip

import pytest

from minitransformer.data import moses
from tests.helpers import MULTI30K_DIR, needs_multi30k

# Lines whose Moses output is known (tokenizer.perl -l de with its default escaping, after
# lowercase.perl and normalize-punctuation.perl): quotes, apostrophes, hyphens, an ellipsis.
KNOWN = [
    ('Ein Mann sagt "Hallo".', "ein mann sagt &quot; hallo &quot; ."),
    ("Ein Junge im T-Shirt...", "ein junge im t-shirt ..."),
    ("Das ist's, oder?", "das ist &apos; s , oder ?"),  # German: split on both sides
    ("Zwei Hunde & eine Katze spielen.", "zwei hunde &amp; eine katze spielen ."),
    ("Ein  Mann  „läuft“ – schnell!", "ein mann &quot; läuft &quot; - schnell !"),
]


@pytest.mark.parametrize("line, tokens", KNOWN)
def test_known_lines_become_their_moses_tokens(line, tokens):
    assert moses.moses_lc([line], "de") == [tokens]


def test_english_apostrophes_split_as_moses_splits_them():
    assert moses.moses_lc(["A man's dog isn't here."], "en") == ["a man &apos;s dog isn &apos;t here ."]


def test_detokenize_undoes_the_tokenizer_but_not_the_case():
    assert moses.detokenize(["ein mann sagt &quot; hallo &quot; ."], "de") == ['ein mann sagt "hallo".']
    assert moses.detokenize(["ein junge im t-shirt ..."], "de") == ["ein junge im t-shirt..."]


def test_preprocess_names_what_it_does():
    lines = ["Ein Hund."]
    assert moses.preprocess(lines, "de", "raw") == lines
    assert moses.preprocess(lines, "de", "moses-lc") == ["ein hund ."]
    with pytest.raises(ValueError, match="unknown preprocessing 'lc'"):
        moses.preprocess(lines, "de", "lc")


@needs_multi30k
def test_the_test_references_become_the_literature_s_file():
    """The official test_2016_flickr.lc.norm.tok.de has 12,103 tokens on 1,000 lines (the reflen
    Wu et al.'s evaluation prints); the raw references make that many."""
    with gzip.open(MULTI30K_DIR / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        refs = f.read().splitlines()
    tokens = moses.moses_lc(refs, "de")
    assert len(tokens) == 1000 and sum(len(t.split()) for t in tokens) == 12103
    assert all(t == t.lower() for t in tokens)
