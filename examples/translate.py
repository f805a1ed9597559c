"""Translate English sentences to German with a trained checkpoint (batched beam search).

    echo "A man rides a bicycle down the street." | python examples/translate.py --run runs/multi30k
    python examples/translate.py --run runs/multi30k --input test.en --output test.de

``--run`` is a train_wmt.py output folder: its averaged model (or last checkpoint) and its
sentencepiece model are used. ``--checkpoint`` and ``--tokenizer`` name them explicitly.

One line in, one line out, always: an empty line gives an empty line, a line the vocabulary
cannot read at all gives an empty line and a warning, an over-long line is split at sentence
ends (see ``decoding.translate``). Input is read as it arrives: a line typed on stdin is
translated as soon as it is complete, and a file is translated and written chunk by chunk
(with a progress bar on stderr), so an interrupted run keeps what it finished. Bytes that are
not UTF-8 stop the run with the file (or stdin), the line and the byte.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
from collections.abc import Iterator

from minitransformer import data, decoding, nn
from minitransformer.checkpoint import Checkpoint, load_checkpoint
from minitransformer.decoding import translate


def load_model(checkpoint: str, device: str, dtype: str = "float32", tokenizer: data.Tokenizer | None = None
               ) -> nn.Transformer:
    """The checkpoint's model; with ``tokenizer``, checked to be the one it was trained with:
    the one the checkpoint names (train_wmt.py names its tokenizer by a fingerprint of its
    training text and settings), and of its vocabulary size."""
    return model_from(load_checkpoint(checkpoint), checkpoint, device, dtype, tokenizer)


def model_from(ckpt: Checkpoint, name: str, device: str, dtype: str = "float32",
               tokenizer: data.Tokenizer | None = None) -> nn.Transformer:
    """``load_model`` of a checkpoint already read (an average, say); ``name`` is what errors
    call it."""
    if ckpt.config is None:
        raise SystemExit(f"{name} holds no model config")
    named = ckpt.extra.get("tokenizer")
    if tokenizer is not None and named is not None and named != tokenizer.path.name:
        raise SystemExit(f"{name} was trained with the tokenizer {named}, not {tokenizer.path}")
    if tokenizer is not None and tokenizer.vocab_size != ckpt.config["vocab_size"]:
        raise SystemExit(f"{tokenizer.path} has {tokenizer.vocab_size} pieces but the model in {name} "
                         f"has a {ckpt.config['vocab_size']}-token vocabulary: not the tokenizer it was trained with")
    model = nn.Transformer(nn.TransformerConfig(**ckpt.config))
    model.load_state_dict(ckpt.model)
    return model.to(device, dtype=dtype).eval()


def find_run_files(run: str) -> tuple[str, str]:
    """The run's averaged model (or last checkpoint) and the tokenizer that checkpoint names."""
    checkpoint = next((p for p in (os.path.join(run, "averaged.npz"), os.path.join(run, "last.npz"))
                       if os.path.exists(p)), None)
    if checkpoint is None:
        raise SystemExit(f"{run} has no averaged.npz or last.npz: is it a train_wmt.py output folder?")
    name = load_checkpoint(checkpoint, metadata_only=True).extra.get("tokenizer")
    if name is not None:
        if not os.path.exists(os.path.join(run, name)):
            raise SystemExit(f"{checkpoint} was trained with the tokenizer {name}, which is not in {run}")
        return checkpoint, os.path.join(run, name)
    # Older runs do not name their tokenizer: the newest one in the folder.
    tokenizers = sorted(glob.glob(os.path.join(run, "spm-*.model")), key=os.path.getmtime)
    if not tokenizers:
        raise SystemExit(f"{run} has no spm-*.model: is it a train_wmt.py output folder?")
    return checkpoint, tokenizers[-1]


def read_chunks(fd: int, name: str, chunk_bytes: int = 1 << 14) -> Iterator[tuple[int, list[str]]]:
    """(number of the first line, lines) for each run of complete lines as they arrive on ``fd``.

    ``os.read`` returns what is there: one line typed on a terminal, or up to ``chunk_bytes`` of
    a file or pipe (enough lines for length-sorted batches). Lines are split on "\\n" only, as
    the corpus reader does, and a "\\r" before it is dropped; bad UTF-8 is a ``CorpusError``
    naming ``name``, the line and the byte.
    """
    pending, first = b"", 1
    while chunk := os.read(fd, chunk_bytes):
        *lines, pending = (pending + chunk).split(b"\n")
        if lines:
            yield first, [data.decode_utf8(line, name, first + i).removesuffix("\r") for i, line in enumerate(lines)]
            first += len(lines)
    if pending:  # a last line without its "\n"
        yield first, [data.decode_utf8(pending, name, first).removesuffix("\r")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", help="a train_wmt.py --out-dir")
    p.add_argument("--checkpoint", help="checkpoint file (overrides --run's)")
    p.add_argument("--tokenizer", help="sentencepiece .model file (overrides --run's)")
    p.add_argument("--input", help="one sentence a line (default: stdin)")
    p.add_argument("--output", help="where to write translations (default: stdout)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and activations' dtype for decoding (16-bit: for GPUs)")
    p.add_argument("--beam", type=int, help="beam size (default: the run's, else 4)")
    p.add_argument("--alpha", type=float, help="length penalty (default: the run's, else 0.6)")
    p.add_argument("--max-tokens", type=int, default=2048, help="source tokens per batch")
    args = p.parse_args(argv)
    if args.beam is not None and args.beam < 1:
        p.error(f"--beam {args.beam}: a beam holds at least 1 hypothesis")
    if not (args.run or (args.checkpoint and args.tokenizer)):
        p.error("give --run, or both --checkpoint and --tokenizer")
    if args.input and not os.path.isfile(args.input):
        p.error(f"--input {args.input}: no such file")
    logging.basicConfig(format="%(levelname)s: %(message)s", level=logging.WARNING)
    checkpoint, tokenizer = find_run_files(args.run) if args.run else (None, None)
    checkpoint, tokenizer = args.checkpoint or checkpoint, args.tokenizer or tokenizer

    tok = data.Tokenizer(tokenizer)
    ckpt = load_checkpoint(checkpoint)
    model = model_from(ckpt, checkpoint, args.device, args.dtype, tok)
    # train_wmt.py saves the beam and alpha it decodes with beside the averaged model, and its
    # flags in every checkpoint.
    run_flags = {**ckpt.extra.get("args", {}), **ckpt.extra}
    beam = args.beam or run_flags.get("beam") or decoding.BEAM
    alpha = run_flags.get("alpha", decoding.ALPHA) if args.alpha is None else args.alpha
    source = open(args.input, "rb") if args.input else sys.stdin.buffer
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    progress = None
    if args.input:
        from tqdm import tqdm

        progress = tqdm(total=sum(chunk.count(b"\n") for chunk in iter(lambda: source.read(1 << 20), b"")),
                        unit="line", desc="translate")
        source.seek(0)
    try:
        for first, lines in read_chunks(source.fileno(), args.input or "stdin"):
            hyps = translate(model, tok, lines, args.device, beam, alpha, args.max_tokens,
                             first_line=first)
            out.write("".join(h + "\n" for h in hyps))
            out.flush()
            if progress is not None:
                progress.update(len(lines))
    except data.CorpusError as e:
        raise SystemExit(str(e)) from None
    finally:
        if progress is not None:
            progress.close()


if __name__ == "__main__":
    main()
