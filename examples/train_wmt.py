"""Train an English->German Transformer and report its sacreBLEU: the project's main job.

    python examples/train_wmt.py --data-dir ../shared/data/multi30k      # Multi30k, CPU, < 1 h
    python examples/train_wmt.py                                        # downloads Multi30k first
    mpiexec -n 8 python examples/train_wmt.py --preset wmt14-base --device cuda --precision bf16 \
        --data-dir data/wmt14

Steps: read the corpus (or download it), train one sentencepiece BPE vocabulary for both
languages, batch by token count, train with label smoothing, Adam and the warmup schedule
(section 5), validate and checkpoint as it goes, then average the last checkpoints, translate
the test set with beam search (the preset's beam and alpha) and score it three ways
(minitransformer.bleu): sacreBLEU cased and lowercased against the raw references, and the
Multi30k literature's BLEU on lowercased Moses tokens. ``--preset multi30k-tiny`` is that
literature's recipe (Wu et al. 2021): it trains on lowercased Moses tokens (``--preprocess``).
``--resume`` continues a stopped run exactly where its last checkpoint left it.
``--precision bf16`` (or fp16, with dynamic loss scaling) trains in mixed precision on float32
master weights (minitransformer.amp); it is meant for GPUs, as NumPy has no fast 16-bit GEMM.
``--accumulate N`` makes each optimiser step of N batches (gradient accumulation), so that
fewer GPUs than the paper's 8 still take its 25,000-token steps.

Everything lands in --out-dir (default runs/<preset>): train.jsonl (one line per logged step
and per validation), checkpoints, the averaged model, test hypotheses (test.hyp.de; and
test.tok.de, the Moses tokens, for a moses-lc run), bleu.json and curves.png.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports load is held for cli.run (cli.PREAMBLE)
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import argparse
import datetime
import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass

import numpy as np

import minitransformer as mt
from minitransformer import backend, cli, data, decoding, distributed, files, nn, records, run_folder
from minitransformer.amp import PRECISIONS, GradScaler, autocast, scaler_for
from minitransformer.bleu import bleu, bleu_literature, bleu_scores
from minitransformer.checkpoint import CheckpointError, average_checkpoints, load_checkpoint, restore, save_checkpoint
from minitransformer.data.download import DownloadError, ensure_dataset
from minitransformer.decoding import translate
from minitransformer.optim import Adam, WarmupInverseSqrtSchedule, noam_lr, schedule_factor
from minitransformer.run_folder import ResumeError, checkpoint_step, checkpoints, code_commit
from minitransformer.settings import SettingsError
from minitransformer.train import DivergenceDetector, EarlyStopping, accumulated_step, evaluate_loss, format_ppl

log = logging.getLogger("train_wmt")


@dataclass
class Preset:
    corpus: str
    tokenizer: str  # key of data.PRESETS
    model: dict  # TransformerConfig fields
    max_tokens: int  # per step and side, padding included, all ranks together
    warmup: int
    lr_factor: float  # the schedule's factor (section 5.3), unless peak_lr names its peak
    epochs: int
    max_len: int
    average_last: int
    max_steps: int | None = None  # None: no limit
    beam: int = decoding.BEAM  # beam search: the paper's unless a preset chose its own
    alpha: float = decoding.ALPHA
    preprocess: str = "raw"  # data.moses.PREPROCESSING: what is done to the text before BPE
    adam_eps: float = 1e-9  # section 5.3
    clip_norm: float = 0.0  # the gradients' largest global norm (0: not clipped, as in the paper)
    patience: int = 0  # stop when the validation loss has not improved for this many validations (0: never)
    bleu_sample: int = 100  # validation sentences beam-searched for BLEU at each validation (0: loss alone)
    length_penalty: str = "gnmt"  # decoding.LENGTH_PENALTIES
    peak_lr: float | None = None  # set: the schedule's peak, whatever d_model and warmup (fairseq's --lr)
    limit: int | None = None  # a toy size (--limit): the first N training pairs, N/20 of validation and test
    subwords: str = "sentencepiece"  # data.SUBWORDS: whose BPE (subword-nmt's: the tokenizer preset's
    # vocab_size merges)


PRESETS = {
    # Sized for a 2-core CPU and an hour, everything chosen on the validation split
    # (docs/guide/reproducing.md): a 3+3-layer model of d_model 128 with P_drop 0.2 fits 2.3 times
    # as many steps into it as one of d_model 256, which overfits Multi30k within the hour; beam 8 and
    # alpha 2.0 (examples/tune_decoding.py), as these models' translations run short. A step
    # count ends the run (about an hour on 2 quiet cores), so that its result depends on the
    # seed alone, not on how busy the machine is.
    "multi30k": Preset("multi30k", "multi30k",
                       dict(d_model=128, d_ff=512, h=4, num_encoder_layers=3, num_decoder_layers=3,
                            dropout=0.2, label_smoothing=0.1),
                       max_tokens=2500, warmup=1000, lr_factor=1.5, epochs=100, max_len=100, average_last=5,
                       max_steps=9000, beam=8, alpha=2.0),
    # The whole path in a few minutes, for a first look: 2,000 training pairs, a small model,
    # 1,000 pieces; 100 validation and test sentences. A poor model, a working pipeline.
    "smoke": Preset("multi30k", "smoke",
                    dict(d_model=64, d_ff=256, h=4, num_encoder_layers=2, num_decoder_layers=2,
                         dropout=0.1, label_smoothing=0.1),
                    max_tokens=1000, warmup=200, lr_factor=1.0, peak_lr=0.003, epochs=1000, max_len=100,
                    average_last=3, max_steps=1200, beam=4, alpha=0.6, bleu_sample=0, limit=2000),
    # Wu et al. (2021)'s Transformer-tiny, the recipe of the figure the README compares with (their
    # Revisit-MMT repository, a fairseq 0.9 fork: README-baseline.md, transformer_tiny, the fork's
    # defaults): lowercased Moses tokens; joint BPE of about 9,700 types (sentencepiece's 10,000
    # pieces come within 2%: experiments/subwords/); 4+4 layers, d_ff 256, P_drop 0.3; Adam's
    # eps 1e-8; fairseq's inverse_sqrt to 0.005 at 2,000 updates (the schedule of section 5.3
    # with its factor set by peak_lr, which overrides lr_factor); clipping at norm 25; 2 x 4,096
    # tokens; 8,000 updates at most, stopped after 10 epochs without a better validation loss;
    # the last 10 epochs averaged; beam 5 with fairseq's length normalization (alpha 1: the
    # score over the length).
    "multi30k-tiny": Preset("multi30k", "multi30k-tiny",
                            dict(d_model=128, d_ff=256, h=4, num_encoder_layers=4, num_decoder_layers=4,
                                 dropout=0.3, label_smoothing=0.1),
                            max_tokens=8192, warmup=2000, lr_factor=1.0, peak_lr=0.005,
                            epochs=10_000, max_len=256, average_last=10, max_steps=8000, beam=5, alpha=1.0,
                            preprocess="moses-lc", adam_eps=1e-8, clip_norm=25.0, patience=10, bleu_sample=0,
                            length_penalty="fairseq"),
    # The paper's setups: base and big (Table 3), 25,000 tokens a side per step (section 5.1),
    # about 3,125 per GPU on 8 GPUs.
    "wmt14-base": Preset("wmt14", "wmt14", dict(), max_tokens=25000, warmup=4000, lr_factor=1.0,
                         epochs=100, max_len=256, average_last=5, max_steps=100_000),
    "wmt14-big": Preset("wmt14", "wmt14", dict(d_model=1024, d_ff=4096, h=16, dropout=0.3),
                        max_tokens=25000, warmup=4000, lr_factor=1.0, epochs=100, max_len=256, average_last=20,
                        max_steps=300_000),
}


@dataclass
class Run:
    """A training run's parts: what the loop, validation and checkpointing need, in one place."""
    args: argparse.Namespace
    world: distributed.World
    model: nn.Transformer
    ddp: distributed.DistributedDataParallel | None  # None: one rank
    optimizer: Adam
    schedule: WarmupInverseSqrtSchedule
    scaler: GradScaler | None  # fp16 only
    amp_dtype: str | None  # None: float32 throughout
    batcher: data.TokenBatcher
    tok: data.Tokenizer | data.SubwordNmtTokenizer
    val: data.ParallelCorpus
    val_batches: list
    log_path: str
    corpus: dict  # the training data's fingerprint and pairs, kept in checkpoints for --resume
    detector: DivergenceDetector
    early_stop: EarlyStopping | None  # None: no --patience
    stop_reason: str = ""  # why training stopped (train_loop), for bleu.json

    def autocast(self):
        """The block in which the model computes in ``amp_dtype`` (nothing for fp32)."""
        return autocast(self.model, self.amp_dtype)


