#!/usr/bin/env bash
# GPU checks, from the repository root, on one CUDA GPU, in one call (at most 470 s of checks
# on an H200: every check has a time limit, and the deadline is their sum):
#
#   bash scripts/gpu_checks.sh            # on a GPU machine
#   bash scripts/gpu_checks.sh --cpu      # dry run on the CPU at the smallest sizes: everything
#                                         # but the CUDA-only parts
#   bash scripts/gpu_checks.sh --plan     # the checks in order with their limits, and the total
#   bash scripts/gpu_checks.sh --cpu --wiring
#                                         # the script's wiring only (tests/test_gpu_checks_script.py):
#                                         # the long pytest checks are only collected (row COLLECTED),
#                                         # te-vs-local, convert-verify and gpu-step run at their
#                                         # smallest sizes
#
# Checks, most important first (one row each in the summary table; logs and JSON in $OUT,
# default /tmp/gpu_checks). Each has its own time limit; the limits add up to the deadline, so a
# slow row never turns a later one into SKIP (`--plan` prints them and exits):
#   parity-sharded-opt   tests/test_gpu.py: world size 1, the dp-sharded optimizer (--distributed-optimizer),
#                        every metric, gradient and weight against the HF reference (fp32, TF32 off)
#   packed-thd           tests/test_packing_gpu.py: a packed row in Transformer Engine's THD layout gives each
#                        sequence its own logits (the mask path without TE); shared-prompt rows
#                        (--prefix-sharing) through TE's arbitrary-mask attention likewise
#   te-vs-local          Transformer Engine layer spec vs local spec, bf16 logits (SKIP without TE)
#   bf16-resume          CLI run in bf16 with the distributed optimizer and --deterministic: checkpoint
#                        every 2 steps, kill at step 3, rerun, steps 3-4 equal an uninterrupted run exactly
#   gpu-step             benchmarks/gpu_step.py: ~1.2B Llama, bf16, reference interleaved;
#                        MFU counts 8N flops per token (policy forward+backward 6N + reference 2N)
#   parity-unfused       parity-sharded-opt with --no-fused-kernels (the fusions on, above, against them off)
#   te-grouped-gemm      Qwen3-MoE: grouped GEMM experts (TEGroupedMLP) vs sequential experts on the TE
#                        spec, the shard loads, bf16 logits and gradients (SKIP without TE)
#   parity-adamw         the same parity with the replicated AdamW (--no-distributed-optimizer)
#   convert-verify       checkpoint_convert hf-to-mcore + verify on the embedded default model
# Exit code: 0 when every check passed (or, with --wiring, was collected) or was skipped for want
# of Transformer Engine; 1 when one failed or did not run before the deadline; 2 on a bad argument.
set -u
cd "$(dirname "$0")/.."

# NAME|LIMIT_S, in the order they run: the most important first.
PLAN=(
  "parity-sharded-opt|75"
  "packed-thd|50"
  "te-vs-local|45"
  "bf16-resume|100"
  "gpu-step|70"
  "parity-unfused|35"
  "te-grouped-gemm|35"
  "parity-adamw|35"
  "convert-verify|25"
)
PLAN_TOTAL_S=0
for row in "${PLAN[@]}"; do PLAN_TOTAL_S=$((PLAN_TOTAL_S + ${row#*|})); done

MODE=gpu
WIRING=0
for arg in "$@"; do
  case "$arg" in
    --cpu) MODE=cpu ;;
    --wiring) WIRING=1 ;;
    --plan) printf '%s\n' "${PLAN[@]}"; echo "total|$PLAN_TOTAL_S"; exit 0 ;;
    *) echo "gpu_checks.sh: unknown argument '$arg' (use --cpu, --cpu --wiring, --plan or nothing)" >&2; exit 2 ;;
  esac
done
if [ "$WIRING" = 1 ] && [ "$MODE" != cpu ]; then
  echo "gpu_checks.sh: --wiring is a CPU dry run; use it with --cpu" >&2
  exit 2
