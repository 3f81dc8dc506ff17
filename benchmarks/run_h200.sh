#!/usr/bin/env bash
# One GPU job (fits one 10-minute call): correctness, the surojax training benchmarks, the HF anchors in the
# same job, then one table (ours vs anchor, ratio, MFU, peak GiB). Run from anywhere:
#
#     bash benchmarks/run_h200.sh
#
# Environment (all optional):
#   ITEMS       which items, in order (default below). Names: correctness attn-timing lora hf-lora full
#               hf-full qwen3-8b llama3-8b lora-1seg variants
#   VARIANTS    one variant per line, "name | extra bench args | extra XLA flags"; each runs qwen3-0.6b LoRA b8
#               with the base args + its own (later args win). Default: $DEFAULT_VARIANTS below. Runs only
#               when ITEMS contains `variants`.
#   XLA_FLAGS_BASE   XLA flags for every JAX item (default: latency-hiding scheduler on)
#   BENCH_ARGS  extra args for every surojax bench item (e.g. "--recompute dots")
#   BUDGET_S    seconds for the whole job (default 570); an item that would start later than
#               BUDGET_S - its reserve is skipped (and says so), a running one is cut at the budget
#   OUT         where results.jsonl and logs/ go (default /tmp/surojax-bench; the device tool sets $OUT)
#   PYTHON      interpreter (default python3)
#   SMOKE=1     dry run of this script on a CPU: debug shapes, 2 steps, no HF anchors (checks the plumbing)
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/surojax-bench}
mkdir -p "$OUT/logs"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
BUDGET_S=${BUDGET_S:-570}
START=$(date +%s)

XLA_FLAGS_BASE=${XLA_FLAGS_BASE:---xla_gpu_enable_latency_hiding_scheduler=true}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}  # 8B shapes need more than 75%
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/surojax-jax-cache}  # reruns skip compiles
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
export PYTHONUNBUFFERED=1

DEFAULT_ITEMS="correctness lora hf-lora full hf-full qwen3-8b llama3-8b lora-1seg"
ITEMS=${ITEMS:-$DEFAULT_ITEMS}
DEFAULT_VARIANTS='
attn-cudnn-M4    | --attention cudnn:4 |
attn-M16-nocheck | --attention cudnn:16:nocheck |
recompute-dots   | --recompute dots |
recompute-full   | --recompute full |
lmhead-8         | --lmhead-chunks 8 |
attn-xla         | --attention xla |
cmdbuf-off       | | --xla_gpu_enable_command_buffer=
cmdbuf-while-cond| | --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL
triton-gemm-off  | | --xla_gpu_enable_triton_gemm=false
triton-gemm-any  | | --xla_gpu_triton_gemm_any=true
no-lhs           | | --xla_gpu_enable_latency_hiding_scheduler=false
'
VARIANTS=${VARIANTS:-$DEFAULT_VARIANTS}
BENCH="$PY -m surojax.cli.main bench train"
BENCH_ARGS=${BENCH_ARGS:-}
LORA06="--shape qwen3-0.6b --mode lora --batch 8 --seq 2048"
FULL06="--shape qwen3-0.6b --mode full --batch 8 --seq 2048"
Q8="--shape qwen3-8b --mode lora --batch 4 --seq 2048 --repeats 2"
L8="--shape llama3-8b --mode lora --batch 4 --seq 2048 --repeats 2"
CORRECTNESS_ARGS="--skip-timing --modes full"
HF="$PY benchmarks/anchors/hf_peft_baseline.py"
if [[ "${SMOKE:-0}" == 1 ]]; then
  tiny="--shape debug --batch 2 --seq 128 --steps 2 --repeats 1 --warmup 1"
  LORA06="$tiny --mode lora"; FULL06="$tiny --mode full"; Q8="$tiny --mode lora"; L8="$tiny --mode lora"
  CORRECTNESS_ARGS="--cpu-smoke"
  HF="echo SMOKE=1: the HF anchor needs CUDA, skipped:"
