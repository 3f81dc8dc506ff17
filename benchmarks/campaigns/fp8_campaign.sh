#!/usr/bin/env bash
# Issue 19's queued H200 rows (benchmarks/RESULTS.md, "Queued"), in two parts that each fit one 10-minute call.
# Run from the repository root on the GPU machine, with the wheels the image lacks carried along:
#
#     ../shared/tools/gpu-wheels.sh .gpu-wheels                       # here, once (git-ignored)
#     pip download --no-deps -d .gpu-wheels llguidance==1.9.1          # (a manylinux_2_31 wheel the script misses)
#     run(command="bash benchmarks/campaigns/fp8_campaign.sh 1", carry=[".gpu-wheels"])     # ~8 min
#     run(command="bash benchmarks/campaigns/fp8_campaign.sh 2", carry=[".gpu-wheels"])     # ~8 min
#     run(command="bash benchmarks/campaigns/fp8_campaign.sh 3", carry=[".gpu-wheels"])     # ~5 min
#     run(command="bash benchmarks/campaigns/fp8_campaign.sh pt", carry=[".gpu-wheels"])    # ~7 min; full, lora likewise
#
# part 1   the FP8 op check with the power-of-two scales (expected: 0 operand values differ from the eager ones,
#          error within 0.6%); Qwen3-8B full fine-tuning: bf16, fp8-current, fp8-delayed (the delayed step
#          without conditionals; split accumulation); fp8-delayed with SUROJAX_FP8_WGRAD=weight (A/B)
# part 2   Llama-3-8B pretraining shapes: bf16, fp8-current, fp8-delayed; the 8-bit AdamW kernel's tile sweep; the
#          fp32 wgrad A/B again with XLA's dynamic-slice fusion on
# part 3   Qwen3-8B LoRA: bf16, fp8-delayed; the 8B full fp8-delayed step with the casts as XLA ops (fusable into
#          their producers) instead of the Pallas pass
# pt       Llama-3-8B pretraining shapes: bf16 and fp8-delayed (the default scaling) in one call
# full     Qwen3-8B full fine-tuning: bf16 and fp8-delayed in one call
# lora     the op check; Qwen3-8B LoRA: bf16 and fp8-delayed in one call
# rest     issue 19's remainder: the op check (forward and backward GEMMs; the step census on the debug shape);
#          Qwen3-8B full fp8-delayed with the Pallas casts and with SUROJAX_FP8_CAST=xla (may XLA fuse the casts
#          into their producers now that delayed scaling knows the scale ahead?), in one call
#
# Each command's output goes to $OUT/<name>.log (the device tool sets $OUT); fp8_h200.py's JSON lines to
# $OUT/fp8_h200.jsonl; the tables are printed at the end. SMOKE=1: the same plumbing on a CPU, debug shapes
# (PYTHON: the interpreter, default python3; e.g. PYTHON=.venv/bin/python here).
set -uo pipefail
cd "$(dirname "$0")/../.."
PART=${1:?part 1, 2 or 3}
OUT=${OUT:-/tmp/fp8-campaign}
mkdir -p "$OUT"
if [ -z "${SMOKE:-}" ]; then
  if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-deps --no-index .gpu-wheels/*.whl 2>&1 | tail -2
  fi
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
  export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true${XLA_FLAGS:+ $XLA_FLAGS}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  STEPS="--steps 3 --warmup 1 --repeats 2"
  CHECK="--shape qwen3-0.6b --mode lora --no-step-time --forms direct,direct+fp32"
  SMOKE_ARG=""
else
  export JAX_PLATFORMS=cpu
  STEPS=""
  CHECK="--smoke"
  SMOKE_ARG="--smoke"
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
PY=${PYTHON:-python3}
echo "tree $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ) part $PART"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, keep going on failure
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -h '^{"bench": "fp8_h200"' "$OUT/$name.log" >> "$OUT/fp8_h200.jsonl" 2>/dev/null
  echo "== $name: rc $rc, $((SECONDS - t0)) s"
  tail -n 14 "$OUT/$name.log"
}

case $PART in
  1)
    step op_check 150 "$PY" benchmarks/fp8_gemm_check.py $CHECK
    step qwen3_8b_full 330 "$PY" benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-full \
      --variants bf16 fp8-current fp8-delayed $STEPS $SMOKE_ARG
    # (fp8-current: the delayed GEMMs do not read SUROJAX_FP8_WGRAD)
    SUROJAX_FP8_WGRAD=weight step wgrad_weight 200 "$PY" benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-full \
      --variants fp8-current $STEPS $SMOKE_ARG
    ;;
  2)
    step llama3_8b_pt 330 "$PY" benchmarks/campaigns/fp8_h200.py --workloads llama3-8b-pt \
      --variants bf16 fp8-current fp8-delayed $STEPS $SMOKE_ARG
    step adam8bit_tiles 150 "$PY" benchmarks/adam8bit_h200.py $SMOKE_ARG
    # the wgrad GEMM writing fp32 straight into the scan's stacked gradient (XLA's dynamic-slice fusion lets a
    # cuBLAS call write into a dynamic-update-slice of its result)
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" SUROJAX_FP8_WGRAD=weight \
      step wgrad_weight_dsf 200 "$PY" benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-full --variants fp8-current \
      $STEPS $SMOKE_ARG
    ;;
  3)
    step qwen3_8b_lora 300 "$PY" benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-lora --variants bf16 fp8-delayed \
      $STEPS $SMOKE_ARG
    # the casts as XLA ops: with delayed scaling the scale is known before the tensor exists, so XLA may fuse
    # convert(clip(x * s)) into the norm / SwiGLU / backward producer (no bf16 write and re-read) where the Pallas
    # cast is a pass of its own
    SUROJAX_FP8_CAST=xla step cast_xla 120 "$PY" benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-full \
      --variants fp8-delayed $STEPS $SMOKE_ARG
    ;;
  pt)
    step llama3_8b_pt 540 "$PY" benchmarks/campaigns/fp8_h200.py --workloads llama3-8b-pt --variants bf16 fp8-delayed \
      $STEPS $SMOKE_ARG
    ;;
  full)
    step qwen3_8b_full 540 "$PY" benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-full --variants bf16 fp8-delayed \
      $STEPS $SMOKE_ARG
    ;;
  lora)
    step op_check 150 "$PY" benchmarks/fp8_gemm_check.py $CHECK
    step qwen3_8b_lora 400 "$PY" benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-lora --variants bf16 fp8-delayed \
      $STEPS $SMOKE_ARG
    ;;
  rest)
    step op_check 120 "$PY" benchmarks/fp8_gemm_check.py ${SMOKE_ARG:---shape debug --mode lora --no-step-time \
      --forms direct,direct+fp32 --iters 5}
    step cast_pallas 230 "$PY" benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-full --variants fp8-delayed \
      $STEPS $SMOKE_ARG
    SUROJAX_FP8_CAST=xla step cast_xla 230 "$PY" benchmarks/campaigns/fp8_h200.py --workloads qwen3-8b-full \
      --variants fp8-delayed $STEPS $SMOKE_ARG
    ;;
  *) echo "part $PART: expected 1, 2, 3, pt, full, lora or rest"; exit 2 ;;
esac
