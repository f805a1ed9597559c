#!/usr/bin/env bash
# The first minutes of a lent GPU machine, planned to the minute: the kernels built beforehand
# and checked against the machine, the kernels' property checks, the whole model's parity on
# "cuda" against the CPU, one data-parallel step over NCCL where there are two GPUs or more,
# attn.py's ladder and attention timings, and the training step, in at most 6 minutes on one
# H100 or H200; then, while time is left, the rest; a short table last.
#
#     python tools/kernels/prebuilt.py build --python python3.12   # first, here: .gpu_build/ (nvcc's minutes)
#     bash benchmarks/gpu_check.sh      # on the GPU machine (its Python is 3.12), .gpu_build carried along
#
# Logs, JSON and the records go to $OUT (or a temp dir): every figure is a record line
# ($MT_RECORDS_DIR, default $OUT/records; benchmarks/render.py renders them once they are
# copied into benchmarks/records/), the stages' times too (gpu_check.jsonl); counts.json, with the
# ladder's GPU times, is what the reading's ladder renders as docs/ladder.json. A record names
# its commit: a copy sent without .git needs MT_RECORD_COMMIT=$(git rev-parse --short HEAD).
#
# Each stage has a budget, what it should take on one H100 with room to spare: it runs only if
# its budget fits before the overall deadline (GPU_CHECK_SECONDS, default 360), is stopped at its
# budget, and prints "<stage>: <seconds> s of <budget> s, exit <status>", or why it did not run.
# The budgets, in the order of priority (the first six make the six minutes; ddp takes none of
# them on one GPU):
#     build    20  tools/kernels/prebuilt.py install: the prebuilt _C checked against the GPU's
#                  architecture, the driver, Python's ABI and csrc/; where it does not match,
#                  rebuilt here for this GPU (nvcc, 180 s more); the carried wheels installed
#     kernels  75  the kernels' property checks against their references (tests/kernels)
#     parity   50  the whole model on "cuda" against the CPU: training steps in fp32, bf16 and
#                  fp16, beam search, the fused ops through F (tests/test_device_parity.py)
#     ddp      40  one data-parallel training step over NCCL, a rank per GPU (two GPUs or more)
#     attn    120  benchmarks/attn.py at 1,024 and 4,096 tokens, head dim 64, against PyTorch,
#                  the kernels' bandwidth, each kernel's memory traffic counted on the emulator
#                  (its count variant compiled by g++ here, beside the stages before) beside its
#                  pass's time here, and the kernel ladder with its GPU times
#     step     60  a training step of the paper's base model, bf16 and fp32, against PyTorch
#     nccl     30  the NCCL tests and the all-reduce timed on one rank
#     suite   120  the rest of the suite's "cuda" cases (autograd, ops, modules, Adam, decoding)
#     ncu      90  Nsight Compute's counts of the counted launches (where ncu is installed)
#     wmt     150  examples/train_wmt.py on Multi30k, bf16, briefly (the corpus carried in .gpu_data)
# GPU_CHECK_STAGES picks stages (default: all); GPU_CHECK_SCALE scales every budget and the
# deadline, in percent (default 100). "wmt" needs the corpus inside the checkout, since
# ../shared does not travel: `mkdir -p .gpu_data && cp -r ../shared/data/multi30k .gpu_data/`
# here (1.3 MB, git-ignored), and name .gpu_data in the device call's carry.
# The machine is assumed to have Python with CuPy, ml_dtypes, numpy, pytest and hypothesis,
# NCCL and mpiexec (ddp, nccl), torch for the "vs torch" figures, and, for a rebuild only,
# nvcc, setuptools and pybind11; no package registry is needed.
# The exit status is 0 only if every stage that ran succeeded; the failed ones are named last.
#
#     GPU_CHECK_EMULATED=1 bash benchmarks/gpu_check.sh
#
# runs every stage on the emulated device (MT_EMULATE_CUDA=1) at toy sizes, with two emulated
# GPUs for ddp, every budget ten times the GPU's (GPU_CHECK_SCALE=1000): CI does
# (tests/benchmarks/test_gpu_check.py), so that a lent GPU's minutes are never lost to a typo
# here. Nothing it prints measures a GPU.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, whether or not pip installed it
# Each stage's sizes: the GPU's, or the emulated check's toys (the same commands otherwise).
KERNEL_PICK=() PARITY_PICK=() SUITE_PICK="" XDIST=()
ATTN_SIZES=(--quick --seqs 1024 4096 --head-dims 64)  # d 64 alone: each counted case is seconds of CPU
DDP_MODEL=(--steps 2 --warmup 1) STEP_MODEL=(--base --steps 10) ALLREDUCE_MAX=256M
WMT_SIZES=(--max-steps 100 --eval-every 100 --bleu-sample 50 --limit 4000)  # 200 validation and test pairs
DATA=${GPU_CHECK_DATA:-.gpu_data/multi30k}
NCU=${NCU:-ncu}
SCALE=${GPU_CHECK_SCALE:-100}
if [ -n "${GPU_CHECK_EMULATED:-}" ]; then
    export MT_EMULATE_CUDA=1
    SCALE=${GPU_CHECK_SCALE:-1000}
    KERNEL_PICK=(-k "test_dispatch_attention or limits")
    PARITY_PICK=(-k "kernels_did_the_work")
    XDIST=(-n 0)  # a few tests: pytest-xdist's workers would cost more than they save
    SUITE_PICK=" and beam"
    ATTN_SIZES=(--quick --emulated --seqs 40 --dtypes bf16 fp32 --head-dims 32 --causal yes)
    TOY=(--d-model 64 --d-ff 128 --heads 2 --layers 1 --vocab 64 --batch 4 --len 8 --warmup 1)
    DDP_MODEL=("${TOY[@]}" --steps 1) STEP_MODEL=("${TOY[@]}" --steps 2) ALLREDUCE_MAX=64K
    WMT_SIZES=(--max-steps 2 --eval-every 2 --bleu-sample 4 --limit 300
               --vocab-size 400 --d-model 32 --layers 1 --max-tokens 600 --warmup 10)
    DATA=${GPU_CHECK_DATA:-../shared/data/multi30k}
