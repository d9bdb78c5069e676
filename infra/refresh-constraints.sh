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
  echo "#   python -m pip install -c constraints.txt -e \".[dev,torch]\""
  echo "# Refresh with infra/refresh-constraints.sh (fresh venv, pip freeze), then run the test suite."
  echo "# The gpu extra (cupy-cuda12x, dask-cuda) is not pinned here: it is installed on GPU workers only."
  # A local version label (torch's +cpu wheel) exists only on the index that built it: pin the release,
  # which PEP 440 lets the +cpu wheel satisfy where it is found, and PyPI's wheel elsewhere.
  "$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^gpmil' | sed -E 's/^([A-Za-z0-9_.-]+==[^+]+)\+.*$/\1/'
} > constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins) from $venv"
