"""Keep a finished run's test translations and figures in the repository, so that anyone can
rescore them: the literature's reproduction, experiments/reproduction/seed<S>/.

    python experiments/reproduction/reproduction.py --run runs/multi30k-tiny-s1

copies the run's ``test.tok.de`` (its output as the literature's metric scores it; a ``moses-lc``
run's only) and ``test.hyp.de`` (detokenized, as translate.py writes it) into the folder of the
run's seed, ``seed<S>/`` of ``--out`` (this script's folder by default), and writes
``summary.json``: the preset, seed, the code's commit(s), updates, epochs, where training
stopped and why, and the figures of bleu.json. With ``--data-dir`` (the Multi30k folder, for the
test references) it also rescores ``test.tok.de`` into the literature figure's parts (n-gram
precisions, brevity penalty, lengths), and prints every kept seed's parts beside the anchor's,
as their README prints them: which part a gap is made of. Rescore with

    python examples/score.py --tokenized experiments/reproduction/seed1/test.tok.de \
        ../shared/data/multi30k/test_2016_flickr.de.gz
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import json
import os
import shutil

from minitransformer import bleu, cli, data, files, records

FIGURES = ("literature", "bleu_lowercased", "bleu", "length_ratio", "signature_literature", "signature_lowercased",
           "signature")
KEPT = ("test.tok.de", "test.hyp.de")
# Wu et al. (2021)'s text-only Transformer-tiny on test_2016_flickr, as fairseq printed it in
# their Revisit-MMT README-baseline.md: "BLEU4 = 41.02, 71.0/47.5/34.3/24.5 (BP=0.999,
# ratio=0.999, syslen=12096, reflen=12103)".
ANCHOR = dict(score=41.02, precisions=[71.0, 47.5, 34.3, 24.5], bp=0.999, sys_len=12096, ref_len=12103)


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


def parts(run: str, data_dir: str) -> dict:
    """The literature figure of the run's test output split into its parts (bleu.literature_parts)."""
    refs = bleu.moses_lc(data.load_multi30k(data_dir, "test_2016_flickr").tgt, "de")
    tokenized = os.path.join(run, "test.tok.de")
    tokens = (data.read_lines(tokenized) if os.path.exists(tokenized)
              else bleu.moses_lc(data.read_lines(os.path.join(run, "test.hyp.de")), "de"))
    if len(tokens) != len(refs):
        raise data.CorpusError(f"{run}'s test output has {len(tokens)} translations for {len(refs)} references")
    return bleu.literature_parts(tokens, refs)


def table(out: str) -> str:
    """Every kept seed's literature figure and its parts (the summaries in ``out`` that have
    them), the anchor's beside them: a Markdown table."""
    rows = []
    for folder in sorted(os.path.join(out, d) for d in os.listdir(out) if d.startswith("seed")):
        path = os.path.join(folder, "summary.json")
        if os.path.exists(path):
            with open(path) as f:
                record = json.load(f)
            if "literature_parts" in record:
                rows.append((f"seed {record['seed']}, {record['updates']:,} updates", record["literature_parts"]))
    rows.append(("the anchor (Wu et al. 2021)", ANCHOR))
    lines = ["| run | literature | n-gram precisions (1-4) | BP | length / reference | precisions alone (score / BP) |",
             "|---|---|---|---|---|---|"]
    for name, p in rows:
        lines.append(f"| {name} | {p['score']:.2f} | {'/'.join(f'{x:.1f}' for x in p['precisions'])} | "
                     f"{p['bp']:.3f} | {p['sys_len']:,} / {p['ref_len']:,} | {p['score'] / p['bp']:.2f} |")
    return "\n".join(lines)


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=cli.input_folder, required=True, help="a finished train_wmt.py --out-dir")
    p.add_argument("--data-dir", type=cli.data_folder,
                   help="the Multi30k folder: rescore the test output into the literature figure's parts")
    p.add_argument("--out", type=cli.output_folder,
                   default=os.path.dirname(os.path.abspath(__file__)),
                   help="the folder whose seed<S>/ the run's files go to")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    record = summary(args.run)
    if args.data_dir:
        record["literature_parts"] = parts(args.run, args.data_dir)
    out = os.path.join(args.out, f"seed{record['seed'] or 1}")  # a run with no parts names no seed: the default, 1
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
    if args.data_dir:
        print(table(args.out))
    return record


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError,))