fi
DEADLINE=$(( ${GPU_CHECK_SECONDS:-360} * SCALE / 100 ))
STAGES=" ${GPU_CHECK_STAGES:-build kernels parity ddp attn step nccl suite ncu wmt} "
FAILED=() TIMES=()
LOGS=${OUT:-$(mktemp -d)}
mkdir -p "$LOGS"
echo "logs: $LOGS"
# The benchmarks' records (--record) go beside the logs, not into the checkout: a GPU's lines
# are copied into benchmarks/records/ once looked at, and an emulated run's never are.
export MT_RECORDS_DIR=${MT_RECORDS_DIR:-$LOGS/records}
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo "${MT_RECORD_COMMIT:-unknown: no .git and no MT_RECORD_COMMIT, so no record can be written}")  date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader 2>/dev/null
echo "python: $PY  nvcc: $(command -v nvcc || echo 'not on PATH')  deadline: $DEADLINE s"

# The seconds left of the running stage's budget (at least 1), for its commands' timeouts.
left() { local s=$((STAGE_END - SECONDS)); echo $((s > 1 ? s : 1)); }
# stage NAME BUDGET FUNCTION: FUNCTION within BUDGET seconds (scaled), if asked for and if the
# budget fits before the deadline; its time, budget and status printed and kept for the record.
stage() {
    local name=$1 budget=$(($2 * SCALE / 100)) room=$((DEADLINE > SECONDS ? DEADLINE - SECONDS : 0))
    [[ $STAGES == *" $name "* ]] || return 0
    if ((budget > room)); then
        echo "$name: skipped, its $budget s budget does not fit in the $room s left"
        return 0
    fi
    local start=$SECONDS rc
    STAGE_END=$((SECONDS + budget))
    "$3"
    rc=$?
    budget=$((STAGE_END - start))  # a rebuild extends the build's
    TIMES+=("$name=$((SECONDS - start))")
    if ((rc == 124 || rc == 137)); then
        echo "$name: $((SECONDS - start)) s of $budget s, stopped at its budget"
        FAILED+=("$name (stopped at its $budget s budget)")
    else
        echo "$name: $((SECONDS - start)) s of $budget s, exit $rc"
        ((rc == 0)) || FAILED+=("$name (exit $rc)")
    fi
}

build_stage() {
    if [ -n "${GPU_CHECK_EMULATED:-}" ]; then
        echo "(GPU_CHECK_EMULATED: no build; the emulator builds csrc/ for the CPU itself)"
        return 0
    fi
    if compgen -G ".gpu_build/wheels/*.whl" >/dev/null; then  # what the machine's image lacks
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$LOGS/site" .gpu_build/wheels/*.whl \
            && export PYTHONPATH="$PYTHONPATH:$LOGS/site"
    fi
    timeout "$(left)" "$PY" tools/kernels/prebuilt.py install >"$LOGS/build.log" 2>&1 && { cat "$LOGS/build.log"; return 0; }
    cat "$LOGS/build.log"
    # Rebuild in place for this GPU's architecture alone (CI builds sm_80, sm_86, sm_89, sm_90 and PTX).
    local cap
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    STAGE_END=$((STAGE_END + 180 * SCALE / 100))
    echo "rebuilding for sm_${cap:-90}, up to $(left) s"
    MINITRANSFORMER_CUDA_ARCHS=${cap:-90} timeout "$(left)" "$PY" setup.py -q build_ext --inplace \
        >>"$LOGS/build.log" 2>&1 || { local rc=$?; tail -n 40 "$LOGS/build.log"; return $rc; }
}