@dataclass
class Budget:
    """When training stops, and how often it validates and saves a checkpoint."""
    epochs: int
    max_steps: float  # math.inf: no limit
    eval_every: int

    def spent(self, step: int, epochs: float) -> float:
        """The share of the budget spent (0 to 1) after ``step`` steps and ``epochs`` (fractional)
        seen: the larger of the two, as the first limit ends the run."""
        return min(1.0, max(step / self.max_steps, epochs / self.epochs))


# Options this program had, and what took their place (a run recorded with them resumes as
# run_folder.REMOVED says).
REMOVED_OPTIONS = {
    "--limit-train": "--limit N (N training pairs, N/20 of validation and test)",
    "--limit-val": "--limit N (N training pairs, N/20 of validation and test)",
    "--limit-test": "--limit N (N training pairs, N/20 of validation and test)",
    "--lr-factor": "--peak-lr (the schedule's largest rate, at the end of --warmup)",
    "--time-budget": "removed: a run ends at its --max-steps or --epochs, so that its result depends on its seed "
                     "alone",
    "--bpe-dropout": "removed: BPE-dropout is a study now (experiments/bpe_dropout/), not a training option",
}


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="multi30k")
    p.add_argument("--data-dir", type=cli.data_folder, help="corpus folder, downloaded there if files are missing (default: "
                   "data/<corpus>)")
    p.add_argument("--out-dir", type=cli.output_folder, help="checkpoints, logs, hypotheses, plots (default: runs/<preset>); a run "
                   "holds it (a lock file) until it ends")
    p.add_argument("--device", default="cpu", type=cli.device, choices=backend.DEVICES)
    p.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS),
                   help="fp32, or mixed precision on float32 master weights: bf16, or fp16 with "
                        "dynamic loss scaling (meant for GPUs)")
    p.add_argument("--accumulate", type=cli.integer(1), default=1,
                   help="micro-batches of --max-tokens per optimiser step, their gradients added before it "
                        "(fairseq's --update-freq): the paper's 25,000-token steps on fewer than 8 GPUs")
    p.add_argument("--max-tokens", type=cli.integer(1), help="tokens per batch and side, padding included, all "
                   "ranks together: each rank takes a share of every batch's sentences, and a step is --accumulate "
                   "batches (default: the preset's)")
    p.add_argument("--epochs", type=cli.integer(1), help="epochs to train (default: the preset's)")
    p.add_argument("--max-steps", type=cli.integer(1), help="stop after this many optimiser steps (default: the preset's)")
    p.add_argument("--eval-every", type=cli.integer(0), default=0, help="validate and checkpoint every N steps "
                   "(0: every as many steps as epoch 0 has, about once per epoch)")
    p.add_argument("--bleu-sample", type=cli.integer(0),
                   help="validation sentences beam-searched for BLEU at each validation (0: the loss alone; "
                        "default: the preset's)")
    p.add_argument("--patience", type=cli.integer(0),
                   help="stop when the label-smoothed validation loss has not improved for N validations in a row, "
                        "one an epoch unless --eval-every (fairseq's --patience; 0: never; default: the preset's)")
    p.add_argument("--log-every", type=cli.integer(1), default=20,
                   help="write a line of train.jsonl (and the bar's figures) every N steps")
    p.add_argument("--seed", type=cli.integer(0), default=1,
                   help="seeds the initial weights, the batches' order and the dropout masks")
    p.add_argument("--resume", action="store_true", help="continue from --out-dir/last.npz")
    p.add_argument("--average-last", type=cli.integer(1),
                   help="checkpoints averaged for the final model (default: the preset's)")
    p.add_argument("--keep-checkpoints", type=cli.integer(0),
                   help="step checkpoints kept on disk: the last N, at least those averaged (default: those "
                        "averaged); 0 keeps every one, for a curve of the run's progress (experiments/bleu_minutes/)")
    p.add_argument("--beam", type=cli.integer(1), help="beam size (default: the preset's)")
    p.add_argument("--alpha", type=cli.real(0.0, decoding.ALPHA_MAX), help="length penalty (default: the preset's)")
    p.add_argument("--length-penalty", choices=decoding.LENGTH_PENALTIES,
                   help="what alpha shapes: gnmt, ((5 + |Y|) / 6)^alpha (Wu et al., 2016, as the paper), or fairseq, "
                        "|Y|^alpha (its --lenpen) (default: the preset's)")
    p.add_argument("--warmup", type=cli.integer(1), help="warmup steps of the schedule (default: the preset's)")
    # Any finite rate computes (a runaway one is what the divergence detector stops); 1e100 keeps
    # the schedule's products finite.
    p.add_argument("--peak-lr", type=cli.real(0.0, 1e100, low_open=True),
                   help="the schedule's largest rate, reached at the end of --warmup, as fairseq's --lr with "
                        "inverse_sqrt: the schedule of section 5.3 scaled to peak there (default: the preset's)")
    p.add_argument("--adam-eps", type=cli.real(0.0, 1.0, low_open=True), help="Adam's epsilon (default: the preset's)")
    p.add_argument("--clip-norm", type=cli.real(0.0, 1e9),
                   help="scale the gradients down to this global norm when above it (0: never; default: the preset's)")
    p.add_argument("--limit", type=cli.integer(1), help="a toy size: the first N training pairs, and the first "
                   "N/20 (at least 10) of validation and test")
    p.add_argument("--preprocess", choices=data.moses.PREPROCESSING,
                   help="what is done to the text before BPE: raw (nothing), or moses-lc (lowercased, punctuation "
                        "normalized and Moses-tokenized, as the Multi30k literature's text; default: the preset's)")
    p.add_argument("--vocab-size", type=cli.integer(5), help="BPE vocabulary size; with --subwords subword-nmt, its "
                   "number of merges (default: the preset's)")
    p.add_argument("--subwords", choices=data.SUBWORDS, help="whose BPE: sentencepiece's, or subword-nmt's on "
                   "space-separated words, '@@ ' joined, as fairseq 0.9's recipes (default: the preset's, "
                   "sentencepiece)")
    p.add_argument("--init", choices=nn.INITS, help="plain (Xavier-uniform, zero biases) or fairseq 0.9's "
                   "(nn.Transformer._init_fairseq; default: the preset's, plain)")
    p.add_argument("--decoder-start", choices=nn.DECODER_STARTS, help="the decoder's first input, in training and "
                   "decoding: bos, or eos as fairseq feeds it (default: the preset's, bos)")
    p.add_argument("--d-model", type=cli.integer(1), help="d_model; also sets d_ff to 4 * d_model")
    p.add_argument("--d-ff", type=cli.integer(1), help="d_ff, the inner width of the feed-forward layers "
                   "(default: the preset's, or 4 * --d-model)")
    p.add_argument("--layers", type=cli.integer(1), help="N, for the encoder and the decoder")
    p.add_argument("--dropout", type=cli.real(0.0, 1.0, high_open=True), help="P_drop of section 5.4 (default: the preset's)")
    p.add_argument("--label-smoothing", type=cli.real(0.0, 1.0, high_open=True),
                   help="epsilon_ls of section 5.4 (default: the preset's)")
    p.add_argument("--max-skipped", type=cli.integer(1), default=100, help="stop with an error after this many "
                   "optimiser steps in a row skipped for a non-finite loss or gradient (a diverged run)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (logs still go to stderr)")
    p.add_debug()
    for flag, replacement in REMOVED_OPTIONS.items():
        p.add_removed(flag, replacement)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = argv  # None: sys.argv's; for train.jsonl's start lines (command_line)
    args.out_dir = args.out_dir or os.path.join("runs", args.preset)
    preset = PRESETS[args.preset]
    for key in ("preprocess", "adam_eps", "clip_norm", "patience", "bleu_sample", "limit",
                "subwords"):  # recorded in checkpoints as used
        if getattr(args, key) is None:
            setattr(args, key, getattr(preset, key))
    vocab = args.vocab_size or data.PRESETS[PRESETS[args.preset].tokenizer].vocab_size
    if args.beam and args.beam > vocab:
        p.error(f"--beam {args.beam}: wider than the target vocabulary ({vocab} tokens)")
    try:  # the model's settings, checked now, not after minutes of reading and vocabulary training
        model_config(args, preset, vocab)
    except SettingsError as e:
        p.error(f"--preset {args.preset} with these options: {e}")
    return args


