#!/usr/bin/env bash
# The main job: set up the environment if needed, then run the quickstart (configs/quickstart.yaml): pretrain a
# tiny Qwen3 from scratch on arithmetic stories, LoRA-fine-tune it to answer questions, and show the held-out
# accuracy before vs after. About four minutes on an idle 2-core CPU, no download; outputs in runs/quickstart/.
# Extra arguments go to the trainer, e.g. scripts/run.sh --override stages.0.max_steps=100
# SUROJAX_RUN_SCRIPT / _CONFIG tell the trainer how it was started: after Ctrl-C it prints `bash <this script as you
# called it> ... -o resume_from_checkpoint=true`, which works from your shell (the venv is active only in here).
export SUROJAX_RUN_SCRIPT="$0" SUROJAX_RUN_SCRIPT_CONFIG=configs/quickstart.yaml
cd "$(dirname "$0")/.." || exit 1
source scripts/env.sh "" || exit 1  # "" = no extras; without an argument, source would hand env.sh our "$@"
exec python -m surojax.train --config "$SUROJAX_RUN_SCRIPT_CONFIG" "$@"
