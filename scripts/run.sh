#!/usr/bin/env bash
# The main job: set up the environment if needed, then run the quickstart.
source "$(dirname "$0")/env.sh" || exit 1
exec python -m surojax.quickstart "$@"
