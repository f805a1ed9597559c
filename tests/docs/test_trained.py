"""docs/trained.py: a finished run becomes the reading's trained-model figures (attention maps,
validation translations beside their references, the test BLEU with its signatures, the
caption), and the build shows them where a page asks for them."""

from __future__ import annotations

import html
import json
import os
import sys

import pytest

from minitransformer import data
from minitransformer.decoding import translate
from tests.helpers import tiny_run, tiny_test_set

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "docs"))
import build  # noqa: E402
import trained  # noqa: E402
from translate import load_model  # noqa: E402 - examples/, on the path trained.py sets

pytestmark = pytest.mark.slow  # the reading's pictures of a trained run


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    run = tiny_run(tmp_path_factory.mktemp("run"))
    (run / "bleu.json").write_text(json.dumps({
        "bleu": 12.5, "signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
        "bleu_lowercased": 13.0, "signature_lowercased": "nrefs:1|case:lc|eff:no|tok:13a|smooth:exp|version:2.6.0",
        "steps": 40, "test_sentences": 12, "beam": 4, "alpha": 0.6}))  # as train_wmt.py writes it
    corpus = tiny_test_set(tmp_path_factory.mktemp("data"), n=5, split="val")
    out = tmp_path_factory.mktemp("trained")
    trained.main(["--run", str(run), "--trained-at", "abc1234", "--data-dir", str(corpus), "--samples", "3",
                  "--out", str(out)])
    return run, corpus, out


def test_the_maps_and_the_record_of_a_run(rendered):
    run, corpus, out = rendered
    assert {"encoder_self.png", "decoder_self.png", "cross.png", "trained.json"} <= set(os.listdir(out))
    record = json.loads((out / "trained.json").read_text())
    assert (record["commit"], record["seed"], record["steps"], record["bleu"]) == ("abc1234", 1, 40, 12.5)
    val = data.load_multi30k(corpus, "val")
    tok = data.Tokenizer(str(next(run.glob("*.model"))))
    model = load_model(str(run / "averaged.npz"), "cpu", tokenizer=tok)
    assert [s["source"] for s in record["samples"]] == val.src[:3]
    assert [s["reference"] for s in record["samples"]] == val.tgt[:3]
    assert [s["translation"] for s in record["samples"]] == translate(model, tok, val.src[:3], "cpu",
                                                                        record["beam"], record["alpha"])
    walk = record["walk"]  # the first sample, stage by stage
    assert walk["source"] == val.src[0] and walk["translation"] == record["samples"][0]["translation"]
    assert walk["ids"] == tok.encode([val.src[0]])[0] + [data.EOS_ID] and len(walk["pieces"]) == len(walk["ids"])
    assert len(walk["batch"]) == 2 and data.PAD_ID in sum(walk["batch"], [])  # two lengths: padding
    assert walk["hypothesis_pieces"] == tok.id_to_piece(walk["hypothesis_ids"])
    assert [s["t"] for s in walk["steps"]] == list(range(len(walk["steps"])))
    assert any(f["pieces"] == walk["hypothesis_pieces"] for s in walk["steps"] for f in s["finished"])
    assert walk["winner"]["pieces"] == walk["hypothesis_pieces"]  # the best scored is the one decoded
    assert walk["likeliest"]["log_prob"] >= walk["winner"]["log_prob"]


def test_the_build_shows_them_and_fails_without_them(rendered, tmp_path):
    _, _, out = rendered
    pages = tmp_path / "pages"
    pages.mkdir()
    for page in build.PAGES:
        (pages / f"{page.name}.md").write_text("# A page\n\n```trained\n```\n\n" + "".join(
            f"```trained {part}\n```\n\n" for part in build.WALK))
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    site = build.Site(str(tmp_path / "site"), str(pictures), str(pages), trained=str(out))
    site.build()
    text = (tmp_path / "site" / "index.html").read_text()
    assert "<b>12.50</b>" in text and "case:lc" in text and "abc1234" in text
    record = json.loads((out / "trained.json").read_text())
    assert all(html.escape(s["reference"]) in text for s in record["samples"])
    assert html.escape(record["walk"]["translation"]) in text and 'class="pad"' in text and "sentence BLEU" in text
    with pytest.raises(build.BuildError, match=r"index\.md:3: no .*trained\.json"):
        build.Site(str(tmp_path / "site2"), str(pictures), str(pages), trained=str(tmp_path / "none")).build()


def test_a_lowercased_run_is_refused_in_one_line_before_any_decoding(rendered, tmp_path):
    run, corpus, _ = rendered
    lowercased = tmp_path / "run"
    lowercased.mkdir()
    for f in run.iterdir():
        os.symlink(f, lowercased / f.name)
    os.unlink(lowercased / "bleu.json")
    (lowercased / "bleu.json").write_text(json.dumps({
        "bleu": None, "signature": None, "bleu_lowercased": 40.0, "signature_lowercased": "nrefs:1|case:lc",
        "steps": 40, "test_sentences": 12, "beam": 5, "alpha": 1.0, "preprocess": "moses-lc"}))
    with pytest.raises(trained.records.RecordError, match=r"bleu.json: no cased BLEU \(a moses-lc run\)"):
        trained.main(["--run", str(lowercased), "--trained-at", "abc1234", "--data-dir", str(corpus),
                      "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