fi
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export MCORE_DPO_CACHE="$OUT/cache"
PY=${PYTHON:-python3}
LIMIT_SCALE=1
START=$(date +%s)
STEP_ARGS=(--model-dir "$OUT/llama_1b")  # written once with random weights, reused by a rerun
if [ "$MODE" = cpu ]; then
  export MCORE_DPO_FORCE_CPU=1 MCORE_DPO_GPU_CHECKS_ON_CPU=1 OMP_NUM_THREADS=1
  STEP_ARGS=(--tiny)
  [ "$WIRING" = 1 ] && STEP_ARGS=(--tiny --steps 1 --warmup-steps 1)
  LIMIT_SCALE=${CPU_LIMIT_SCALE:-8}  # a shared 2-core box runs these far slower than a GPU
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
fi
# The deadline is the limits' sum (by construction); a smaller DEADLINE_S is refused up front.
DEADLINE_S=${DEADLINE_S:-$((PLAN_TOTAL_S * LIMIT_SCALE))}
if [ "$DEADLINE_S" -lt $((PLAN_TOTAL_S * LIMIT_SCALE)) ]; then
  echo "gpu_checks.sh: DEADLINE_S=$DEADLINE_S is below the checks' limits, $((PLAN_TOTAL_S * LIMIT_SCALE)) s in all" >&2
  exit 2
fi
$PY -c "import torch, megatron.core, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'mcore', megatron.core.__version__, 'transformers', transformers.__version__)" > "$OUT/versions.txt" 2> "$OUT/versions.err"

ROWS=()
FAILED=0

limit_of() {  # NAME: its limit in PLAN
  local row
  for row in "${PLAN[@]}"; do [ "${row%|*}" = "$1" ] && { echo "${row#*|}"; return; }; done
  echo "gpu_checks.sh: no limit for $1 in PLAN" >&2; exit 2
}

# run_check NAME DETAIL_CMD -- COMMAND...: runs COMMAND with its output in $OUT/NAME.log, within NAME's limit.
run_check() {
  local name=$1 limit=$(($(limit_of "$1") * LIMIT_SCALE)) detail_cmd=$2
  shift 3
  local left=$((DEADLINE_S - ($(date +%s) - START)))
  if [ "$left" -lt 20 ]; then
    ROWS+=("$name|SKIP|0|not run: no time left before the ${DEADLINE_S}s deadline")
    FAILED=1  # a check that did not run is not a pass
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0 status detail rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && [ "${COLLECT_ONLY:-0}" = 1 ]; then
    status=COLLECTED  # --wiring: collected, not run
  elif [ $rc -eq 0 ]; then
    status=PASS
    grep -q "skipped" "$OUT/$name.log" && ! grep -qE "[0-9]+ passed" "$OUT/$name.log" && status=SKIP
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    status=FAIL; FAILED=1
  else
    status=FAIL; FAILED=1
  fi
  detail=$(eval "$detail_cmd" 2>/dev/null | tr '|\n' '/ ' | cut -c1-110)
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && detail="timed out after ${limit}s; $detail"
  ROWS+=("$name|$status|$(($(date +%s) - t0))|$detail")
}

pytest_summary() {  # the last summary line of a pytest log, and a skip reason if any
  grep -E "^(SKIPPED|FAILED|ERROR)" "$OUT/$1.log" | head -2
  grep -E "[0-9]+ (passed|failed|skipped|error)" "$OUT/$1.log" | tail -1
}

PYTEST=($PY -m pytest -q -p no:cacheprovider -rs)
GPU_TESTS=(tests/test_gpu.py tests/test_packing_gpu.py)
# pytest_check NAME TEST_ID: one GPU test, by its node id. --wiring lists the long ones instead of
# running them on the CPU (their code paths run in the CPU suite: tests/test_parity.py,
# tests/test_sharded_optimizer.py, tests/test_resume.py, tests/test_train_cli.py,
# tests/test_packing_parity.py): the row is COLLECTED when pytest collects that node id.
if [ "$WIRING" = 1 ]; then
  "${PYTEST[@]}" --collect-only "${GPU_TESTS[@]}" > "$OUT/collected.txt" 2>&1
