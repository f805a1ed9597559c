#!/usr/bin/env bash
# One command for a fresh GPU machine: build minitransformer._C, run the GPU tests and the
# benchmarks in about 8 minutes, and print a short table last.
#
#     bash benchmarks/gpu_check.sh            logs and bench.json go to $OUT (or a temp dir)
#
# The machine is assumed to have Python with CuPy, pybind11, numpy, pytest and hypothesis
# installed and no package registry: the build uses them as they are.
set -u -o pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$(mktemp -d)}
mkdir -p "$LOGS"
echo "logs: $LOGS"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)  date: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || true
echo "nvcc: $(command -v nvcc || echo 'not on PATH') CUDA_HOME=${CUDA_HOME:-unset}"

# Build only for this GPU's architecture (CI builds sm_80, sm_90 and PTX): half the compile time.
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
export MINITRANSFORMER_CUDA_ARCHS=${MINITRANSFORMER_CUDA_ARCHS:-${cap:-90}}
start=$SECONDS
if ! python -m pip install --no-build-isolation --no-deps -e . >"$LOGS/build.log" 2>&1; then
    tail -n 60 "$LOGS/build.log"
    echo "BUILD FAILED"
    exit 1
fi
echo "build: $((SECONDS - start)) s (sm_$MINITRANSFORMER_CUDA_ARCHS)"
python -c "import minitransformer.kernels as K; assert K.available(), K.unavailable_reason(); print('kernels available')" || exit 1
python -c "import hypothesis, pytest" 2>/dev/null || echo "WARNING: pytest/hypothesis missing; GPU tests cannot run"

start=$SECONDS
timeout 200 python -m pytest -q -p no:cacheprovider --hypothesis-profile=gpu_check --ignore=tests/kernels/test_emulated_kernels.py tests/kernels >"$LOGS/tests.log" 2>&1
tests_rc=$?
echo "tests: $((SECONDS - start)) s, exit $tests_rc"
grep -E "^(FAILED|ERROR)" "$LOGS/tests.log" | head -n 20

start=$SECONDS
timeout 220 python benchmarks/attn.py --quick --json "$LOGS/bench.json" >"$LOGS/bench.log" 2>&1
bench_rc=$?
echo "benchmarks: $((SECONDS - start)) s, exit $bench_rc"
[ $bench_rc -ne 0 ] && tail -n 30 "$LOGS/bench.log"

# The NCCL path end to end (one rank: NCCL refuses two ranks on one GPU), its bus bandwidth,
# and a whole training step of the model on the GPU next to torch.nn.Transformer.
start=$SECONDS
timeout 60 python -m pytest -q -p no:cacheprovider tests/distributed/test_nccl.py >"$LOGS/nccl.log" 2>&1
echo "nccl tests: $((SECONDS - start)) s, exit $? ($(tail -n 1 "$LOGS/nccl.log"))"
timeout 60 python benchmarks/allreduce.py --device cuda --max-bytes 256M >"$LOGS/allreduce.log" 2>&1 \
    || tail -n 20 "$LOGS/allreduce.log"
timeout 120 python benchmarks/train_step.py --device cuda --batch 128 --len 32 --steps 10 >"$LOGS/train_step.log" 2>&1 \
    || tail -n 20 "$LOGS/train_step.log"

python - "$LOGS" "$tests_rc" <<'PY'
import json, os, re, sys
logs, tests_rc = sys.argv[1], int(sys.argv[2])
summary = open(os.path.join(logs, "tests.log")).read().strip().splitlines()
print("\n================ gpu_check summary ================")
print("tests:", summary[-1] if summary else "no output", "" if tests_rc == 0 else f"(exit {tests_rc})")
try:
    r = json.load(open(os.path.join(logs, "bench.json")))
except (OSError, ValueError):
    print("benchmarks: no results (see bench.log)")
    sys.exit(0)
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
for name in ("allreduce.log", "train_step.log"):
    path = os.path.join(logs, name)
    if os.path.exists(path):
        print(f"--- {name} (last lines)")
        print("\n".join(open(path).read().strip().splitlines()[-6:]))
PY