fi

# run_item NAME RESERVE_S XLA_EXTRA CMD...: run CMD (its last JSON line -> results.jsonl, tagged with NAME).
run_item() {
  local name=$1 reserve=$2 xla_extra=$3
  shift 3
  local now elapsed left rc t0 line
  now=$(date +%s); elapsed=$((now - START)); left=$((BUDGET_S - elapsed))
  if (( left < reserve )); then
    echo "== $name: skipped (${left}s left of the budget, needs ~${reserve}s)"
    printf '{"item": "%s", "skipped": "budget"}\n' "$name" >> "$RESULTS"
    return
  fi
  echo "== $name (t=${elapsed}s): $*"
  t0=$(date +%s)
  XLA_FLAGS="$XLA_FLAGS_BASE $xla_extra" timeout -k 10 "$left" "$@" > "$OUT/logs/$name.out" 2> "$OUT/logs/$name.err"
  rc=$?
  tail -n 3 "$OUT/logs/$name.err" | sed 's/^/   | /'
  grep -E '^\[(PASS|FAIL|info)\]' "$OUT/logs/$name.out" | sed 's/^/   /'
  line=$(grep -E '^(RESULT )?\{' "$OUT/logs/$name.out" | tail -n 1 | sed 's/^RESULT //')
  [[ -z "$line" ]] && line='{}'
  "$PY" - "$name" "$rc" "$(( $(date +%s) - t0 ))" "$xla_extra" "$line" >> "$RESULTS" <<'EOF'
import json, sys
name, rc, wall, xla_extra, line = sys.argv[1:]
try:
    d = json.loads(line)
except ValueError:
    d = {}
d.update(item=name, rc=int(rc), wall_s=int(wall), xla_extra=xla_extra)
print(json.dumps(d))
EOF
  echo "   rc=$rc wall=$(( $(date +%s) - t0 ))s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
echo "XLA_FLAGS_BASE=$XLA_FLAGS_BASE  ITEMS=$ITEMS  BUDGET_S=$BUDGET_S"

for item in $ITEMS; do
  case $item in
    correctness) run_item correctness 150 "" "$PY" benchmarks/gpu_correctness.py $CORRECTNESS_ARGS ;;
    attn-timing) run_item attn-timing 90 "" "$PY" -c "
import sys; sys.argv = ['x']; sys.path.insert(0, 'benchmarks')
import gpu_correctness as g; g.part_attention_timing()
import json; print(json.dumps({'impl': 'attn-timing', 'rows': g.ROWS}))" ;;
    lora) run_item ours-0.6b-lora 60 "" $BENCH $LORA06 $BENCH_ARGS ;;
    hf-lora) run_item hf-0.6b-lora 40 "" $HF --shape qwen3-0.6b --mode lora --batch 8 --seq 2048 ;;
    full) run_item ours-0.6b-full 60 "" $BENCH $FULL06 $BENCH_ARGS ;;
    hf-full) run_item hf-0.6b-full 40 "" $HF --shape qwen3-0.6b --mode full --batch 8 --seq 2048 ;;
    lora-1seg) run_item ours-0.6b-lora-1seg 60 "" $BENCH $LORA06 --segments 1 $BENCH_ARGS ;;
    qwen3-8b) run_item ours-qwen3-8b-lora 100 "" $BENCH $Q8 $BENCH_ARGS ;;
    llama3-8b) run_item ours-llama3-8b-lora 100 "" $BENCH $L8 $BENCH_ARGS ;;
    variants)
      while IFS='|' read -r vname vargs vxla; do
        vname=$(echo "$vname" | xargs)
        [[ -z "$vname" ]] && continue
        # shellcheck disable=SC2086
        run_item "var-$vname" 55 "$vxla" $BENCH $LORA06 $BENCH_ARGS $vargs
      done <<< "$VARIANTS" ;;
    *) echo "unknown item $item (known: $DEFAULT_ITEMS attn-timing variants)" ;;
  esac
done

