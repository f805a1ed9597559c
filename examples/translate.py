"""Translate English sentences to German with a trained checkpoint (batched beam search).

    echo "A man rides a bicycle down the street." | python examples/translate.py --run runs/multi30k
    python examples/translate.py --run runs/multi30k --input test.en --output test.de

``--run`` is a train_wmt.py output folder: its averaged model (or last checkpoint) and its
sentencepiece model are used. ``--checkpoint`` and ``--tokenizer`` name them explicitly.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from minitransformer import data, nn
from minitransformer.checkpoint import load_checkpoint
from minitransformer.decoding import translate


def load_model(checkpoint: str, device: str, dtype: str = "float32", tokenizer: data.Tokenizer | None = None
               ) -> nn.Transformer:
    """The checkpoint's model; with ``tokenizer``, checked to share its vocabulary size."""
    ckpt = load_checkpoint(checkpoint)
    if ckpt.config is None:
        raise SystemExit(f"{checkpoint} holds no model config")
    if tokenizer is not None and tokenizer.vocab_size != ckpt.config["vocab_size"]:
        raise SystemExit(f"{tokenizer.path} has {tokenizer.vocab_size} pieces but the model in {checkpoint} "
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
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--max-tokens", type=int, default=2048, help="source tokens per batch")
    args = p.parse_args(argv)
    if not (args.run or (args.checkpoint and args.tokenizer)):
        p.error("give --run, or both --checkpoint and --tokenizer")
    checkpoint, tokenizer = find_run_files(args.run) if args.run else (None, None)
    checkpoint, tokenizer = args.checkpoint or checkpoint, args.tokenizer or tokenizer

    tok = data.Tokenizer(tokenizer)
    model = load_model(checkpoint, args.device, args.dtype, tok)
    source = open(args.input, encoding="utf-8") if args.input else sys.stdin
    sentences = [line.rstrip("\n") for line in source]
    hyps = translate(model, tok, sentences, args.device, args.beam, args.alpha, args.max_tokens,
                     progress=args.output is not None)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    out.write("".join(h + "\n" for h in hyps))
    out.flush()


if __name__ == "__main__":
    main()
