#!/usr/bin/env bash
# One command for a fresh GPU machine: build minitransformer.kernels._C, run the GPU tests and the
# benchmarks in about 8 minutes, and print a short table last.
#
#     bash benchmarks/gpu_check.sh            logs and bench.json go to $OUT (or a temp dir)
#
# The machine is assumed to have Python with CuPy, ml_dtypes (the bf16 stages), pybind11,
# setuptools, numpy, pytest and hypothesis, NCCL for CuPy (nccl, step), sentencepiece, sacrebleu,
# tqdm and matplotlib (wmt), and torch for the "vs torch" figures, and no package registry: the
# build (pip --no-deps) uses them as they are.
# GPU_CHECK_SECONDS (default 480) bounds the steps after the build: every step's timeout is cut
# to what is left, and the last steps run only if time is left. The build has no timeout of
# its own, but its time counts against the bound. GPU_CHECK_STAGES picks the steps after
# the build (default: all, in this order of priority):
#     kernels  the kernel tests            bench  benchmarks/attn.py
#     counts   attn.py --counts: the kernels' memory traffic counted on the emulator (g++ builds
#              its count variant here), beside their passes' times on this GPU
#     ncu      tools/kernels/ncu_counts.py: Nsight Compute's counts of the same launches beside the
#              emulator's (where ncu is installed; NCU=<command> names another)
#     nccl     NCCL tests and bandwidth    step   the training step, fp32 and bf16, vs torch
#     suite    the suite's "cuda" cases    wmt    examples/train_wmt.py on Multi30k, bf16
# "wmt" needs the corpus inside the checkout, since ../shared does not travel to the GPU
# machine: `mkdir -p .gpu_data && cp -r ../shared/data/multi30k .gpu_data/` here (1.3 MB,
# git-ignored), and name .gpu_data in the device call's carry.
# The exit status is 0 only if every stage that ran succeeded; the failed ones are named last.
#
#     GPU_CHECK_EMULATED=1 bash benchmarks/gpu_check.sh
#
# runs every stage on the emulated device (MT_EMULATE_CUDA=1) at toy sizes, without the build:
# CI does (tests/benchmarks/test_gpu_check.py), so that a lent GPU's minutes are never lost
# to a typo here. Nothing it prints measures a GPU.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
DEADLINE=${GPU_CHECK_SECONDS:-480}
# Each stage's sizes: the GPU's, or the emulated check's toys (the same commands otherwise).
KERNEL_TESTS=() ATTN_SIZES=(--quick) COUNT_SIZES=(--quick --seqs 128) ALLREDUCE_MAX=256M STEP_MODEL=(--base --steps 10) SUITE_PICK=""
WMT_SIZES=(--max-steps 100 --eval-every 100 --bleu-sample 50 --limit 4000)  # 200 validation and test pairs
DATA=${GPU_CHECK_DATA:-.gpu_data/multi30k}
NCU=${NCU:-ncu}
if [ -n "${GPU_CHECK_EMULATED:-}" ]; then
    export MT_EMULATE_CUDA=1
    KERNEL_TESTS=(-k "test_dispatch_attention or limits")
    ATTN_SIZES=(--quick --emulated)
    COUNT_SIZES=(--quick --emulated --seqs 40 --dtypes bf16 fp32 --head-dims 32 --causal yes)
    ALLREDUCE_MAX=64K
    STEP_MODEL=(--d-model 64 --d-ff 128 --heads 2 --layers 1 --vocab 64 --batch 4 --len 8 --steps 2 --warmup 1)
    SUITE_PICK=" and beam"
    WMT_SIZES=(--max-steps 2 --eval-every 2 --bleu-sample 4 --limit 300
               --vocab-size 400 --d-model 32 --layers 1 --max-tokens 600 --warmup 10)
    DATA=${GPU_CHECK_DATA:-../shared/data/multi30k}