kernels_stage() {
    # The twins and the kernels on the GPU; not the emulated kernels (the tests that take the
    # fixture C are marked emulator), the sanitizers, or ptxas's resource figures.
    timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" --hypothesis-profile=gpu_check -m "not emulator and not slow" \
        --ignore=tests/kernels/test_resources.py --ignore=tests/kernels/test_sanitizers.py \
        "${KERNEL_PICK[@]}" tests/kernels >"$LOGS/tests.log" 2>&1
    local rc=$?
    grep -E "^(FAILED|ERROR)" "$LOGS/tests.log" | head -n 20
    return $rc
}

parity_stage() {
    timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" --hypothesis-profile=gpu_suite \
        "${PARITY_PICK[@]}" tests/test_device_parity.py >"$LOGS/parity.log" 2>&1
    local rc=$?
    grep -E "^(FAILED|ERROR)" "$LOGS/parity.log" | head -n 20
    return $rc
}

ddp_stage() {
    local gpus
    if [ -n "${GPU_CHECK_EMULATED:-}" ]; then
        gpus=2  # two ranks, each its emulated GPU, NCCL's calls carried over MPI
    else
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    fi
    if ((gpus < 2)); then
        echo "ddp: not run: $gpus GPU here, and a data-parallel step over NCCL needs two"
        return 0
    fi
    timeout "$(left)" mpiexec -n "$gpus" "$PY" benchmarks/train_step.py --device cuda "${DDP_MODEL[@]}" --record \
        >"$LOGS/ddp.log" 2>&1 || { local rc=$?; tail -n 20 "$LOGS/ddp.log"; return $rc; }
}

attn_stage() {
    # The count variant was compiling meanwhile (started after the build): wait for it, within the budget.
    timeout "$(left)" tail --pid="$COUNT_BUILD" -f /dev/null
    timeout "$(left)" "$PY" benchmarks/attn.py "${ATTN_SIZES[@]}" --counts --record --json "$LOGS/counts.json" \
        >"$LOGS/counts.log" 2>&1 || { local rc=$?; tail -n 20 "$LOGS/counts.log"; return $rc; }
}

step_stage() {
    # The paper's base model at one GPU's share of a 25k-token batch, against
    # torch.nn.Transformer, in bf16 mixed precision (amp vs torch.autocast) and float32, with
    # our step's phases (the README's scaling model).
    local prec
    for prec in bf16 fp32; do
        timeout "$(left)" "$PY" benchmarks/train_step.py --device cuda "${STEP_MODEL[@]}" --breakdown \
            --precision $prec --record >"$LOGS/train_step_$prec.log" 2>&1 \
            || { local rc=$?; tail -n 20 "$LOGS/train_step_$prec.log"; return $rc; }
    done
}

nccl_stage() {
    # The NCCL path end to end (one rank: NCCL refuses two ranks on one GPU), and the all-reduce's
    # times (a bus bandwidth, and so a record, needs two ranks: mpiexec on two GPUs).
    timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" tests/distributed/test_nccl.py >"$LOGS/nccl.log" 2>&1 \
        || { local rc=$?; tail -n 20 "$LOGS/nccl.log"; return $rc; }
    timeout "$(left)" "$PY" benchmarks/allreduce.py --device cuda --max-bytes $ALLREDUCE_MAX \
        >"$LOGS/allreduce.log" 2>&1 || { local rc=$?; tail -n 20 "$LOGS/allreduce.log"; return $rc; }
}

suite_stage() {
    # The "cuda" cases of the rest of the suite, 10 examples per property. -k "devices" and
    # "through_F" add the cross-device tests whose names do not say cuda.
    timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" --hypothesis-profile=gpu_suite \
        tests/functional tests/nn tests/optim tests/test_autograd.py tests/test_tensor.py \
        tests/test_decoding.py tests/test_amp.py -k "(cuda or devices or through_F)$SUITE_PICK" >"$LOGS/suite.log" 2>&1
    local rc=$?
    grep -E "^(FAILED|ERROR)" "$LOGS/suite.log" | head -n 20
    return $rc
}

