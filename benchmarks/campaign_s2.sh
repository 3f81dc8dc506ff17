#!/usr/bin/env bash
# The GPU campaign of 2026-11-29 session 2 (figures copied into benchmarks/RESULTS.md). PARTS picks the items:
#   kern q8 off off2 serve q70 u8   (see the case below); needs .gpu-wheels carried for the serve item.
source "$(dirname "$0")/campaign_common.sh"
B8="python3 -m surojax.cli.main bench train --shape qwen3-8b --mode lora --batch 4 --seq 2048 --steps 5 --repeats 1"
for part in ${PARTS:-kern q8 off}; do case $part in
kern) item quant_matmul 170 python3 benchmarks/quant_matmul_h200.py --formats ${QFORMATS:-q4_k,nf4,q8_0,fp8} ;;
q8) item q8b-bf16 110 $B8
    SUROJAX_QUANT_MATMUL=${QMODE:-auto} item q8b-q4_k 110 $B8 --quant q4_k
    SUROJAX_QUANT_MATMUL=${QMODE:-auto} item q8b-nf4 110 $B8 --quant nf4 ;;
off) item offload-llama8b 200 python3 benchmarks/offload_h200.py --only llama8b-resident,llama8b-streamed --timeout 95 ;;
off2) item offload-big 330 python3 benchmarks/offload_h200.py --only ${OFF2:-qwen32b-streamed,llama70b-q4-streamed,qwen8b-full-offload-opt} --timeout 150 ;;
serve) item serve 240 python3 benchmarks/serve_load.py --modes ${SMODES:-engine,server,hf} --users ${SUSERS:-1,16,64} ;;
q70) item q70b-q4_k ${T70:-190} python3 -m surojax.cli.main bench train --shape llama3-70b --mode lora --quant q4_k --batch 4 --seq 2048 --recompute full --steps 3 --repeats 1 --warmup 1 ;;
u8) item q8b-unroll ${TU8:-240} $B8 --unroll-layers all ;;
esac; done
echo "== done in $(( $(date +%s) - START ))s"
for f in "$OUT"/*.out; do echo "--- $f"; tail -25 "$f" | cut -c1-250; done