fi
FAILED=()
# Record stage $1 as failed unless its exit status $2 is 0.
check() { (($2 == 0)) || FAILED+=("$1 (exit $2)"); }
# The timeout for the next step: its own limit, or what is left before DEADLINE (20 s kept
# for the summary), at least 10 s.
limit() { local left=$((DEADLINE - SECONDS - 20)); ((left < 10)) && left=10; echo $(($1 < left ? $1 : left)); }
STAGES=" ${GPU_CHECK_STAGES:-kernels bench counts ncu nccl step suite wmt} "
# True when stage $1 was asked for and at least $2 seconds are left.
want() { [[ $STAGES == *" $1 "* ]] && ((DEADLINE - SECONDS - 20 >= $2)) || { echo "$1: skipped"; false; }; }
LOGS=${OUT:-$(mktemp -d)}
mkdir -p "$LOGS"
echo "logs: $LOGS"
# The benchmarks' records (--record) go beside the logs, not into the checkout: a GPU's lines
# are copied into benchmarks/records/ once looked at, and an emulated run's never are.
export MT_RECORDS_DIR=${MT_RECORDS_DIR:-$LOGS/records}
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)  date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || true
echo "python: $PY  nvcc: $(command -v nvcc || echo 'not on PATH') CUDA_HOME=${CUDA_HOME:-unset}"
"$PY" -c "import setuptools, pybind11" || echo "WARNING: setuptools or pybind11 missing: the build will fail"

if [ -n "${GPU_CHECK_EMULATED:-}" ]; then
    echo "build: skipped (GPU_CHECK_EMULATED: the emulator builds csrc/ for the CPU itself)"
else
    # Build only for this GPU's architecture (CI builds sm_80, sm_86, sm_89, sm_90 and PTX): a
    # quarter of the compile time.
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    export MINITRANSFORMER_CUDA_ARCHS=${MINITRANSFORMER_CUDA_ARCHS:-${cap:-90}}
    start=$SECONDS
    if ! "$PY" -m pip install --no-build-isolation --no-deps -e . >"$LOGS/build.log" 2>&1; then
        tail -n 60 "$LOGS/build.log"
        echo "BUILD FAILED"
        exit 1
    fi
    echo "build: $((SECONDS - start)) s (sm_$MINITRANSFORMER_CUDA_ARCHS)"
fi
"$PY" -c "import minitransformer.kernels as K; assert K.available(), K.unavailable_reason(); print('kernels available')" || exit 1
"$PY" -c "import hypothesis, pytest" 2>/dev/null || echo "WARNING: pytest/hypothesis missing; GPU tests cannot run"

tests_rc=skipped
if want kernels 30; then
    start=$SECONDS
    # The twins and the kernels on the GPU; not the emulated kernels (the tests that take the
    # fixture C are marked emulator), the sanitizers, or ptxas's resource figures.
    timeout "$(limit 200)" "$PY" -m pytest -q -p no:cacheprovider --hypothesis-profile=gpu_check \
        -m "not emulator" --ignore=tests/kernels/test_resources.py \
        --ignore=tests/kernels/test_sanitizers.py \
        "${KERNEL_TESTS[@]}" tests/kernels >"$LOGS/tests.log" 2>&1
    tests_rc=$?
    check kernels $tests_rc
    echo "tests: $((SECONDS - start)) s, exit $tests_rc"
    grep -E "^(FAILED|ERROR)" "$LOGS/tests.log" | head -n 20
fi

if want bench 30; then
    start=$SECONDS
    timeout "$(limit 200)" "$PY" benchmarks/attn.py "${ATTN_SIZES[@]}" --record --json "$LOGS/bench.json" >"$LOGS/bench.log" 2>&1
    bench_rc=$?
    check bench $bench_rc
    echo "benchmarks: $((SECONDS - start)) s, exit $bench_rc"
    [ $bench_rc -ne 0 ] && tail -n 30 "$LOGS/bench.log"
fi

# The attention kernels' and the kernel ladder's memory traffic, counted in the emulator's count
# variant (requests, sectors, wavefronts, barriers, mma: what Nsight Compute reports), each beside
# its pass's time on this GPU at the counted shape: the prediction the GPU checks.
if want counts 60; then
    start=$SECONDS
    timeout "$(limit 240)" "$PY" benchmarks/attn.py "${COUNT_SIZES[@]}" --counts --record --json "$LOGS/counts.json" \
        >"$LOGS/counts.log" 2>&1
    rc=$?
    check counts $rc
    echo "counts: $((SECONDS - start)) s, exit $rc"
    ((rc == 0)) || tail -n 20 "$LOGS/counts.log"