ncu_stage() {
    # Nsight Compute's own counts of the launches the attn stage counted, each beside the
    # emulator's with their ratio (tools/kernels/ncu_counts.py).
    if ! command -v "$NCU" >/dev/null; then
        echo "ncu: not run: no Nsight Compute ('$NCU' is not a command here)"
    elif [ ! -s "$LOGS/counts.json" ]; then
        echo "ncu: not run: no counts.json (the attn stage did not run or failed)"
    else
        timeout "$(left)" "$PY" tools/kernels/ncu_counts.py --ncu "$NCU" --counts "$LOGS/counts.json" \
            --json "$LOGS/ncu.json" >"$LOGS/ncu.log" 2>&1 || { local rc=$?; tail -n 20 "$LOGS/ncu.log"; return $rc; }
    fi
}

wmt_stage() {
    # The main job end to end, briefly: bf16 training, validation, checkpoints, averaging, beam
    # search and sacreBLEU on 200 test sentences.
    if [ ! -f "$DATA/train.en.gz" ]; then
        echo "wmt: not run: no corpus at $DATA (see the header)"
        return 0
    fi
    timeout "$(left)" "$PY" examples/train_wmt.py --data-dir "$DATA" --device cuda --precision bf16 \
        --out-dir "$LOGS/wmt" "${WMT_SIZES[@]}" --log-every 10 --no-progress >"$LOGS/wmt.log" 2>&1 \
        || { local rc=$?; tail -n 20 "$LOGS/wmt.log"; return $rc; }
}

echo "plan: build 20 s, kernels 75, parity 50, ddp 40, attn 120, step 60; then, while time is left, nccl 30," \
     "suite 120, ncu 90, wmt 150 (GPU seconds; here x $SCALE %, within $DEADLINE s)"
stage build 20 build_stage
if [[ $STAGES == *" build "* ]] && ((${#FAILED[@]})); then
    echo "FAILED: build: no kernels to check"
    exit 1
fi
"$PY" -c "import minitransformer.kernels as K; assert K.available(), K.unavailable_reason()" || exit 1
# attn's counts need the emulator's count variant of csrc/ (g++, a minute of CPU on a cold
# cache): compiled now, beside the GPU's stages, rather than inside attn's budget.
"$PY" -c "from minitransformer.emulated import emulator; emulator.compile_variant('count')" >"$LOGS/count_build.log" 2>&1 &
COUNT_BUILD=$!
stage kernels 75 kernels_stage
stage parity 50 parity_stage
stage ddp 40 ddp_stage
stage attn 120 attn_stage
stage step 60 step_stage
stage nccl 30 nccl_stage
stage suite 120 suite_stage
stage ncu 90 ncu_stage
stage wmt 150 wmt_stage

"$PY" - "$LOGS" "$SECONDS" "${GPU_CHECK_EMULATED:-}" "${TIMES[@]}" <<'PY'
import json, os, re, subprocess, sys
from minitransformer import records
logs, total, emulated, *times = sys.argv[1:]
print("\n================ gpu_check summary ================")
for name in ("tests.log", "parity.log", "suite.log"):
    try:
        print(f"{name[:-4]}:", open(os.path.join(logs, name)).read().strip().splitlines()[-1])
    except (OSError, IndexError):  # a stage skipped or cut off leaves no log, or an empty one
        continue
try:
    r = json.load(open(os.path.join(logs, "counts.json")))
except (OSError, ValueError):
    print("attention: no results (see counts.log)")
    r = {"attention": [], "bandwidth": [], "ladder": []}
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
print("the ladder, a forward of each rung: " + ", ".join(
    f"{x['rung']} {'-' if x['fwd_ms'] is None else format(x['fwd_ms'], '.3f')} ms" for x in r["ladder"]))
for name, last in (("ddp.log", 6), ("ncu.log", 12), ("allreduce.log", 6), ("train_step_bf16.log", 13),
                   ("train_step_fp32.log", 13), ("wmt.log", 3)):
    path = os.path.join(logs, name)
    if os.path.exists(path):
        print(f"--- {name} (last lines)")
        print("\n".join(open(path).read().strip().splitlines()[-last:]))
# The stages' times, as a record: where the GPU's minutes went.
seconds = dict(t.split("=") for t in times)
gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ") if not emulated else 2
figures = {f"{name}_s": int(s) for name, s in seconds.items()} | {"total_s": int(total)}
path = os.path.join(os.environ["MT_RECORDS_DIR"], "gpu_check.jsonl")
records.append(path, "bash benchmarks/gpu_check.sh", {"device": "emulated" if emulated else "cuda", "gpus": gpus},
               figures, checkout=".")
print(f"stages' seconds: {', '.join(f'{k} {v}' for k, v in seconds.items())}; all: {total} s (recorded in {path})")
PY
if ((${#FAILED[@]})); then
    printf 'FAILED: %s\n' "${FAILED[@]}"
    exit 1
fi
