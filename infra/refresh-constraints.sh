#!/usr/bin/env bash
# Regenerate constraints.txt: resolve the project's dependencies (all extras) in a fresh venv
# and freeze them. Run the test suite with the new file before committing it; Prefect's server
# is the usual casualty of a new FastAPI/Starlette/pydantic (see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${GPMIL_EXTRAS:-dev,torch,kubernetes}"
venv="$(mktemp -d)/venv"
python -m venv "$venv"
"$venv/bin/python" -m pip install -q -U pip
"$venv/bin/python" -m pip install -q -e ".[${extras}]"
{
  echo "# Tested versions of every dependency (extras: ${extras}), used by the README's two commands:"
  echo "#   python -m pip install -c constraints.txt -e \".[${extras}]\""
  echo "# Refresh with infra/refresh-constraints.sh (fresh venv, pip freeze), then run the test suite."
  "$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^gpmil'
} > constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins) from $venv"
