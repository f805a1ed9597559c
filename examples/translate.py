"""Translate English sentences to German with a trained checkpoint (batched beam search).

    echo "A man rides a bicycle down the street." | python examples/translate.py --run runs/multi30k
    python examples/translate.py --run runs/multi30k --input test.en --output test.de

``--run`` is a train_wmt.py output folder: its averaged model (or last checkpoint) and its
tokenizer (sentencepiece's .model, or subword-nmt's .bpe for a run trained with ``--subwords
subword-nmt``, as its checkpoints record) are used. ``--checkpoint`` and ``--tokenizer`` name
them explicitly.

One line in, one line out, always: an empty line gives an empty line, a line the vocabulary
cannot read at all gives an empty line and a warning, an over-long line is split at sentence
ends (see ``decoding.translate``). Input is read as it arrives: a line typed on stdin (or a
named pipe) is translated as soon as it is complete, and a file is translated and written chunk
by chunk (with a progress bar on stderr). ``--output`` is written into a temporary file that
replaces it at the end, so a stopped run never leaves it truncated; what it finished is kept in
OUTPUT.partial. An output that is the input, the checkpoint or the tokenizer is refused before
anything is written. Bytes that are not UTF-8 stop the run with the file (or stdin), the line
and the byte. Stderr says which model translates.

A run trained on the Multi30k literature's text (``--preprocess moses-lc``, the
``multi30k-tiny`` preset) reads each line lowercased and Moses-tokenized, as it was trained, and
its Moses tokens are detokenized for the output: text in lower case.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import contextlib
import glob
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from minitransformer import backend, cli, data, decoding, files, nn
from minitransformer.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from minitransformer.decoding import translate
from minitransformer.settings import SettingsError


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
    subwords = {**ckpt.extra.get("args", {}), **ckpt.extra}.get("subwords") or "sentencepiece"  # older runs': spm
    if tokenizer is not None and tokenizer.kind != subwords:
        raise SystemExit(f"{name} was trained on {subwords} subwords, but {tokenizer.path} is a {tokenizer.kind} "
                         f"tokenizer")
    if tokenizer is not None and tokenizer.vocab_size != ckpt.config["vocab_size"]:
        raise SystemExit(f"{tokenizer.path} has {tokenizer.vocab_size} pieces but the model in {name} "
                         f"has a {ckpt.config['vocab_size']}-token vocabulary: not the tokenizer it was trained with")
    ckpt.require_finite(name, np.float16 if dtype == "float16" else np.float32)  # bfloat16 has float32's range
    try:
        config = nn.TransformerConfig.from_dict(ckpt.config)
    except SettingsError as e:
        raise CheckpointError(f"{name}: {e}") from None
    model = nn.Transformer(config)
    model.load_state_dict(ckpt.model)
    return model.to(device, dtype=dtype).eval()


def find_run_files(run: str) -> tuple[str, str]:
    """The run's averaged model (or last checkpoint) and the tokenizer that checkpoint names."""
    checkpoint = next((p for p in (os.path.join(run, "averaged.npz"), os.path.join(run, "last.npz"))
                       if os.path.exists(p)), None)
    if checkpoint is None:
        raise SystemExit(f"{run} has no averaged.npz or last.npz: is it a train_wmt.py output folder?")
    if os.path.basename(checkpoint) == "last.npz":
        logging.getLogger("translate").warning(
            "%s has no averaged.npz (its training has not finished, or it was deleted): using its last "
            "checkpoint, not the average of the last ones", run)
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
    naming ``name``, the line and the byte, and so is a line that runs past a MiB (an endless
    stream such as /dev/zero).
    """
    pending, first = b"", 1
    while chunk := os.read(fd, chunk_bytes):
        *lines, pending = (pending + chunk).split(b"\n")
        if lines:
            yield first, [data.decode_utf8(line, name, first + i).removesuffix("\r") for i, line in enumerate(lines)]
            first += len(lines)
        data.corpus.check_line_length(pending, name, first)
    if pending:  # a last line without its "\n"
        yield first, [data.decode_utf8(pending, name, first).removesuffix("\r")]


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=cli.input_folder, help="a train_wmt.py --out-dir")
    p.add_argument("--checkpoint", type=cli.input_file, help="checkpoint file (overrides --run's; with --run, it must hold the run's "
                   "model configuration)")
    p.add_argument("--tokenizer", type=cli.input_file, help="the model's tokenizer: a sentencepiece .model or a "
                   "subword-nmt .bpe file (overrides --run's)")
    p.add_argument("--input", type=cli.input_or_stdin, help="one sentence a line: a file, or a pipe (default, or -: stdin)")
    p.add_argument("--output", type=cli.output_or_stdout, help="where to write translations (default, or -: stdout); written whole at the end, "
                   "a stopped run leaves what it finished in OUTPUT.partial; a link is written through to its file; "
                   "a FIFO or a device is written as a stream, as the lines come (no whole-or-nothing swap is possible "
                   "there)")
    p.add_argument("--device", default="cpu", type=cli.device, choices=backend.DEVICES)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and activations' dtype for decoding (16-bit: for GPUs)")
    p.add_argument("--beam", type=cli.integer(1), help="beam size (default: the run's, else 4)")
    p.add_argument("--alpha", type=cli.real(0.0, decoding.ALPHA_MAX), help="length penalty (default: the run's, else 0.6)")
    p.add_argument("--length-penalty", choices=decoding.LENGTH_PENALTIES,
                   help="what alpha shapes: gnmt or fairseq (default: the run's, else gnmt)")
    p.add_argument("--max-tokens", type=cli.integer(1), default=2048,
                   help="source tokens per batch (raised to the longest line's length; it never truncates)")
    p.add_debug()
    return p


def is_same_file(path: str, other: str) -> bool:
    """Whether ``path`` exists and is ``other`` (by any path, symlink or hard link)."""
    return os.path.exists(path) and os.path.samefile(path, other)


def check_files(p: cli.ArgumentParser, args) -> None:
    """Refuse, before anything is opened for writing, an output that is the input (by any path
    or link) or that lies in a missing folder, and an input that is missing or a folder."""
    if args.input:
        if not os.path.exists(args.input):
            p.error(f"--input {args.input}: no such file")
        if os.path.isdir(args.input):
            p.error(f"--input {args.input}: a folder, not a file")
    if args.output:  # a folder there is refused when parsed (cli.output_file)
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            p.error(f"--output {args.output}: the folder {folder} does not exist")
        if args.input and is_same_file(args.output, args.input):
            p.error(f"--output {args.output} is the input file: writing it would destroy the input")


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if not (args.run or (args.checkpoint and args.tokenizer)):
        p.error("give --run, or both --checkpoint and --tokenizer")
    check_files(p, args)
    # A closed stream is None in Python: say which, and what to give instead.
    if not args.input and sys.stdin is None:
        p.error("stdin is closed and there is no --input: give the sentences one of the two ways")
    if not args.output and sys.stdout is None:
        p.error("stdout is closed and there is no --output: give the translations somewhere to go")
    with files.lock_output(args.output) if args.output else contextlib.nullcontext():  # one writer at a time
        translate_into_output(p, args)


def translate_into_output(p: cli.ArgumentParser, args) -> None:
    logging.basicConfig(format="%(levelname)s: %(message)s", level=logging.WARNING)
    checkpoint, tokenizer = find_run_files(args.run) if args.run else (None, None)
    run_checkpoint = checkpoint
    checkpoint, tokenizer = args.checkpoint or checkpoint, args.tokenizer or tokenizer
    for name, path in (("checkpoint", checkpoint), ("tokenizer", tokenizer)):
        if args.output and is_same_file(args.output, path):
            p.error(f"--output {args.output} is the {name} {path}: writing it would destroy it")

    tok = data.open_tokenizer(tokenizer)
    ckpt = load_checkpoint(checkpoint)
    if args.checkpoint and run_checkpoint:
        check_same_config(ckpt, checkpoint, run_checkpoint)
    model = model_from(ckpt, checkpoint, args.device, args.dtype, tok)
    beam, alpha = beam_and_alpha(ckpt, args.beam, args.alpha)
    refuse_wide_beams(p, [beam], tok)
    length_penalty, preprocess = text_settings(ckpt, args.length_penalty)
    text = "" if preprocess == "raw" else f"; text {preprocess} (lowercased Moses tokens in, detokenized out)"
    print(f"translate.py: {describe(ckpt, checkpoint)}, tokenizer {tokenizer}; beam {beam}, alpha {alpha} "
          f"({length_penalty}){text}", file=sys.stderr)
    partial, started = f"{args.output}.partial", time.time()
    try:  # a reader of stdout that has gone (... | head) ends it quietly (cli.run)
        translate_stream(args, model, tok, Search(beam, alpha, length_penalty, preprocess), partial)
    except BaseException:
        if args.output and os.path.exists(partial) and os.path.getmtime(partial) >= started:
            sys.stderr.write(f"{args.output} is unchanged; the lines translated before the stop are in {partial}\n")
        raise
    if args.output and os.path.exists(partial):  # an earlier run's, superseded by the whole output
        os.remove(partial)


@dataclass
class Search:
    """How translate_stream decodes: the beam search, and the text the model reads and writes."""
    beam: int
    alpha: float
    length_penalty: str  # decoding.LENGTH_PENALTIES
    preprocess: str  # data.moses.PREPROCESSING


def translate_stream(args, model, tok, search: Search, partial: str) -> None:
    """Translate --input (or stdin) chunk by chunk into --output (or stdout), written as it
    goes: into a temporary file renamed over --output at the end, or to ``partial`` on failure."""
    with contextlib.ExitStack() as stack:
        source = stack.enter_context(open(args.input, "rb")) if args.input else sys.stdin.buffer
        out = stack.enter_context(files.atomic_write(args.output, partial=partial)) if args.output else sys.stdout
        progress = None
        if args.input:
            from tqdm import tqdm

            # A regular file is counted first, for the bar's total; a pipe can be read only once.
            total = None
            if os.path.isfile(args.input):
                total = sum(chunk.count(b"\n") for chunk in iter(lambda: source.read(1 << 20), b""))
                source.seek(0)
            progress = stack.enter_context(tqdm(total=total, unit="line", desc="translate"))
        for first, lines in read_chunks(source.fileno(), args.input or "stdin"):
            hyps = translate(model, tok, data.moses.preprocess(lines, "en", search.preprocess), args.device,
                             search.beam, search.alpha, args.max_tokens, first_line=first,
                             length_penalty=search.length_penalty)
            if search.preprocess == "moses-lc":
                hyps = data.moses.detokenize(hyps, "de")
            out.write("".join(h + "\n" for h in hyps))
            out.flush()
            if progress is not None:
                progress.update(len(lines))


def beam_and_alpha(ckpt: Checkpoint, beam: int | None, alpha: float | None) -> tuple[int, float]:
    """The beam search to decode with: the options given, else the run's (train_wmt.py saves
    the beam and alpha it decodes with beside the averaged model, and its flags in every
    checkpoint), else the paper's."""
    run_flags = {**ckpt.extra.get("args", {}), **ckpt.extra}
    beam = beam or run_flags.get("beam") or decoding.BEAM
    alpha = run_flags.get("alpha", decoding.ALPHA) if alpha is None else alpha
    return beam, alpha