echo
echo "== table ($(date -u +%Y-%m-%dT%H:%MZ), total $(( $(date +%s) - START ))s; results in $RESULTS)"
"$PY" - "$RESULTS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {r["item"]: r for r in rows}
# Same-job anchors; 8B anchors are the published H200 figures of shared/BENCHMARKS.md (2026-11-29, HF+PEFT b4).
anchor_of = {"ours-0.6b-lora": "hf-0.6b-lora", "ours-0.6b-lora-1seg": "hf-0.6b-lora", "ours-0.6b-full": "hf-0.6b-full"}
published = {"ours-qwen3-8b-lora": ("HF+PEFT b4 (BENCHMARKS.md)", 8240.0, 111.0),
             "ours-llama3-8b-lora": ("HF+PEFT b4 (BENCHMARKS.md)", 9170.0, 99.0)}
fmt = "{:<28} {:>10} {:>9} {:>6} {:>8} {:>11} {:>8} {:>8}  {}"
print(fmt.format("item", "tok/s", "step ms", "MFU", "peak GiB", "anchor tok/s", "ratio", "anc GiB", "notes"))
for r in rows:
    name = r["item"]
    if r.get("skipped"):
        print(fmt.format(name, "-", "-", "-", "-", "-", "-", "-", "skipped: " + r["skipped"])); continue
    if r.get("impl") in ("gpu_correctness", "attn-timing"):
        note = ("PASS" if r.get("ok") else "FAIL " + ", ".join(r.get("failed", []))) if "ok" in r else ""
        if r.get("impl") == "attn-timing":
            note = "; ".join(f"{x['case']}: {x['ms']:.2f} ms" for x in r.get("rows", []))
        print(fmt.format(name, "", "", "", "", "", "", "", f"{note} (rc {r['rc']}, {r['wall_s']}s)")); continue
    tps = r.get("tokens_per_s")
    if tps is None:
        print(fmt.format(name, "-", "-", "-", "-", "-", "-", "-", f"no result (rc {r['rc']}; see logs/{name}.err)")); continue
    anc, anc_gib, label = None, None, ""
    if name in anchor_of and by.get(anchor_of[name], {}).get("tokens_per_s"):
        a = by[anchor_of[name]]; anc, anc_gib, label = a["tokens_per_s"], a.get("peak_gib"), anchor_of[name]
    elif name in published:
        label, anc, anc_gib = published[name]
    elif name.startswith("var-") and by.get("hf-0.6b-lora", {}).get("tokens_per_s"):
        a = by["hf-0.6b-lora"]; anc, anc_gib, label = a["tokens_per_s"], a.get("peak_gib"), "hf-0.6b-lora"
    mfu = r.get("mfu"); peak = r.get("peak_gib"); cfg = r.get("config", {})
    notes = (f"{label}; " if label else "") + (f"seg {cfg.get('segments')} attn {cfg.get('attention')} "
             f"remat {cfg.get('recompute')} chunks {cfg.get('lmhead_chunks')} compile {r.get('compile_s', 0):.0f}s")
    if r.get("xla_extra", "").strip():
        notes += " xla " + r["xla_extra"].strip()
    base = by.get("ours-0.6b-lora", {})
    if name.startswith("var-") and base.get("tokens_per_s"):
        notes = (f"{tps / base['tokens_per_s']:.3f}x speed, "
                 f"{(peak or 0) - (base.get('peak_gib') or 0):+.1f} GiB vs ours-0.6b-lora; ") + notes
    if r.get("impl", "").startswith("hf"):
        notes = f"{r.get('impl')} torch {r.get('torch')}"
    print(fmt.format(name, f"{tps:,.0f}", f"{r.get('step_ms', 0):.1f}", f"{mfu:.1%}" if mfu else "",
                     f"{peak:.1f}" if peak else "", f"{anc:,.0f}" if anc else "",
                     f"{tps / anc:.2f}x" if anc else "", f"{anc_gib:.0f}" if anc_gib else "", notes))
EOF
