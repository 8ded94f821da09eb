#!/usr/bin/env bash
# Resolve (pip --dry-run, nothing installed) this project beside the newest stack in a Python 3.12
# venv: megatron-core 0.19.2 with torch 2.14.1, then with torch 2.15; fail if pip would pick other
# versions of either. PYTHON312 names the interpreter (default: pyenv's 3.12, else python3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON312:-$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python 2>/dev/null | head -1)}"
PY="${PY:-python3.12}"
venv="$(mktemp -d)/py312"
"$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
for torch_spec in "torch==2.14.1" "torch==2.15.*"; do
  report="$venv/report.json"
  # PIP_CONFIG_FILE=/dev/null: a machine-wide pip constraint (e.g. a torch cap) does not apply
  PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q --dry-run --ignore-installed \
    --report "$report" -e . "$torch_spec" "megatron-core==0.19.2" 2> >(grep -v "^WARNING: Location" >&2)
  "$venv/bin/python" - "$report" "$torch_spec" <<'PY'
import json, sys
picked = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
torch_want = sys.argv[2].split("==")[1].rstrip(".*")
assert picked["torch"].startswith(torch_want), picked["torch"]
assert picked["megatron-core"] == "0.19.2", picked["megatron-core"]
print(f"python 3.12: lightning-mcore-rl {picked['lightning-mcore-rl']} resolves with torch "
      f"{picked['torch']}, megatron-core {picked['megatron-core']}, lightning {picked['lightning']}")
PY
done
