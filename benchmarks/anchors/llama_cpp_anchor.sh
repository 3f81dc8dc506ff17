#!/usr/bin/env bash
# The llama.cpp serving anchor, built and measured in the same job as benchmarks/serve_load.py (issue 18):
# llama.cpp from the source archive of llama-cpp-python (the version tests/fixtures' GGUF files were checked
# against), built for the H200 (CUDA, sm_90, flash attention), then llama-batched-bench at serve_load's shapes
# (512-token prompts, 128 new tokens, 1 / 16 / 64 sequences) on a random-weight GGUF of the same model shape in
# bf16 and in Q4_K_M (made by llama.cpp's own llama-quantize from the bf16 file). S_TG is the decode tok/s to set
# against serve_load's decode tok/s.
#
#   # here, once: the archive without its .git, docs, tests and vocab files (~11 MB; .gpu-llama/ is git-ignored)
#   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
#   tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp llama_cpp_python-0.3.36/vendor/llama.cpp
#   tar czf .gpu-llama/llama.cpp-0.3.36.tar.gz -C /tmp/lcp/llama_cpp_python-0.3.36/vendor \
#       --exclude='llama.cpp/models/*.gguf' --exclude=llama.cpp/docs --exclude=llama.cpp/tests \
#       --exclude=llama.cpp/benches --exclude=llama.cpp/media --exclude='*.git*' llama.cpp
#   # on the GPU machine (carry .gpu-llama and the gguf wheel; ~6-8 min, most of it compiling ggml-cuda):
#   bash benchmarks/anchors/llama_cpp_anchor.sh .gpu-llama/llama.cpp-0.3.36.tar.gz
#   # CPU check of the same steps (no CUDA, a tiny model): CUDA=OFF SHAPE=debug PROMPT=32 GEN=8 USERS=1,2 bash ...
set -euo pipefail
SRC=${1:?usage: llama_cpp_anchor.sh LLAMA_CPP_SOURCE.tar.gz}
WORK=${WORK:-/tmp/llama-anchor}
SHAPE=${SHAPE:-qwen3-0.6b}
USERS=${USERS:-1,16,64}
PROMPT=${PROMPT:-512}
GEN=${GEN:-128}
CUDA=${CUDA:-ON}
JOBS=${JOBS:-$(nproc)}
HERE=$(cd "$(dirname "$0")/../.." && pwd)

mkdir -p "$WORK"
[ -d "$WORK/llama.cpp" ] || tar xzf "$SRC" -C "$WORK"
t0=$(date +%s)
cmake -S "$WORK/llama.cpp" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA="$CUDA" \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF > "$WORK/cmake.log"
cmake --build "$WORK/build" --target llama-batched-bench llama-quantize -j "$JOBS" > "$WORK/build.log"
echo "# llama.cpp built in $(( $(date +%s) - t0 )) s (GGML_CUDA=$CUDA$( [ "$CUDA" = ON ] && echo ", sm_90" ))"

python3 "$HERE/benchmarks/anchors/random_gguf.py" --shape "$SHAPE" --out "$WORK/model-bf16.gguf"
"$WORK/build/bin/llama-quantize" "$WORK/model-bf16.gguf" "$WORK/model-q4_k_m.gguf" Q4_K_M > "$WORK/quantize.log" 2>&1

max_users=${USERS##*,}
ctx=$(( max_users * (PROMPT + GEN) ))
for f in bf16 q4_k_m; do
    echo "# llama-batched-bench $SHAPE $f: -npp $PROMPT -ntg $GEN -npl $USERS -c $ctx -fa on -ngl 99"
    "$WORK/build/bin/llama-batched-bench" -m "$WORK/model-$f.gguf" -c "$ctx" -b 2048 -ub 512 -npp "$PROMPT" \
        -ntg "$GEN" -npl "$USERS" -fa on -ngl 99 2> "$WORK/bench-$f.log" | grep '^|'
done
