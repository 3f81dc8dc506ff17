#!/usr/bin/env bash
# The llama.cpp serving anchor, built and measured in the same job as benchmarks/serve_load.py (issue 18):
# llama.cpp from the source archive of llama-cpp-python (the version tests/fixtures' GGUF files were checked
# against), built for the H200 (CUDA, sm_90, flash attention), then llama-batched-bench at serve_load's shapes
# (512-token prompts, 128 new tokens, 1 / 16 / 64 sequences) on a random-weight GGUF of the same model shape in
# bf16 and in Q4_K_M (made by llama.cpp's own llama-quantize from the bf16 file). S_TG is the decode tok/s to set
# against serve_load's decode tok/s. One llama-batched-bench per user count (-c = users x (prompt + new tokens)).
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
#   # a llama.cpp already built (its bin/ has llama-batched-bench and llama-quantize): no archive, no build
#   BUILD=/tmp/gm/lcpp/build SHAPE=debug-lfm2 PROMPT=32 GEN=8 USERS=1,2 bash benchmarks/anchors/llama_cpp_anchor.sh
# SHAPE: any surojax.bench.shapes name our GGUF writer writes for llama.cpp (qwen3, llama, qwen3.5 -> qwen35,
# gemma3_text -> gemma3, lfm2 -> lfm2: gemma3-1b, lfm2-1.2b, qwen3.5-0.8b, ...; CPU-sized debug, debug-gemma3,
# debug-lfm2). Several shapes in one call share the build: SHAPE=gemma3-1b,lfm2-1.2b. SHAPE=none: build only (in
# the background of another job; a later call passes BUILD=$WORK/build).
# TYPES: the file types benched (default "bf16,q4_k_m": the bf16 file, then llama-quantize's Q4_K_M of it). A list
# without bf16 (TYPES=q4_k_m) has our GGUF writer write each type directly (its Q4_K_M mix follows llama-quantize's
# rule, surojax/quant/quantize_mix.py) with random codes (random_gguf.py: speed does not depend on the values): for
# shapes whose bf16 file would not fit the disk (qwen3-30b-a3b: 61 GB).
set -euo pipefail
BUILD=${BUILD:-}
SRC=${1:-}
[ -n "$BUILD" ] || [ -n "$SRC" ] || { echo "usage: llama_cpp_anchor.sh LLAMA_CPP_SOURCE.tar.gz (or BUILD=DIR)" >&2; exit 2; }
WORK=${WORK:-/tmp/llama-anchor}
SHAPE=${SHAPE:-qwen3-0.6b}
USERS=${USERS:-1,16,64}
TYPES=${TYPES:-bf16,q4_k_m}
PROMPT=${PROMPT:-512}
GEN=${GEN:-128}
CUDA=${CUDA:-ON}
JOBS=${JOBS:-$(nproc)}
HERE=$(cd "$(dirname "$0")/../.." && pwd)

mkdir -p "$WORK"
if [ -z "$BUILD" ]; then
    BUILD="$WORK/build"
    [ -d "$WORK/llama.cpp" ] || tar xzf "$SRC" -C "$WORK"
    t0=$(date +%s)
    cmake -S "$WORK/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA="$CUDA" \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF > "$WORK/cmake.log"
    cmake --build "$BUILD" --target llama-batched-bench llama-quantize -j "$JOBS" > "$WORK/build.log"
    echo "# llama.cpp built in $(( $(date +%s) - t0 )) s (GGML_CUDA=$CUDA$( [ "$CUDA" = ON ] && echo ", sm_90" ))"
else
    echo "# llama.cpp prebuilt: $BUILD/bin"
fi
for tool in llama-batched-bench llama-quantize; do
    [ -x "$BUILD/bin/$tool" ] || { echo "llama_cpp_anchor: $BUILD/bin/$tool is missing" >&2; exit 2; }
done
[ "$SHAPE" = none ] && exit 0

# one llama-batched-bench per user count: its table rows go through llama.cpp's asynchronous log, which a process
# exiting right after its last row sometimes loses (CPU build: rc 0 and no row in 2 of 6 runs of one case), so a
# count whose row is missing is run again, up to 4 times
bench_row() {  # model users -> the table's data row for that many users
    local out
    for attempt in 1 2 3 4; do
        out=$("$BUILD/bin/llama-batched-bench" -m "$1" -c $(( $2 * (PROMPT + GEN) )) -b 2048 -ub 512 -npp "$PROMPT" \
            -ntg "$GEN" -npl "$2" -fa on -ngl 99 2>> "$WORK/bench.log" | grep -E '^\| +[0-9]' || true)
        [ -n "$out" ] && { echo "$out"; return 0; }
        echo "# (no row for $2 users, attempt $attempt)" >&2
    done
    return 1
}
for shape in ${SHAPE//,/ }; do
    case ",$TYPES," in
        *,bf16,*)
            python3 "$HERE/benchmarks/anchors/random_gguf.py" --shape "$shape" --out "$WORK/$shape-bf16.gguf"
            for f in ${TYPES//,/ }; do
                [ "$f" = bf16 ] || "$BUILD/bin/llama-quantize" "$WORK/$shape-bf16.gguf" "$WORK/$shape-$f.gguf" \
                    "${f^^}" > "$WORK/quantize.log" 2>&1
            done ;;
        *)
            for f in ${TYPES//,/ }; do
                python3 "$HERE/benchmarks/anchors/random_gguf.py" --shape "$shape" --file-type "$f" \
                    --out "$WORK/$shape-$f.gguf"
            done ;;
    esac
    for f in ${TYPES//,/ }; do
        echo "# llama-batched-bench $shape $f: -npp $PROMPT -ntg $GEN -npl N -c N x $(( PROMPT + GEN )) -fa on -ngl 99, N in $USERS"
        echo "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
        for n in ${USERS//,/ }; do
            bench_row "$WORK/$shape-$f.gguf" "$n" || echo "# llama-batched-bench $shape $f: no row for $n users ($WORK/bench.log)"
        done
    done
    for f in ${TYPES//,/ }; do rm -f "$WORK/$shape-$f.gguf"; done  # GBs each at the real shapes
done
