#!/usr/bin/env bash
# A new user's first hour, replayed in a fresh virtual environment on the CPU: the README's install
# and main-job command (read from README.md, so the two cannot drift), then the weight-transfer
# demo and examples/rl_weight_sync.py on that base install (no extras).
#
#   scripts/fresh_venv_check.sh [VENV_DIR]    # default: a temporary directory, removed at exit
#
# pip uses the machine's own configuration (index, find-links); nothing here names a host.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -ge 1 ]; then
    venv=$1
else
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    venv=$tmp/venv
fi
unset PYTHONPATH VIRTUAL_ENV  # only what the venv installs may be imported
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1

step() { printf '\n=== %s\n' "$*"; }

step "fresh venv: $(python3 --version)"
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
cd "$root"

cmd=$(awk '/^# main job:/{getline; print; exit}' README.md)
[ -n "$cmd" ] || { echo "README.md has no '# main job:' command" >&2; exit 1; }
step "README main job: $cmd"
start=$SECONDS
bash -euo pipefail -c "$cmd"
echo "(install + main job: $((SECONDS - start)) s)"

step "installed: vllm_dist from $(python -c 'import os, vllm_dist; print(os.path.dirname(vllm_dist.__file__))')"
python - <<'PY'
import importlib.util
missing = [m for m in ("transformers", "ray", "nixl") if importlib.util.find_spec(m) is None]
print("base install: not installed:", ", ".join(missing) or "none")
PY
vllm-dist --version

step "vllm-dist run weight-transfer"
start=$SECONDS
vllm-dist run weight-transfer
echo "($((SECONDS - start)) s)"

step "python examples/rl_weight_sync.py"
start=$SECONDS
python examples/rl_weight_sync.py
echo "($((SECONDS - start)) s)"

step "fresh venv check passed"
