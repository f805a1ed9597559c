"""Keep a finished run's test translations and figures in the repository, so that anyone can
rescore them: the literature's reproduction, benchmarks/reproduction/.

    python benchmarks/reproduction.py --run runs/multi30k-tiny-s1

copies the run's ``test.tok.de`` (its output as the literature's metric scores it; a ``moses-lc``
run's only) and ``test.hyp.de`` (detokenized, as translate.py writes it) into ``--out``
(``benchmarks/reproduction/`` by default; a seed other than 1 gets a folder of its own,
``seed<S>/``), and writes ``summary.json``: the preset, seed, the code's commit(s), updates,
epochs, where training stopped and why, and the figures of bleu.json. Rescore with

    python examples/score.py --tokenized benchmarks/reproduction/test.tok.de \
        ../shared/data/multi30k/test_2016_flickr.de.gz
"""

from __future__ import annotations

import json
import os
import shutil

from minitransformer import cli, files, records

FIGURES = ("literature", "bleu_lowercased", "bleu", "length_ratio", "signature_literature", "signature_lowercased",
           "signature")
KEPT = ("test.tok.de", "test.hyp.de")


def summary(run: str) -> dict:
    """What summary.json says of the finished run in folder ``run`` (its bleu.json)."""
    path = os.path.join(run, "bleu.json")
    if not os.path.exists(path):
        raise SystemExit(f"error: {path} does not exist: the run has not finished (resume it to its end first)")
    try:
        result = records.read_result(path)
    except records.RecordError as e:
        raise SystemExit(f"error: {e}") from None
    missing = [k for k in ("preset", "train_minutes", "averaged") if k not in result]
    if missing:
        raise SystemExit(f"error: {path} is not the bleu.json of a finished train_wmt.py run (no {', '.join(missing)})")
    parts = result.get("parts", [])
    return {"preset": result["preset"], "seed": parts[0]["seed"] if parts else None,
            "commits": sorted({p["commit"] for p in parts if p.get("commit")}),
            "updates": result["steps"], "epochs": result.get("epochs"), "stopped": result.get("stopped"),
            "train_minutes": result["train_minutes"], "averaged": result["averaged"],
            "beam": result["beam"], "alpha": result["alpha"], "length_penalty": result.get("length_penalty", "gnmt"),
            "preprocess": result.get("preprocess", "raw"), "test_sentences": result["test_sentences"],
            **{k: result[k] for k in FIGURES if k in result}, "parts": parts}


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=cli.input_folder, required=True, help="a finished train_wmt.py --out-dir")
    p.add_argument("--out", type=cli.output_folder,
                   default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "reproduction"),
                   help="the folder the seed-1 run's files go to")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    record = summary(args.run)
    out = args.out if record["seed"] in (1, None) else os.path.join(args.out, f"seed{record['seed']}")
    os.makedirs(out, exist_ok=True)
    for name in KEPT:
        source = os.path.join(args.run, name)
        if os.path.exists(source):
            with open(source, "rb") as f, files.atomic_write(os.path.join(out, name), "wb") as g:
                shutil.copyfileobj(f, g)
    with files.atomic_write(os.path.join(out, "summary.json")) as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    print(f"{out}: {', '.join(n for n in KEPT if os.path.exists(os.path.join(args.run, n)))} and summary.json "
          f"(literature {record.get('literature', float('nan')):.2f}, {record['updates']} updates, "
          f"stopped: {record['stopped']})")
    return record


if __name__ == "__main__":
    cli.run(main)
