# Source me: creates (once) and activates the project's virtual environment in .venv with Python 3.12.
# Re-installs when pyproject.toml changes. Usage: source scripts/env.sh [extras, e.g. dev]
set -e
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_extras="${1:-}"

_find_python312() {
  local c
  for c in "${SUROJAX_PYTHON:-}" python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /opt/python/3.12*/bin/python3.12; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

_venv="$_root/.venv"
if [ ! -x "$_venv/bin/python" ]; then
  _py="$(_find_python312)" || { echo "surojax needs Python 3.12 (python3.12 not found; set SUROJAX_PYTHON)" >&2; return 1; }
  echo "[surojax] creating $_venv with $_py" >&2
  "$_py" -m venv "$_venv"
  "$_venv/bin/python" -m pip install -q --upgrade pip
fi
# shellcheck disable=SC1091
. "$_venv/bin/activate"
_stamp="$_venv/.surojax-installed${_extras:+-$_extras}"
_want="$(sha256sum "$_root/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
  echo "[surojax] installing surojax${_extras:+[$_extras]} and its dependencies into $_venv" >&2
  python -m pip install -q -e "$_root${_extras:+[$_extras]}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  python -c "import surojax, jax, flax" || { echo "[surojax] installation failed" >&2; return 1; }
  echo "$_want" > "$_stamp"
fi
cd "$_root"
set +e
