#!/usr/bin/env bash
# Start one dask-cuda worker per visible GPU on this node, each advertising the GPU resource that
# gpmil's executor requests for CuPy partition steps. Usage: infra/gpu-workers.sh tcp://scheduler:8786
set -euo pipefail
scheduler="${1:?usage: $0 SCHEDULER_ADDRESS}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
exec dask cuda worker "$scheduler" --resources "GPU=1"
