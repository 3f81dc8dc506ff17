# Shared set-up of the GPU campaign scripts (campaign_s*.sh): environment, wheels, and `item NAME TIMEOUT CMD...`
# which runs one measurement with its own timeout, its stdout/stderr under $OUT/NAME.{out,err}, and a summary.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TF_CPP_MIN_LOG_LEVEL=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
export XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true
python3 -m pip install -q --no-deps --no-index .gpu-wheels/*.whl 2>&1 | tail -1
START=$(date +%s)
ITEMS_DIR=${ITEMS_DIR:-$OUT}  # where each item's NAME.out / NAME.err go (the device brings back few files)
mkdir -p "$ITEMS_DIR"
item() { local name=$1 t=$2; shift 2; echo "== $name (t=$(( $(date +%s) - START ))s): $*";
  timeout -k 5 "$t" "$@" > "$ITEMS_DIR/$name.out" 2> "$ITEMS_DIR/$name.err"; echo "   rc=$? wall=$(( $(date +%s) - START ))s";
  grep -E '^\{|RESULT|PASS|FAIL|MISMATCH' "$ITEMS_DIR/$name.out" | tail -3 | cut -c1-400;
  tail -2 "$ITEMS_DIR/$name.err" | cut -c1-300; }
