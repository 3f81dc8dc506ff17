#!/usr/bin/env bash
# The test suite (CPU): set up the environment with the dev extras if needed, then run pytest.
source "$(dirname "$0")/env.sh" dev || exit 1
export JAX_PLATFORMS=cpu
exec python -m pytest -q -n 2 --dist loadfile "$@"