fi
pytest_check() {
  local name=$1 test_id=$2
  if [ "$WIRING" = 1 ] && [ "$name" != te-vs-local ]; then
    COLLECT_ONLY=1 run_check "$name" "echo $test_id" -- grep -qxF "$test_id" "$OUT/collected.txt"
  else
    run_check "$name" "pytest_summary $name" -- "${PYTEST[@]}" "$test_id"
  fi
}

convert_verify() {
  local hf
  hf=$($PY -c "from mcore_dpo.driver.defaults import ensure_default_model; print(ensure_default_model())") || return 1
  rm -rf "$OUT/convert_mcore"
  $PY -m checkpoint_convert hf-to-mcore --hf-dir "$hf" --out "$OUT/convert_mcore" --tp 1 --pp 1 || return 1
  $PY -m checkpoint_convert verify --hf-dir "$hf" --mcore-dir "$OUT/convert_mcore"
}

step_detail() {
  $PY - "$OUT/gpu_step.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
mfu = r["mfu"].get("dense")
print(f"{r['device_name']} {r['layer_spec']} {r['dtype']}: {r['step_time_s']['median']:.3f} s/step, "
      f"{r['tokens_per_s_per_device']:.0f} tok/s/dev, MFU(8N) " + (f"{mfu:.1%}" if mfu is not None else "n/a"))
EOF
}

for row in "${PLAN[@]}"; do
  case "${row%|*}" in
    parity-sharded-opt) pytest_check parity-sharded-opt "tests/test_gpu.py::test_parity_on_gpu[sharded-optimizer]" ;;
    packed-thd) pytest_check packed-thd "tests/test_packing_gpu.py::test_packed_row_gives_each_sequence_its_own_logits" ;;
    te-vs-local) pytest_check te-vs-local "tests/test_gpu.py::test_transformer_engine_spec_matches_local_spec" ;;
    bf16-resume) pytest_check bf16-resume "tests/test_gpu.py::test_bf16_checkpoint_and_exact_resume_through_cli[deterministic]" ;;
    gpu-step)
      rm -f "$OUT/gpu_step.json"
      run_check gpu-step step_detail -- $PY benchmarks/gpu_step.py --out "$OUT/gpu_step.json" "${STEP_ARGS[@]}" ;;
    te-grouped-gemm) pytest_check te-grouped-gemm "tests/test_gpu.py::test_grouped_gemm_experts_match_sequential_experts" ;;
    parity-adamw) pytest_check parity-adamw "tests/test_gpu.py::test_parity_on_gpu[adamw]" ;;
    parity-unfused) pytest_check parity-unfused "tests/test_gpu.py::test_parity_on_gpu[unfused]" ;;
    convert-verify)
      run_check convert-verify "grep -E '^verify' $OUT/convert-verify.log | tail -1" -- \
        bash -c "$(declare -f convert_verify); PY='$PY' OUT='$OUT' convert_verify" ;;
  esac
done

{
  echo "GPU checks ($MODE mode$([ "$WIRING" = 1 ] && echo ", wiring only")), $(head -1 "$OUT/versions.txt"), total $(($(date +%s) - START)) s"
  printf '| %-20s | %-6s | %7s | %s\n' check status seconds detail
  printf '|%s|%s|%s|%s\n' "----------------------" "--------" "---------" "------"
  for row in "${ROWS[@]}"; do
    IFS='|' read -r name status secs detail <<< "$row"
    printf '| %-20s | %-6s | %7s | %s\n' "$name" "$status" "$secs" "$detail"
  done
} | tee "$OUT/summary.md"
exit $FAILED