fi

# Nsight Compute's own counts of the launches the counts stage counted, each beside the
# emulator's with their ratio (tools/kernels/ncu_counts.py), where ncu is installed (NCU names
# another command).
if want ncu 60; then
    if ! command -v "$NCU" >/dev/null; then
        echo "ncu: not run (no Nsight Compute: '$NCU' is not a command here)"
    elif [ ! -s "$LOGS/counts.json" ]; then
        echo "ncu: not run (no counts.json: the counts stage did not run or failed)"
    else
        start=$SECONDS
        timeout "$(limit 180)" "$PY" tools/kernels/ncu_counts.py --ncu "$NCU" --counts "$LOGS/counts.json" \
            --json "$LOGS/ncu.json" >"$LOGS/ncu.log" 2>&1
        rc=$?
        check ncu $rc
        echo "ncu: $((SECONDS - start)) s, exit $rc"
        ((rc == 0)) || tail -n 20 "$LOGS/ncu.log"
    fi
fi

# The NCCL path end to end (one rank: NCCL refuses two ranks on one GPU) and its bus bandwidth.
if want nccl 20; then
    start=$SECONDS
    timeout "$(limit 60)" "$PY" -m pytest -q -p no:cacheprovider tests/distributed/test_nccl.py >"$LOGS/nccl.log" 2>&1
    rc=$?
    check "nccl tests" $rc
    echo "nccl tests: $((SECONDS - start)) s, exit $rc ($(tail -n 1 "$LOGS/nccl.log"))"
    timeout "$(limit 45)" "$PY" benchmarks/allreduce.py --device cuda --max-bytes $ALLREDUCE_MAX >"$LOGS/allreduce.log" 2>&1
    rc=$?
    check allreduce $rc
    ((rc == 0)) || tail -n 20 "$LOGS/allreduce.log"
fi

# A whole training step of the base model at one GPU's share of a 25k-token batch, next to
# torch.nn.Transformer, in float32 and in bf16 mixed precision (amp vs torch.autocast), with
# our step's phases (the README's scaling model), and what a per-step reseed costs (train_wmt
# reseeds every step so that a resumed run is exact).
if want step 30; then
    for prec in fp32 bf16; do
        timeout "$(limit 90)" "$PY" benchmarks/train_step.py --device cuda "${STEP_MODEL[@]}" --breakdown \
            --precision $prec >"$LOGS/train_step_$prec.log" 2>&1
        rc=$?
        check "step $prec" $rc
        ((rc == 0)) || tail -n 20 "$LOGS/train_step_$prec.log"
    done
    timeout "$(limit 30)" "$PY" -c "
import time, statistics, minitransformer as mt
from minitransformer import backend
ms = []
for s in range(12):
    mt.manual_seed(s); backend.generator('cuda').random(1); t = time.perf_counter()
    mt.manual_seed(s + 100); backend.generator('cuda').random(1)
    ms.append((time.perf_counter() - t) * 1e3)
print(f'reseed + first cuda draw: median {statistics.median(ms[2:]):.2f} ms')" >"$LOGS/reseed.log" 2>&1
    check reseed $?
fi

# The "cuda" cases of the rest of the suite (autograd, every functional op's CuPy composite,
# modules, Adam, decoding, mixed precision, training steps and fused ops against the CPU in
# test_device_parity.py), 10 examples per property. -k "devices" and "through_F" add the
# cross-device tests whose names do not say cuda.
suite_rc=skipped
if want suite 60; then
    start=$SECONDS
    timeout "$(limit 180)" "$PY" -m pytest -q -p no:cacheprovider --hypothesis-profile=gpu_suite \
        tests/functional tests/nn tests/optim tests/test_autograd.py tests/test_tensor.py \
        tests/test_decoding.py tests/test_amp.py tests/test_device_parity.py \
        -k "(cuda or devices or through_F)$SUITE_PICK" >"$LOGS/suite.log" 2>&1
    suite_rc=$?
    check suite $suite_rc
    echo "suite (cuda cases): $((SECONDS - start)) s, exit $suite_rc"
    grep -E "^(FAILED|ERROR)" "$LOGS/suite.log" | head -n 20
