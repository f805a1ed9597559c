"""Draw a trained model's attention maps for one sentence, per layer and head, as PNG files:
encoder self-attention, decoder self-attention and encoder-decoder attention (the paper's
Figures 3-5).

    python examples/plot_attention.py --run runs/multi30k "A dog runs through the grass."

The translation is the model's own, by the beam search the run decodes with (its beam, alpha
and length penalty, as translate.py reads them; the options override them); the maps are those
of the decoder reading that translation, each of its rows labelled with the piece that position
predicts. Files: <out>/encoder_self.png, decoder_self.png, cross.png, one row of
panels per layer, one column per head; with ``--layers last``, the last layer's heads alone, two
to a row, large enough to read each piece.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import logging
import os
import re

import numpy as np

import minitransformer as mt
from minitransformer import cli, data, decoding, files
from minitransformer.checkpoint import CheckpointError, load_checkpoint
from minitransformer.decoding import beam_search
from translate import Search, beam_and_alpha, find_run_files, model_from, refuse_wide_beams, text_settings

logger = logging.getLogger("plot_attention")


LAYERS = ("all", "last")
MAPS = ("encoder_self.png", "decoder_self.png", "cross.png")  # what a sentence's folder holds


def draw(maps: list[np.ndarray], rows: list[str], cols: list[str], title: str, path: str,
         axes_labels: tuple[str, str] = ("key", "query"), layers: str = "all") -> None:
    """One panel per layer (rows) and head (columns), one colour bar for all (weights 0 to 1);
    ``axes_labels``: what the columns and the rows of a map are. ``layers="last"``: the last
    layer's heads only, two to a row, each panel twice as large."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = maps[0].shape[0]
    panels = [(i, j) for i in range(len(maps)) for j in range(heads)]
    if layers == "last":
        panels = [(len(maps) - 1, j) for j in range(heads)]
        grid, cell, font = (-(-heads // 2), min(heads, 2)), 0.3, 9
    else:
        grid, cell, font = (len(maps), heads), 0.22, 7
    size = cell * max(len(rows), len(cols)) + 1.2
    fig, axes = plt.subplots(*grid, figsize=(size * grid[1] + 1.0, size * grid[0] + 0.6), squeeze=False,
                             layout="constrained")
    for ax, (i, j) in zip(axes.ravel(), panels):
        image = ax.imshow(maps[i][j], cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=font)
        ax.set_yticks(range(len(rows)), rows, fontsize=font)
        ax.set_title(f"layer {i + 1}, head {j + 1}", fontsize=font + 1)
    for ax in axes.ravel()[len(panels):]:  # an odd number of heads leaves a cell empty
        ax.set_axis_off()
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="attention weight")
    fig.supxlabel(axes_labels[0])
    fig.supylabel(axes_labels[1])
    fig.suptitle(title)
    files.save_figure(fig, path, dpi=110, readable=True)


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sentence", help="an English sentence")
    p.add_argument("--run", type=cli.input_folder, required=True, help="a train_wmt.py --out-dir")
    p.add_argument("--out", type=cli.output_folder, default=None, help="folder for the PNGs (default: <run>/attention); "
                   "earlier maps there are replaced as a whole")
    p.add_argument("--beam", type=cli.integer(1), help="beam size (default: the run's, else 4)")
    p.add_argument("--alpha", type=cli.real(0.0, decoding.ALPHA_MAX), help="length penalty (default: the run's, else 0.6)")
    p.add_argument("--length-penalty", choices=decoding.LENGTH_PENALTIES,
                   help="what alpha shapes: gnmt or fairseq (default: the run's, else gnmt)")
    p.add_argument("--layers", choices=LAYERS, default="all",
                   help="every layer's heads (a row each), or the last layer's alone, larger")
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.sentence.strip():
        p.error("the sentence is empty: there is no attention to draw")
    checkpoint, tokenizer = find_run_files(args.run)
    tok = data.open_tokenizer(tokenizer)
    ckpt = load_checkpoint(checkpoint)
    model = model_from(ckpt, checkpoint, "cpu", tokenizer=tok)
    # The translation translate.py gives: the run's beam search, and its text (a moses-lc run
    # reads lowercased Moses tokens).
    search = Search(*beam_and_alpha(ckpt, args.beam, args.alpha), *text_settings(ckpt, args.length_penalty))
    refuse_wide_beams(p, [search.beam], tok)
    preprocess = search.preprocess
    (sentence,) = data.moses.preprocess([args.sentence], "en", preprocess)

    # As translate.py does: a text longer than the model's positions is cut at sentence ends,
    # and each part drawn on its own (in part-<k>/); a part still too long is refused.
    limit = model.config.max_len - 1  # pieces, EOS not counted
    (ids,) = tok.encode([sentence])
    parts = [ids] if len(ids) <= limit else decoding.sentence_parts(sentence, tok)
    for k, part in enumerate(parts, 1):
        if len(part) > limit:
            p.error(f"{'the sentence' if len(parts) == 1 else f'sentence {k} of the text'} has {len(part)} "
                    f"tokens, more than the model's {limit + 1} positions: give a shorter one")
    if tok.knows_nothing_of(ids):
        logger.warning("the vocabulary knows none of the sentence's characters: the maps are over <unk>")
    out = args.out or os.path.join(args.run, "attention")
    check_out(p, out)
    # One run's maps at a time, put in place together: a second run into the folder meanwhile is
    # refused, and an earlier run's maps (its parts too) are replaced as a whole, never mixed in.
    with files.lock_output(out), files.atomic_folder(out) as staged:
        for k, part in enumerate(parts, 1):
            folder = "" if len(parts) == 1 else f"part-{k}"
            translation = draw_part(model, tok, part, search, os.path.join(staged, folder), args.layers)
            if preprocess == "moses-lc":  # read as translate.py writes it
                (translation,) = data.moses.detokenize([translation], "de")
            print(f"translation{'' if len(parts) == 1 else f' of part {k}'}: {translation}")
            print(f"wrote {', '.join(MAPS)} to {os.path.join(out, folder)}")


def check_out(p: cli.ArgumentParser, out: str) -> None:
    """Refuse, before anything is drawn, an --out folder that holds more than earlier maps
    (which are replaced as a whole)."""
    if os.path.isdir(out):
        other = sorted(n for n in os.listdir(out) if n not in MAPS and not re.fullmatch(r"part-\d+", n))
        if other:
            p.error(f"--out {out} holds other files than attention maps ({', '.join(other[:3])}): choose another "
                    f"folder, or empty it")


def draw_part(model, tok, ids: list[int], search: Search, out: str, layers: str = "all") -> str:
    """The three maps of one sentence (piece ids) into ``out`` (``layers``: as ``draw``'s), for
    the translation that ``search`` (its beam, alpha and length penalty) finds; returns that
    translation. Row t of a decoder map is the query at input position t, which reads BOS and
    the first t pieces and predicts piece t + 1 (EOS last): it is labelled with that piece."""
    batch = data.collate([ids])
    hyp = beam_search(model, mt.tensor(batch.src), beam_size=search.beam, alpha=search.alpha,
                      length_penalty=search.length_penalty)[0]
    tgt_in = np.array([[model.config.start_id] + hyp])
    modules = [m for m in model.modules() if hasattr(m, "keep_weights")]
    for m in modules:
        m.keep_weights = True
    model(mt.tensor(batch.src), mt.tensor(tgt_in))

    src_pieces = tok.id_to_piece(batch.src[0])  # ends with EOS, as the model saw it
    read = tok.id_to_piece(tgt_in[0])  # what the decoder reads: BOS, then the translation
    predicted = tok.id_to_piece(hyp + [model.config.eos_id])  # what each of its positions predicts
    os.makedirs(out, exist_ok=True)  # a part's
    weights = lambda mods: [m.last_weights.numpy()[0] for m in mods]  # noqa: E731 - (h, T, S) per layer
    enc = [layer.self_attn for layer in model.encoder.layers]
    dec = [layer.self_attn for layer in model.decoder.layers]
    cross = [layer.cross_attn for layer in model.decoder.layers]
    draw(weights(enc), src_pieces, src_pieces, "encoder self-attention", os.path.join(out, "encoder_self.png"),
         ("source piece (key)", "source piece (query)"), layers)
    draw(weights(dec), predicted, read, "decoder self-attention (causal)", os.path.join(out, "decoder_self.png"),
         ("piece read (key)", "piece being predicted (query)"), layers)
    draw(weights(cross), predicted, src_pieces, "encoder-decoder attention", os.path.join(out, "cross.png"),
         ("source piece (key)", "piece being predicted (query)"), layers)
    return tok.decode([hyp])[0]


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError, CheckpointError))
