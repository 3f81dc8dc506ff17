#!/usr/bin/env bash
# The GPU campaign of 2026-11-29 session 3 (figures copied into benchmarks/RESULTS.md). PARTS picks the items
# (see the case below); carry .gpu-wheels (the serve items need fastapi there).
source "$(dirname "$0")/campaign_common.sh"
B06="python3 -m surojax.cli.main bench train --shape qwen3-0.6b --batch 8 --seq 2048 --steps 5 --repeats 1"
for part in ${PARTS:-corr kern serve}; do case $part in
corr) item correctness ${TC:-200} python3 benchmarks/gpu_correctness.py --skip-timing --unroll-layers all ;;
corrlora) item correctness-lora ${TC:-200} python3 benchmarks/gpu_correctness.py --skip-timing --skip-attention --modes lora --unroll-layers all ;;
decode) item decode ${TD:-200} python3 benchmarks/decode_step_h200.py --rows ${DROWS:-1,64} --profile ;;
decodecb) XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" item decode-cmdbuf ${TDC:-100} \
            python3 benchmarks/decode_step_h200.py --rows ${DROWS:-1,64} --variants single-rolled,multi-rolled --tag cmdbuf ;;
rows) item decode-rows ${TR:-90} python3 benchmarks/decode_step_h200.py --rows ${DROWS:-1,2,4} --variants multi-rolled,single-rolled --tag rows ;;
paged) item decode-paged ${TPG:-100} python3 benchmarks/decode_step_h200.py --rows ${DROWS:-1,64} \
         --variants ${DVAR:-multi-rolled,multi-paged-rolled,multi-reduce-rolled,multi-pallas-rolled} ;;
servep) item serve-paged ${TSP:-90} python3 benchmarks/serve_load.py --modes engine --users ${SUSERS:-1,16,64} \
         --decode-steps 8 --paged-kernel ${SPK:-pallas} ;;
exact) item offload-exact ${TE:-130} python3 benchmarks/offload_h200.py --only exact-resident,exact-streamed --timeout 70 ;;
fp8) item fp8 ${TF:-300} python3 benchmarks/fp8_gemm_check.py --shape qwen3-0.6b --mode lora ${FP8FORMS:+--forms $FP8FORMS} ;;
kern) item quant_matmul 130 python3 benchmarks/quant_matmul_h200.py --formats ${QFORMATS:-q5_k,q6_k,nvfp4} ;;
serve) item serve ${TS:-240} python3 benchmarks/serve_load.py --modes ${SMODES:-engine} --users ${SUSERS:-1,64} \
         --decode-steps ${SK:-1,8} --kv-in-place ${SKV:-0,1} ;;
prefetch) item offload-prefetch ${TP:-200} python3 benchmarks/offload_h200.py --only ${POFF:-llama8b-resident-b4,llama8b-streamed-b4,llama8b-streamed-b4-prefetch} --timeout 150 ;;
off2) item offload-big ${TO:-400} python3 benchmarks/offload_h200.py --only ${OFF2:-qwen32b-streamed,qwen8b-full-offload-opt} --timeout ${TOI:-190} ;;
hffull) item hf-full 150 python3 benchmarks/anchors/hf_peft_baseline.py --mode full --batch 8 --seq 2048 ;;
full) item full-unroll 240 $B06 --mode full --unroll-layers all ;;
lora) item lora-unroll 240 $B06 --mode lora --unroll-layers all ;;
esac; done
echo "== done in $(( $(date +%s) - START ))s"
for f in "$OUT"/*.out; do echo "--- $f"; tail -25 "$f" | cut -c1-250; done
