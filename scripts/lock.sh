#!/usr/bin/env bash
# Write constraints.txt: the exact versions `bash scripts/test.sh` and `bash scripts/run.sh` install (scripts/env.sh
# passes it to pip as constraints). Run it on purpose, when a dependency should move: it resolves pyproject.toml's
# requirements afresh against today's package registries in a throw-away environment (the dev extras, which hold
# the base install), freezes the result, and shows what changed. Then run the suite on it and commit both.
#   bash scripts/lock.sh            # rewrite constraints.txt
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py=""
for c in "${SUROJAX_PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do  # as scripts/env.sh looks
  if [ -n "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then py="$c"; break; fi
done
[ -n "$py" ] || { echo "[lock] Python 3.12 not found (set SUROJAX_PYTHON)" >&2; exit 1; }
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
"$tmp/venv/bin/python" -m pip install -q -e "$root[dev,serve]"
{
  echo "# The versions the test suite ran on (pip constraints; scripts/env.sh installs with -c constraints.txt)."
  echo "# Written by scripts/lock.sh from a fresh resolution of pyproject.toml on $(date -u +%Y-%m-%d); do not edit."
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -v '^surojax'
} > "$tmp/constraints.txt"
if [ -f "$root/constraints.txt" ]; then  # the pins that moved (diff exits 1 when any did: not a failure here)
  changed="$(diff "$root/constraints.txt" "$tmp/constraints.txt" | grep '^[<>] [^#]' || true)"
  echo "${changed:-[lock] no version changed}"
fi
cp "$tmp/constraints.txt" "$root/constraints.txt"
echo "[lock] wrote $root/constraints.txt; run bash scripts/test.sh on it before committing" >&2
