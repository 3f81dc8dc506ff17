#!/usr/bin/env bash
# The test suite (CPU): set up the environment with the dev extras if needed, then run pytest.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/cli
cd "$(dirname "$0")/.." || exit 1
source scripts/env.sh dev || exit 1
export JAX_PLATFORMS=cpu
exec python -m pytest -q -n 2 --dist loadfile "$@"