# --------------------------------------------------------------------------- data


def load_data(args, preset: Preset, world, with_test: bool = True):
    """(train, val, test, tokenizer); test is None unless ``with_test``."""
    train, val, test = read_data(args, preset, world, with_test)
    return train, val, test, tokenizer(args, preset, world, train)


def read_data(args, preset: Preset, world, with_test: bool = True):
    """(train, val, test) as --data-dir and --limit give them (downloaded first if missing),
    train and val as --preprocess makes them (test stays raw: finish() preprocesses
    its source and scores against its raw references too); test is None unless ``with_test``."""
    data_dir = args.data_dir or os.path.join("data", preset.corpus)
    with distributed.main_process_alone(world) as main:
        if main:
            ensure_dataset(preset.corpus, data_dir)
    train = limited(data.load_corpus(preset.corpus, data_dir, "train"), args.limit)
    val = limited(data.load_corpus(preset.corpus, data_dir, "val"), args.limit and max(args.limit // 20, 10))
    train, val = (data.moses.preprocess_corpus(c, args.preprocess) for c in (train, val))
    test = None
    if with_test:
        test = data.load_corpus(preset.corpus, data_dir, "test_2016_flickr" if preset.corpus == "multi30k" else "test")
        test = limited(test, args.limit and max(args.limit // 20, 10))
    return train, val, test


def refuse_too_long(train: data.ParallelCorpus, max_len: int) -> None:
    """Refuse, before a tokenizer is trained, training data of which the batcher would keep no
    pair: each has a side of max_len words or more, and a word is one piece at least (both
    tokenizers split on spaces), plus EOS."""
    if not any(max(len(s.split()), len(t.split())) < max_len for s, t in zip(train.src, train.tgt)):
        raise data.CorpusError(f"every training pair of {train.src_paths[0]} and {train.tgt_paths[0]} has a side of "
                               f"{max_len} words or more, longer than the preset keeps ({max_len} tokens): "
                               f"there is nothing to train on")


def limited(corpus: data.ParallelCorpus, n: int | None) -> data.ParallelCorpus:
    """The first ``n`` pairs of ``corpus`` (None: all of it)."""
    return corpus.subset(range(min(n, len(corpus)))) if n else corpus


def tokenizer(args, preset: Preset, world, train) -> data.Tokenizer | data.SubwordNmtTokenizer:
    """The run's BPE vocabulary: rank 0 trains it into --out-dir (or finds it there), the
    others load it. subword-nmt learns as many merges as sentencepiece's vocabulary has pieces."""
    tok_cfg = data.PRESETS[preset.tokenizer]
    if args.vocab_size:
        tok_cfg = data.TokenizerConfig(**{**tok_cfg.__dict__, "vocab_size": args.vocab_size})
    if args.subwords == "subword-nmt":
        tok_cfg = data.SubwordNmtConfig(merges=tok_cfg.vocab_size)
    return distributed.main_process_first(
        world, lambda: data.load_or_train(train, cache_dir=args.out_dir, config=tok_cfg))


# --------------------------------------------------------------------------- training


def model_config(args, preset: Preset, vocab_size: int) -> nn.TransformerConfig:
    """The preset's model, with --d-model (and d_ff = 4 d_model), --d-ff, --layers, --dropout,
    --label-smoothing, --init and --decoder-start applied."""
    params = dict(preset.model)
    if args.d_model:
        params.update(d_model=args.d_model, d_ff=4 * args.d_model)
    if args.d_ff:
        params.update(d_ff=args.d_ff)
    if args.layers:
        params.update(num_encoder_layers=args.layers, num_decoder_layers=args.layers)
    if args.dropout is not None:
        params.update(dropout=args.dropout)
    if args.label_smoothing is not None:
        params.update(label_smoothing=args.label_smoothing)
    if args.init:
        params.update(init=args.init)
    if args.decoder_start:
        params.update(decoder_start=args.decoder_start)
    return nn.TransformerConfig(vocab_size=vocab_size, pad_id=data.PAD_ID, bos_id=data.BOS_ID,
                                eos_id=data.EOS_ID, **params)


def lr_factor(args, preset: Preset, d_model: int, warmup: int) -> float:
    """The schedule's factor: --peak-lr's, or the preset's (its peak_lr's if it names one)."""
    peak = args.peak_lr or preset.peak_lr
    return schedule_factor(peak, d_model, warmup) if peak else preset.lr_factor


def build(args, preset: Preset, tok) -> nn.Transformer:
    return nn.Transformer(model_config(args, preset, tok.vocab_size))


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a step's dropout masks, a function of (run seed, step, rank) as in fairseq:
    a resumed run draws the same masks as an uninterrupted one on any device, with no
    generator state to save (CuPy's cannot be), and every rank draws its own."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def average_last(args) -> int:
    """How many of the last checkpoints are kept and averaged (section 6.1: 5 base, 20 big)."""
    return max(args.average_last or PRESETS[args.preset].average_last, 1)


def kept_checkpoints(args) -> float:
    """How many of the last step checkpoints stay on disk (math.inf: every one)."""
    if args.keep_checkpoints is None:
        return average_last(args)
    return math.inf if args.keep_checkpoints == 0 else max(args.keep_checkpoints, average_last(args))


def plot_curves(log_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = records.read_log(log_path)
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    scored = [r for r in val if "bleu" in r]  # none with --bleu-sample 0
    fig, axes = plt.subplots(1, 2 if scored else 1, figsize=(11 if scored else 6, 4), squeeze=False)
    ax1 = axes[0, 0]
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss (label-smoothed)", lw=0.8)
    ax1.plot([r["step"] for r in train], [math.log(r["ppl"]) for r in train], label="train NLL", lw=0.8)
    ax1.plot([r["step"] for r in val], [math.log(r["ppl"]) for r in val], "o-", label="validation NLL")
    ax1.set_xlabel("step")
    ax1.set_ylabel("nats per token")
    ax1.legend()
    if scored:
        ax2 = axes[0, 1]
        ax2.plot([r["step"] for r in scored], [r["bleu"] for r in scored], "o-", color="C3")
        ax2.set_xlabel("step")
        ax2.set_ylabel(f"BLEU, {scored[0]['bleu_sentences']} validation sentences")
    fig.tight_layout()
    files.save_figure(fig, png_path, dpi=120)


class SetupError(Exception):
    """A setting this run cannot use (no GPU; batching settings that differ from the run's)."""


# Errors a user can act on, each with a message that says what is wrong and what to do: one
# line each (the traceback only with --debug), as argparse's own errors. Interrupts and OSErrors
# on the run's files are told in one line too (minitransformer.cli).
USER_ERRORS = (data.CorpusError, DownloadError, CheckpointError, SetupError, ResumeError, files.FolderInUse,
               records.RecordError)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    return cli.run(lambda _: train_and_evaluate(args), argv, debug=args.debug, user_errors=USER_ERRORS,
                   on_interrupt=lambda: run_folder.resume_hint(args.out_dir, __file__, argv))


def train_and_evaluate(args) -> dict:
    preset = PRESETS[args.preset]
    world = distributed.init(args.device)
    step_tokens(args, preset, world)  # a bad --max-tokens is refused before anything is read or written
    def open_record():  # before minutes of reading, vocabulary training and encoding
        return run_folder.open_record(args, lambda vocab_size: model_config(args, preset, vocab_size))

    if args.resume and not os.path.isdir(args.out_dir):
        open_record()  # says there is no run to resume, and makes no folder
    with run_folder.hold(args.out_dir, world):
        saved = open_record() if args.resume else {}
        for key in ("beam", "alpha", "length_penalty"):  # not given: the run's own (a resumed run keeps its
            # beam search), or the preset's
            if getattr(args, key) is None:
                setattr(args, key, saved.get("args", {}).get(key, getattr(preset, key)))
        if args.keep_checkpoints is None:  # a resumed run keeps what it kept: its curve's checkpoints survive
            args.keep_checkpoints = saved.get("args", {}).get("keep_checkpoints")
        train, val, test = read_data(args, preset, world)
        refuse_too_long(train, preset.max_len)
        if args.resume:  # before the tokenizer is trained into the folder
            run_folder.check_data(args, saved, train, args.data_dir or os.path.join("data", preset.corpus))
        tok = tokenizer(args, preset, world, train)
        run = prepare(args, preset, world, train, val, tok)
        step, history_s = start_or_resume(run)
        budget = training_budget(args, preset, run.batcher)
        if args.resume and step >= budget.max_steps and world.is_main:
            log.warning("%s is at step %d, %s --max-steps %d: it trains no further, and ends as it is (averaged, "
                        "translated, scored); give a larger --max-steps to train on", args.out_dir, step,
                        "past" if step > budget.max_steps else "at", budget.max_steps)
        step, train_seconds = train_loop(run, step, history_s, budget)
        with distributed.main_process_alone(world) as main:
            return finish(run, test, step, train_seconds) if main else {}


def step_tokens(args, preset: Preset, world) -> int:
    """Tokens a side in a step, all ranks together (--max-tokens or the preset's): each rank
    takes a share of every step's sentences, so a step is the same batch whatever the number
    of ranks, and so is the schedule. A W-th of it must hold the longest sentence the preset
    keeps, so that every step but an epoch's last gives each rank a sentence at least."""
    tokens = args.max_tokens or preset.max_tokens
    share = tokens // world.world_size
    if share < preset.max_len:
        raise SetupError(f"--max-tokens {tokens} shared among {world.world_size} ranks gives each "
                         f"{share}, fewer than the longest sentence the preset keeps "
                         f"({preset.max_len}): raise --max-tokens or run fewer ranks")
    return tokens


def prepare(args, preset: Preset, world, train, val, tok) -> Run:
    """The model (seeded by ``args.seed``), optimiser, schedule, batches and log of a run."""
    mt.manual_seed(args.seed + world.rank)  # dropout differs per rank; init is broadcast from rank 0
    model = build(args, preset, tok).to(args.device)
    optimizer = Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=args.adam_eps)
    warmup = args.warmup or preset.warmup
    schedule = WarmupInverseSqrtSchedule(optimizer, model.config.d_model, warmup,
                                         lr_factor(args, preset, model.config.d_model, warmup))
    ddp = distributed.DistributedDataParallel(model, world) if world.world_size > 1 else None
    amp_dtype = PRECISIONS[args.precision]
    # Packed: WMT14's 4.5M pairs as Python lists would take ~10 GB per rank.
    batcher = data.TokenBatcher(data.encode_packed(tok, train.src), data.encode_packed(tok, train.tgt),
                                max_tokens=step_tokens(args, preset, world), max_len=preset.max_len,
                                seed=args.seed, rank=world.rank, world_size=world.world_size,
                                start_id=model.config.start_id)
    val_batches = [tuple(mt.tensor(a, device=args.device) for a in (b.src, b.tgt_in, b.tgt_out))
                   for b in data.TokenBatcher(tok.encode(val.src), tok.encode(val.tgt), max_tokens=4096,
                                              shuffle=False, start_id=model.config.start_id).iter_epoch(0)]
    if world.is_main:
        log.info("%s: %d training pairs (%d dropped as too long), vocabulary %d, %d steps per epoch",
                 args.preset, len(train), batcher.num_dropped, tok.vocab_size, batcher.steps_per_epoch(0))
        log.info("model: %s, precision %s", model.extra_repr(), args.precision)
        if amp_dtype and args.device == "cpu":
            log.warning("--precision %s on the CPU is slow (NumPy has no 16-bit GEMM); it is meant "
                        "for GPUs", args.precision)
    return Run(args, world, model, ddp, optimizer, schedule, scaler_for(amp_dtype), amp_dtype, batcher, tok, val,
               val_batches, os.path.join(args.out_dir, "train.jsonl"),
               {"fingerprint": train.fingerprint, "pairs": len(train)},
               DivergenceDetector(model.config.target_vocab_size),
               EarlyStopping(args.patience) if args.patience else None)


def start_or_resume(run: Run) -> tuple[int, float]:
    """(step, seconds trained): (0, 0) for a new run, else what ``--resume`` restores from last.npz
    (model, optimiser, schedule, loss scale, the batcher's place in the data)."""
    args = run.args
    last_path = os.path.join(args.out_dir, "last.npz")
    if args.resume:
        if run.world.is_main:
            run_folder.remove_unfinished_writes(args.out_dir)
        ckpt = load_checkpoint(last_path)
        run_folder.check_resume(args, ckpt, os.path.basename(run.tok.path),
                                checkpoints(args.out_dir)[-average_last(args):] if run.world.is_main else [])
        restore(ckpt, run.model, run.optimizer, run.schedule, scaler=run.scaler)
        if "divergence" in ckpt.extra:  # checkpoints from before the detector have none
            run.detector.load_state_dict(ckpt.extra["divergence"])
        if run.early_stop is not None and "early_stopping" in ckpt.extra:
            run.early_stop.load_state_dict(ckpt.extra["early_stopping"])
        try:
            run.batcher.load_state_dict(ckpt.extra["batcher"])
        except ValueError as e:  # --max-tokens, --seed, the data subset, the ranks or the code changed
            old = ckpt.extra["batcher"].get("batching") != data.batching.BATCHING
            raise ResumeError(f"{last_path}: {e}; " + (
                "the run's batches were made by an earlier version of the batcher, which this code cannot "
                "continue exactly: finish it with that version, or start a new run"
                if old else "resume with the run's --max-tokens, --seed, --limit and number of ranks, or "
                "start a new run")) from e
        step = ckpt.extra["step"]
        if run.world.is_main:
            log.info("resumed from %s at step %d, epoch %d", last_path, step, run.batcher.position[0])
            before = ckpt.extra.get("args", {}).get("patience", args.patience)
            if before != args.patience:
                log.info("--patience %d where the run had %d (0: never): it goes on as a run with --patience %d "
                         "from the start would have", args.patience, before, args.patience)
            run_folder.truncate_log(run.log_path, step)
            log_start(run, step)
            averaged_copy = os.path.join(args.out_dir, f"ckpt-{step}.npz")
            if not os.path.exists(averaged_copy):  # killed between the two writes of validate_and_save
                save_checkpoint(averaged_copy, run.model, extra=ckpt.extra)
        return step, ckpt.extra["train_seconds"]
    if os.path.exists(last_path) or checkpoints(args.out_dir):
        raise SystemExit(f"error: {args.out_dir} holds checkpoints of an earlier run: pass --resume to "
                         f"continue it, or choose another --out-dir")
    if run.world.is_main:
        run_folder.remove_unfinished_writes(args.out_dir)
        if os.path.exists(run.log_path):
            os.remove(run.log_path)  # a fresh run starts a fresh log
        log_start(run, 0)
    return 0, 0.0


def log_start(run: Run, step: int) -> None:
    """train.jsonl's line for the start of each part of a run (the first, and every --resume):
    its command, the code's commit, the seed and when, so that a figure from the run says what
    made it."""
    command = run_folder.command_line(__file__, run.args.argv, run.world)
    append_record(run.log_path, dict(kind="start", step=step, command=shlex.join(command),
                                     commit=code_commit(), seed=run.args.seed,
                                     time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")))


def training_budget(args, preset: Preset, batcher: data.TokenBatcher) -> Budget:
    """The flags' limits, or the preset's; validation about once an epoch unless --eval-every."""
    return Budget(epochs=args.epochs or preset.epochs,
                  max_steps=args.max_steps or preset.max_steps or math.inf,
                  eval_every=args.eval_every or math.ceil(batcher.steps_per_epoch(0) / args.accumulate))


def train_loop(run: Run, step: int, history_s: float, budget: Budget) -> tuple[int, float]:
    """Train from ``step`` until the budget is spent; returns (steps, seconds trained).

    Every step draws its dropout masks from ``step_seed``, so a resumed run repeats an
    uninterrupted one. Rank 0 logs every ``--log-every`` steps, and validates and saves a
    checkpoint every ``budget.eval_every`` steps and when training stops (the other ranks wait).
    ``--max-skipped`` steps in a row skipped for a non-finite loss or gradient end the run with
    an error: it has diverged. ``history_s`` (seconds trained before a resume) counts in the
    seconds trained.
    """
    args, world = run.args, run.world
    start = time.perf_counter() - history_s
    if run.early_stop is not None and run.early_stop.bad >= run.early_stop.patience:  # a resumed run that had
        run.stop_reason = patience_reason(run.early_stop)                              # stopped early
        return step, history_s
    progress = progress_bar(run, step, budget)
    near_copy = budget.eval_every // 2  # a checkpoint this close to the one before replaces it
    rate = TokenRate()
    stop_reason, skipped_in_a_row = "epochs", 0
    for micro_batches in optimizer_steps(run.batcher, args.accumulate):
        first, batch = micro_batches[0], micro_batches[-1]
        if first.epoch >= budget.epochs or step >= budget.max_steps:  # also a resumed run that had finished
            # Not trained on: put it back, so that a checkpoint taken now resumes with it.
            run.batcher.position = (first.epoch, first.step)
            stop_reason = "max steps" if step >= budget.max_steps else "epochs"
            break
        mt.manual_seed(step_seed(args.seed, step, world.rank))
        # None: this rank's share of a batch of fewer sentences than ranks.
        shares = [tuple(mt.tensor(a, device=args.device) for a in (b.src, b.tgt_in, b.tgt_out)) if len(b) else None
                  for b in micro_batches]
        result = accumulated_step(run.model, run.optimizer, run.schedule, shares,
                                  label_smoothing=run.model.config.label_smoothing, clip_norm=args.clip_norm,
                                  ddp=run.ddp,
                                  amp_dtype=run.amp_dtype, scaler=run.scaler)
        step += 1
        rate.add(result.num_tokens)
        if result.skipped and world.is_main:
            log.warning("step %d skipped: %s (loss %s)", step, result.skipped, result.loss)
        skipped_in_a_row = skipped_in_a_row + 1 if result.skipped else 0
        # The loss is all ranks' mean, and the skips are common: every rank decides alike.
        diverged = run.detector.update(step, result.loss)
        if skipped_in_a_row >= args.max_skipped:
            diverged = f"{skipped_in_a_row} steps in a row were skipped (the last for {result.skipped})"
        if diverged:
            stop_diverged(run, step, diverged)
        if world.is_main and (step % args.log_every == 0 or step == 1):
            log_step(run, step, batch.epoch, result, rate.read(), time.perf_counter() - start, progress)
        if progress is not None:
            epochs = batch.epoch + (batch.step + 1) / run.batcher.steps_per_epoch(batch.epoch)
            progress.update(100 * budget.spent(step, epochs) - progress.n)

        done = step >= budget.max_steps
        patience_spent = False
        if step % budget.eval_every == 0 or done:
            with distributed.main_process_alone(world) as main:
                if main:
                    patience_spent = validate_and_save(run, step, start, supersede=near_copy, final=done)
            if world.world_size > 1:  # rank 0 alone validated: it tells the others
                patience_spent = bool(world.comm.all_reduce_scalar(int(patience_spent), "max"))
        if done or patience_spent:
            stop_reason = "max steps" if done else patience_reason(run.early_stop)
            break
    if progress is not None:
        progress.close()
    seconds = time.perf_counter() - start
    with distributed.main_process_alone(world) as main:
        if main:
            saved = checkpoints(args.out_dir)
            if not saved or checkpoint_step(saved[-1]) != step:  # stopped by the epochs, between checkpoints
                validate_and_save(run, step, start, supersede=near_copy, final=True)
                seconds = time.perf_counter() - start
            log.info("training stopped (%s) after %d steps, %.1f min", stop_reason, step, seconds / 60)
    run.stop_reason = stop_reason
    return step, seconds


def patience_reason(early_stop: EarlyStopping) -> str:
    return (f"patience: no better validation loss in {early_stop.patience} validations since step "
            f"{early_stop.best_step} ({early_stop.best:.4f})")


def optimizer_steps(batcher: data.TokenBatcher, accumulate: int):
    """The batcher's batches, ``accumulate`` at a time: the micro-batches of each optimiser step.
    An epoch's last step takes what the epoch has left, so that no step spans two epochs, and
    after each step ``batcher.position`` is where the next one begins (a checkpoint taken
    between two steps resumes exactly)."""
    micro_batches = []
    for batch in batcher:
        micro_batches.append(batch)
        if len(micro_batches) == accumulate or batch.step + 1 == batcher.steps_per_epoch(batch.epoch):
            yield micro_batches
            micro_batches = []


def stop_diverged(run: Run, step: int, why: str) -> None:
    """End a diverged run on every rank with one line: what happened, the last good checkpoint
    (validate_and_save writes none while the loss is far above its best), and what to try."""
    if not run.world.is_main:
        run.world.comm.barrier()  # rank 0's SystemExit ends every rank (distributed.run_main)
    path = os.path.join(run.args.out_dir, "last.npz")
    if os.path.exists(path):
        good = load_checkpoint(path, metadata_only=True).extra.get("step")
        kept = f"Its last good checkpoint, of step {good}, is {path}"
    else:
        kept = "It wrote no checkpoint before it diverged"
    raise SystemExit(f"error: training diverged at step {step}: {why}. {kept}. Start a new run with a lower "
                     f"--peak-lr or a longer --warmup")


def append_record(path: str, record: dict) -> None:
    """One line of train.jsonl; an OSError (a full disk) names the file."""
    with files.naming(path), open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class TokenRate:
    """Target tokens per second since the last reading."""

    def __init__(self) -> None:
        self.tokens, self.since = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def read(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.since, 1e-9)
        self.tokens, self.since = 0, now
        return rate


def progress_bar(run: Run, step: int, budget: Budget):
    """A tqdm bar on rank 0 (None elsewhere, or with --no-progress) of the share of the budget
    spent, in percent: of the steps or the epochs, whichever ends the run first, so that its
    time left is the run's (a step-bounded run is not shown as the 19,400 steps its
    epochs would take)."""
    if not run.world.is_main or run.args.no_progress:
        return None
    from tqdm import tqdm

    bar = tqdm(total=100.0, unit="%", dynamic_ncols=True,
               bar_format="{percentage:3.0f}% of the budget|{bar}| {elapsed}<{remaining}{postfix}")
    bar.set_postfix(step=step)
    return bar


def log_step(run: Run, step: int, epoch: int, result, tokens_per_s: float, seconds: float, progress) -> None:
    """One line of train.jsonl, and the progress bar's figures."""
    record = dict(kind="train", step=step, epoch=epoch, loss=result.loss, ppl=result.ppl, lr=result.lr,
                  grad_norm=result.grad_norm, tokens=result.num_tokens, tokens_per_s=tokens_per_s, seconds=seconds)
    if run.scaler is not None:
        record["loss_scale"] = run.scaler.scale_value
    append_record(run.log_path, record)
    if progress is not None:
        progress.set_postfix(step=step, loss=f"{result.loss:.3g}", ppl=format_ppl(result.ppl), lr=f"{result.lr:.1e}",
                             tok_s=f"{tokens_per_s:.0f}", epoch=epoch)


def validate_and_save(run: Run, step: int, start: float, supersede: int = 0, final: bool = False) -> bool:
    """Validate, log, and checkpoint; True when --patience is spent (the label-smoothed
    validation loss, the one fairseq's --patience watches, has not improved for that many
    validations). ``start`` is the training clock's zero (perf_counter), and the checkpoint's
    time trained includes this validation. The checkpoint replaces the one before it if that
    is fewer than ``supersede`` steps older: a run that stops shortly after a checkpoint
    (--max-steps, the end of its epochs), or resumes shortly before one,
    would otherwise average a near copy. Regular checkpoints, an interval apart, are all kept.

    No checkpoint is written while the divergence detector suspects the run (its training loss
    far above its best), unless training ends here (``final``), so that a diverging run's last
    checkpoint is its last good one; a non-finite validation loss ends the run as diverged."""
    args = run.args
    seconds = time.perf_counter() - start
    smoothed, ppl = evaluate_loss(run.model, run.val_batches, run.model.config.label_smoothing, run.amp_dtype)
    loss = math.log(ppl)  # the NLL
    if not math.isfinite(smoothed):
        stop_diverged(run, step, f"the validation loss is {smoothed}")
    record = dict(kind="val", step=step, loss=loss, loss_smoothed=smoothed, ppl=ppl, seconds=seconds)
    n = min(args.bleu_sample, len(run.val))
    if n:
        with run.autocast():
            hyps = translate(run.model, run.tok, run.val.src[:n], args.device, args.beam, args.alpha,
                             length_penalty=args.length_penalty)
        if args.preprocess == "moses-lc":  # Moses tokens on both sides: the literature's metric
            score, signature, ratio = bleu_literature(hyps, run.val.tgt[:n], tokenized=True)
        else:
            score, signature, ratio = bleu(hyps, run.val.tgt[:n])
        record.update(bleu=score, bleu_sentences=n, length_ratio=ratio, signature=signature)
        log.info("step %d: validation NLL %.3f (ppl %s), BLEU %.2f on %d sentences, length ratio %.3f "
                 "(sacreBLEU %s)", step, loss, format_ppl(ppl), score, n, ratio, signature)
    else:
        log.info("step %d: validation NLL %.3f (ppl %s), label-smoothed loss %.4f", step, loss, format_ppl(ppl),
                 smoothed)
    append_record(run.log_path, record)
    spent = run.early_stop is not None and run.early_stop.update(step, smoothed)
    if run.detector.suspect and not final:
        log.warning("step %d: no checkpoint written, as the training loss is far above its best: the last "
                    "one stays the last good one", step)
        return spent
    extra = {"step": step, "train_seconds": time.perf_counter() - start, "batcher": run.batcher.state_dict(),
             "args": vars(args), "tokenizer": os.path.basename(run.tok.path), "corpus": run.corpus,
             "divergence": run.detector.state_dict()}
    if run.early_stop is not None:
        extra["early_stopping"] = run.early_stop.state_dict()
    # last.npz resumes training; ckpt-<step>.npz are for averaging and need no Adam moments.
    # last.npz first: a kill between the two writes leaves a run that --resume continues (and
    # start_or_resume then writes the missing ckpt-<step>.npz from the same weights).
    save_checkpoint(os.path.join(args.out_dir, "last.npz"), run.model, run.optimizer, run.schedule,
                    extra=extra, scaler=run.scaler)
    save_checkpoint(os.path.join(args.out_dir, f"ckpt-{step}.npz"), run.model, extra=extra)
    saved = checkpoints(args.out_dir)
    if len(saved) > 1 and step - checkpoint_step(saved[-2]) < supersede:
        log.info("%s replaces %s, %d steps older", os.path.basename(saved[-1]), os.path.basename(saved[-2]),
                 step - checkpoint_step(saved[-2]))
        os.remove(saved.pop(-2))
    keep = kept_checkpoints(args)
    for old in saved[:-keep] if keep < len(saved) else []:
        os.remove(old)
    return spent


def average(run: Run, step: int) -> list[str]:
    """Load the mean of the last checkpoints into the model and save it as averaged.npz
    (section 6.1); returns their paths."""
    paths = checkpoints(run.args.out_dir)[-average_last(run.args):]
    run.model.load_state_dict(average_checkpoints(paths).model)
    save_checkpoint(os.path.join(run.args.out_dir, "averaged.npz"), run.model,
                    extra={"averaged_from": [os.path.basename(p) for p in paths], "step": step,
                           "tokenizer": os.path.basename(run.tok.path),
                           "beam": run.args.beam, "alpha": run.args.alpha,  # translate.py's defaults
                           "length_penalty": run.args.length_penalty, "preprocess": run.args.preprocess,
                           "subwords": run.args.subwords})
    return paths


def finish(run: Run, test, step: int, train_seconds: float) -> dict:
    """Average the last checkpoints, translate the test set and score it: sacreBLEU cased and
    lowercased, and the Multi30k literature's metric (minitransformer.bleu). A moses-lc model's
    output is Moses tokens, scored as they are in the literature's metric (test.tok.de) and
    detokenized for reading and for sacreBLEU (test.hyp.de); it has no cased figure."""
    args, model = run.args, run.model
    paths = average(run, step)
    tokenized = args.preprocess == "moses-lc"
    start = time.perf_counter()
    with run.autocast():
        out = translate(model, run.tok, data.moses.preprocess(test.src, "en", args.preprocess), args.device,
                        args.beam, args.alpha, progress=not args.no_progress, length_penalty=args.length_penalty)
    decode_seconds = time.perf_counter() - start
    hyps = data.moses.detokenize(out, "de") if tokenized else out
    write_lines(os.path.join(args.out_dir, "test.hyp.de"), hyps)
    if tokenized:
        write_lines(os.path.join(args.out_dir, "test.tok.de"), out)
    scores = bleu_scores(hyps, test.tgt, "de", tokens=out if tokenized else None)
    epoch, in_epoch = run.batcher.position
    result = dict(**scores, steps=step,
                  epochs=round(epoch + in_epoch / run.batcher.steps_per_epoch(epoch), 2), stopped=run.stop_reason,
                  train_minutes=train_seconds / 60, decode_seconds=decode_seconds,
                  averaged=[os.path.basename(p) for p in paths], test_sentences=len(test), beam=args.beam,
                  alpha=args.alpha, length_penalty=args.length_penalty, preprocess=args.preprocess,
                  subwords=args.subwords, init=model.config.init, decoder_start=model.config.decoder_start,
                  preset=args.preset, precision=args.precision,
                  parts=[r for r in records.read_log(run.log_path) if r["kind"] == "start"])
    with files.atomic_write(os.path.join(args.out_dir, "bleu.json")) as f:
        json.dump(result, f, indent=2)
    plot_curves(run.log_path, os.path.join(args.out_dir, "curves.png"))
    trained = (f"on {len(test)} test sentences after {step} steps ({train_seconds / 60:.1f} min training, "
               f"{len(paths)} checkpoints averaged; length ratio {result['length_ratio']:.3f})")
    if tokenized:
        print(f"BLEU (cased) = n/a: a model of lowercased text ({args.preprocess}) has no cased figure; {trained}")
    else:
        print(f"BLEU = {result['bleu']:.2f} {trained}")
        print(f"sacreBLEU signature: {result['signature']}")
    print(f"lowercased BLEU = {result['bleu_lowercased']:.2f} (sacreBLEU signature: {result['signature_lowercased']})")
    print(f"literature: {result['literature']:.2f}, BLEU in the Multi30k papers' metric, the figure to compare with "
          f"them (signature: {result['signature_literature']})")
    return result


def write_lines(path: str, lines: list[str]) -> None:
    with files.atomic_write(path) as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    distributed.run_main(main)  # a SystemExit on one rank ends every rank
