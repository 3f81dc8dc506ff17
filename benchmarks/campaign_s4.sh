#!/usr/bin/env bash
# The GPU campaign of 2026-11-29 session 4 (figures copied into benchmarks/RESULTS.md). PARTS picks the items
# (see the case below); carry .gpu-wheels (the serve items need fastapi there).
source "$(dirname "$0")/campaign_common.sh"
# variant NAME PATCH [-R] -- CMD...: CMD in a copy of this checkout with benchmarks/variants/PATCH applied
# (an A/B of a code change in one job, no knob in the code)
variant() { local name=$1 patch=$2; shift 2; local rev=""; [ "$1" = "-R" ] && { rev="-R"; shift; }; shift;
  local dir=/tmp/v-$name; rm -rf "$dir"; mkdir -p "$dir"; cp -r surojax benchmarks pyproject.toml "$dir"/;
  (cd "$dir" && git apply $rev "benchmarks/variants/$patch" && PYTHONPATH=$dir item "$name" 240 "$@"); }
B06="python3 -m surojax.cli.main bench train --shape qwen3-0.6b --batch 8 --seq 2048 --steps 5 --repeats 1"
for part in ${PARTS:-prof corrbf16 hffull full fp8}; do case $part in
prof) item profile-lora-unrolled ${TPR:-300} python3 benchmarks/profile_step.py --shape qwen3-0.6b --mode lora \
        --unroll-layers all ${PROFARGS:-} ;;
corrbf16) item correctness-lora-bf16 ${TC:-200} python3 benchmarks/gpu_correctness.py --skip-timing --skip-attention \
        --modes lora --recipes bf16 --unroll-layers all ;;
hflora) item hf-lora 150 python3 benchmarks/anchors/hf_peft_baseline.py --mode lora --batch 8 --seq 2048 ;;
lora8b) item lora-8b-unroll ${T8:-330} python3 -m surojax.cli.main bench train --shape qwen3-8b --mode lora --batch 4 \
        --seq 2048 --steps 5 --repeats 1 --unroll-layers all ;;
hffull) item hf-full 150 python3 benchmarks/anchors/hf_peft_baseline.py --mode full --batch 8 --seq 2048 ;;
full) item full-unroll 240 $B06 --mode full --unroll-layers all ;;
lora) item lora-unroll 240 $B06 --mode lora --unroll-layers all ${LORAARGS:-} ;;
loranc) item lora-unroll-nocheck 240 $B06 --mode lora --unroll-layers all --attention cudnn:16:nocheck ;;
fp8) item fp8 ${TF:-300} python3 benchmarks/fp8_gemm_check.py --shape qwen3-0.6b --mode lora ;;
dcheck) item decode-check ${TDC:-200} python3 benchmarks/decode_step_h200.py --rows 1,64 --check-only ;;
dtime) item decode-time ${TDT:-200} python3 benchmarks/decode_step_h200.py --rows ${DROWS:-1,64} --no-check \
        --variants ${DVAR:-multi-rolled,multi-paged-rolled,multi-pallas-rolled} ${DARGS:-} ;;
master) item offload-master ${TM:-300} python3 benchmarks/offload_h200.py --only qwen8b-full-offload-opt-master \
        --timeout 280 ;;
trace) item offload-trace ${TT:-300} python3 benchmarks/profile_step.py --shape llama3-8b --mode lora --batch 4 \
        --recompute full --lmhead-chunks 16 --offload-base --init host --prefetch --steps 1 ;;
servep) item serve-paged ${TSP:-120} python3 benchmarks/serve_load.py --modes engine --users ${SUSERS:-1,16,64} \
         --decode-steps 8 --paged-kernel ${SPK:-pallas} ${SARGS:-} ;;
servep16) item serve-paged-pps16 ${TSP:-120} python3 benchmarks/serve_load.py --modes engine \
         --users ${SUSERS:-1,16,64} --decode-steps 8 --paged-kernel ${SPK:-pallas} --prefills-per-step 16 ;;
vlora) variant lora-scatter ce_compare.patch -R -- $B06 --mode lora --unroll-layers all
       variant lora-bf16logits ce_bf16_logits.patch -- $B06 --mode lora --unroll-layers all ;;
vfull) variant full-scatter ce_compare.patch -R -- $B06 --mode full --unroll-layers all
       variant full-bf16logits ce_bf16_logits.patch -- $B06 --mode full --unroll-layers all ;;
dnosr) XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_dot_strength_reduction=false" item decode-nosr ${TDN:-150} \
         python3 benchmarks/decode_step_h200.py --rows 1,64 --no-check --variants multi-pallas-rolled --tag nosr --profile ;;
hostcopy) item host-copy-overlap ${THC:-200} python3 benchmarks/host_copy_overlap.py --profile ${HCARGS:-} ;;
servefull) item serve-full ${TSF:-260} python3 benchmarks/serve_load.py --modes hf,engine,server --users ${SUSERS:-1,16,64} \
         --decode-steps 8 ;;
sweep) item paged-decode-sweep ${TSW:-200} python3 benchmarks/paged_decode_sweep.py ${SWARGS:-} ;;
offpl) item offload-perlayer ${TOP:-330} python3 benchmarks/offload_h200.py --only \
         ${OFFPL:-llama8b-resident-b4,llama8b-resident-b4-twin,llama8b-streamed-b4-prefetch} --timeout ${TOPI:-160} ;;
offex) item offload-exact-perlayer ${TOE:-200} python3 benchmarks/offload_h200.py --only \
         exact-resident-twin,exact-streamed-prefetch --timeout 120 ;;
esac; done
echo "== done in $(( $(date +%s) - START ))s"
for f in "$ITEMS_DIR"/*.out; do echo "--- $f"; tail -${TAILN:-30} "$f" | cut -c1-250; done