def text_settings(ckpt: Checkpoint, length_penalty: str | None) -> tuple[str, str]:
    """(length penalty, preprocessing): the option given, else the run's (train_wmt.py saves both
    beside the averaged model, and its flags in every checkpoint), else GNMT's and raw text."""
    run_flags = {**ckpt.extra.get("args", {}), **ckpt.extra}
    return (length_penalty or run_flags.get("length_penalty") or "gnmt",
            run_flags.get("preprocess") or "raw")


def refuse_wide_beams(p: cli.ArgumentParser, beams: list[int], tok: data.Tokenizer) -> None:
    """A beam wider than the target vocabulary, refused in one line: its beams cannot all
    differ, and every step would score beam x vocabulary candidates for nothing."""
    for beam in beams:
        if beam > tok.vocab_size:
            p.error(f"--beam {beam}: wider than the target vocabulary ({tok.vocab_size} tokens)")


def describe(ckpt: Checkpoint, path: str) -> str:
    """What the checkpoint holds, for the line that says which model translates."""
    extra = ckpt.extra
    if "averaged_from" in extra:
        what = f"the average of {len(extra['averaged_from'])} checkpoints ({', '.join(extra['averaged_from'])})"
    else:
        what = "the last checkpoint" if os.path.basename(path) == "last.npz" else "one checkpoint"
    step = f", step {extra['step']}" if "step" in extra else ""
    return f"{path}: {what}{step}"


def check_same_config(ckpt: Checkpoint, path: str, run_checkpoint: str) -> None:
    """With --run and --checkpoint, the checkpoint must hold the run's model: one of another
    configuration that shares the tokenizer would load and translate, but not as the run does."""
    run_config = load_checkpoint(run_checkpoint, metadata_only=True).config or {}
    differ = [f"{k} {v} (the run's: {run_config[k]})" for k, v in (ckpt.config or {}).items()
              if k in run_config and run_config[k] != v]
    if differ:
        raise CheckpointError(f"{path} holds a model with {', '.join(differ)}, not the model of the run "
                              f"{run_checkpoint}: give it without --run (with --tokenizer), or a checkpoint of the run")


if __name__ == "__main__":
    cli.run(main, user_errors=(data.CorpusError, CheckpointError))
