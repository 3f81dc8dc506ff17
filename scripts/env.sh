# Source me: creates (once) and activates the project's virtual environment (.venv at the repo root, Python 3.12).
# Installs the versions that were tested: every package pinned by constraints.txt (scripts/lock.sh writes it, on
# purpose, from a fresh resolution; the CI run installs from it). Re-installs when pyproject.toml or
# constraints.txt changes. Usage: source scripts/env.sh [EXTRAS]   (EXTRAS e.g. dev, serve, gpu)
# Contract: the only argument is an extras name (scripts pass it explicitly, so a caller's "$@" never leaks in);
# the caller's directory and shell options are left as they were; a failed or interrupted set-up leaves no stamp,
# so the next run starts it again. SUROJAX_VENV overrides the environment's location.
_sj_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_sj_extras="${1:-}"
_sj_venv="${SUROJAX_VENV:-$_sj_root/.venv}"

_sj_fail() { echo "[surojax] $*" >&2; return 1; }

_sj_find_python312() {
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

# A stamp file holds the sha256 of pyproject.toml + constraints.txt the install was made from; the base install
# (no extras) is also satisfied by any extras' stamp (extras only add packages).
_sj_stamp_matches() {
  local want="$1" f
  if [ -n "$_sj_extras" ]; then set -- "$_sj_venv/.surojax-installed-$_sj_extras"
  else set -- "$_sj_venv"/.surojax-installed*; fi
  for f in "$@"; do
    [ -f "$f" ] && [ "$(cat "$f")" = "$want" ] && return 0
  done
  return 1
}

_sj_setup() {
  case "$_sj_extras" in
    -*|*[!A-Za-z0-9_,-]*)
      _sj_fail "'$_sj_extras' is not an extras name (usage: source scripts/env.sh [dev|serve|gpu]);" \
               "arguments for the trainer go to scripts/run.sh, which does not pass them here"
      return 1 ;;
  esac
  local creating="$_sj_venv/.surojax-creating" py want stamp log rc
  if [ -e "$creating" ]; then  # a creation that did not finish: start over
    echo "[surojax] removing the unfinished environment $_sj_venv" >&2
    rm -rf "$_sj_venv"
  fi
  if [ ! -x "$_sj_venv/bin/python" ]; then
    py="$(_sj_find_python312)" || { _sj_fail "surojax needs Python 3.12 (python3.12 not found; set SUROJAX_PYTHON)"; return 1; }
    echo "[surojax] creating $_sj_venv with $py" >&2
    mkdir -p "$_sj_venv" && : > "$creating" || { _sj_fail "cannot create $_sj_venv"; return 1; }
    "$py" -m venv "$_sj_venv" || { _sj_fail "'$py -m venv $_sj_venv' failed"; return 1; }
    "$_sj_venv/bin/python" -m pip install -q --upgrade pip \
      || { _sj_fail "upgrading pip in $_sj_venv failed (the next run starts over)"; return 1; }
    rm -f "$creating"
  fi
  # shellcheck disable=SC1091
  . "$_sj_venv/bin/activate" || { _sj_fail "cannot activate $_sj_venv"; return 1; }
  [ -f "$_sj_root/pyproject.toml" ] && [ -f "$_sj_root/constraints.txt" ] \
    || { _sj_fail "$_sj_root lacks pyproject.toml or constraints.txt (the tested versions)"; return 1; }
  want="$(cat "$_sj_root/pyproject.toml" "$_sj_root/constraints.txt" | sha256sum | cut -d' ' -f1)"
  _sj_stamp_matches "$want" && return 0
  stamp="$_sj_venv/.surojax-installed${_sj_extras:+-$_sj_extras}"
  rm -f "$_sj_venv"/.surojax-installed*  # a failed install may have half-replaced packages any stamp vouched for
  echo "[surojax] installing surojax${_sj_extras:+[$_sj_extras]} and its dependencies into $_sj_venv" >&2
  log="$_sj_venv/.surojax-install.log"
  python -m pip install -q -c "$_sj_root/constraints.txt" -e "$_sj_root${_sj_extras:+[$_sj_extras]}" >"$log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    tail -n 20 "$log" >&2
    _sj_fail "'pip install -c constraints.txt -e $_sj_root${_sj_extras:+[$_sj_extras]}' failed (exit $rc; full log: $log); the next run retries"
    return 1
  fi
  python -c "import surojax, jax, flax" \
    || { _sj_fail "installed, but 'import surojax, jax, flax' fails (log: $log); the next run retries"; return 1; }
  echo "$want" > "$stamp"
}

_sj_setup
_sj_rc=$?
unset -f _sj_fail _sj_find_python312 _sj_stamp_matches _sj_setup
unset _sj_root _sj_extras _sj_venv
eval "unset _sj_rc; return $_sj_rc"