fi

# The main job end to end on the GPU, briefly: bf16 training, validation, checkpoints,
# averaging, beam search and sacreBLEU on 200 test sentences.
if [ -f "$DATA/train.en.gz" ] && want wmt 60; then
    start=$SECONDS
    timeout "$(limit 150)" "$PY" examples/train_wmt.py --data-dir "$DATA" --device cuda --precision bf16 \
        --out-dir "$LOGS/wmt" "${WMT_SIZES[@]}" --log-every 10 --no-progress >"$LOGS/wmt.log" 2>&1
    rc=$?
    check wmt $rc
    echo "train_wmt (bf16, ${WMT_SIZES[1]} steps): $((SECONDS - start)) s, exit $rc"
    ((rc == 0)) || tail -n 20 "$LOGS/wmt.log"
elif [[ $STAGES == *" wmt "* ]]; then
    echo "wmt: skipped, no corpus at $DATA (see the header)"
fi

"$PY" - "$LOGS" "$tests_rc" "$suite_rc" <<'PY'
import json, os, re, sys
logs, tests_rc, suite_rc = sys.argv[1:4]
print("\n================ gpu_check summary ================")
for name, label, rc in (("tests.log", "tests", tests_rc), ("suite.log", "suite", suite_rc)):
    try:
        lines = open(os.path.join(logs, name)).read().strip().splitlines()
    except OSError:
        lines = []
    if rc == "skipped":
        print(f"{label}: skipped")
    else:
        print(f"{label}:", lines[-1] if lines else "no output", "" if rc == "0" else f"(exit {rc})")
try:
    r = json.load(open(os.path.join(logs, "bench.json")))
except (OSError, ValueError):
    print("benchmarks: no results (see bench.log)")
    r = {"attention": [], "bandwidth": []}
print(f"GPU: {r.get('gpu')}   copy bandwidth: {r.get('copy_GBps', 0):.0f} GB/s")
print("attention fwd+bwd, TFLOP/s (target: bf16 d=64 fused >= 0.5 x torch)")
print(f"{'dtype':>5} {'causal':>6} {'d':>4} {'seq':>5} {'fused':>7} {'torch':>7} {'ratio':>6}")
fmt = lambda v: f"{v:7.1f}" if isinstance(v, (int, float)) else f"{str(v):>7}"
for a in r["attention"]:
    if a["pass"] == "fwd+bwd":
        ratio = a.get("vs_torch")
        print(f"{a['dtype']:>5} {a['causal']:>6} {a['d']:>4} {a['seq']:>5} {fmt(a.get('fused_TF'))} "
              f"{fmt(a.get('torch_TF'))} {ratio if ratio is None else round(ratio, 2)!s:>6}")
print("bandwidth (target >= 0.8 of copy)")
for b in r["bandwidth"]:
    print(f"{b['kernel']:>14} {b['dtype']:>5} {b['GBps']:8.0f} GB/s {b['of_copy']:5.2f}")
for name, last in (("counts.log", 7), ("ncu.log", 12), ("allreduce.log", 6), ("train_step_fp32.log", 13), ("train_step_bf16.log", 13),
                   ("reseed.log", 1), ("wmt.log", 3)):
    path = os.path.join(logs, name)
    if os.path.exists(path):
        print(f"--- {name} (last lines)")
        print("\n".join(open(path).read().strip().splitlines()[-last:]))
try:
    rows = [json.loads(line) for line in open(os.path.join(logs, "wmt", "train.jsonl"))]
    train = [r for r in rows if r["kind"] == "train"]
    print(f"train_wmt bf16: {train[-1]['tokens_per_s']:.0f} target tokens/s at step {train[-1]['step']}")
except (OSError, ValueError, IndexError, KeyError):
    print("train_wmt bf16: no training log (the stage was skipped or failed: see wmt.log)")
PY
check summary $?
if ((${#FAILED[@]})); then
    printf 'FAILED: %s\n' "${FAILED[@]}"
    exit 1
fi
