"""A default fit on MUSK2 with the process's native threads, with and without the small-fit policy of
``mil_core.threadpools`` (one BLAS/OpenMP thread when ``N·M²`` is small, the kernel choice's
splits side by side on the threads that frees).

Each fit runs in a fresh process with the environment's thread settings (no ``OMP_NUM_THREADS``:
OpenBLAS and OpenMP start one thread per core, as a user's session does). Policies:

- ``on``: the code as it is;
- ``serial``: the fit under ``threadpool_limits(1)``, a one-thread process (a Dask worker, or
  ``OMP_NUM_THREADS=1``): the choice's splits one after another, the code before they ran side by side;
- ``off``: ``SMALL_SWEEP_FLOPS = 0`` in that process: BLAS and OpenMP threaded in every call, the
  code before the policy;
- ``ungated``: ``CONCURRENT_SWEEP_FLOPS = 0``: the splits side by side however little BLAS work
  their sweeps do (what the gate was measured against).

The policies run alternately, so all see the same load; the load average is printed with each
row. Compare rows within one run only.

    python benchmarks/bench_threads.py                       # VGPMIL and VGPMILPR, on and serial
    python benchmarks/bench_threads.py --models VGPMIL --repeats 3 --policies on serial off
    python benchmarks/bench_threads.py --bags 80 10          # generated: 80 bags of 10 instances, D = 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys, time
from contextlib import nullcontext
import numpy as np
from threadpoolctl import threadpool_limits
import mil_core
import mil_core.threadpools
from mil_core.validation import standardisation, standardise
if sys.argv[2] == "off":
    mil_core.threadpools.SMALL_SWEEP_FLOPS = 0
if sys.argv[2] == "ungated":
    mil_core.threadpools.CONCURRENT_SWEEP_FLOPS = 0
if sys.argv[3].startswith("bags:"):  # generated: alternating labels, a third of a positive bag's instances shifted
    n_bags, size = map(int, sys.argv[3][5:].split("x"))
    rng = np.random.default_rng(0)
    bags, y = np.repeat(np.arange(n_bags), size), np.repeat(np.arange(n_bags) % 2, size)
    X = rng.normal(size=(bags.size, 3)) + 1.5 * y[:, None] * (rng.random((bags.size, 1)) < 0.3)
else:
    table = np.loadtxt(sys.argv[3], delimiter=",")
    y, bags, X = table[:, 0].astype(int), table[:, 1], table[:, 2:]
mean, scale = standardisation(X)
X = standardise(X, mean, scale)
wall, cpu = time.perf_counter(), time.process_time()
with threadpool_limits(limits=1) if sys.argv[2] == "serial" else nullcontext():
    getattr(mil_core, sys.argv[1])(random_state=0).fit(X, bags, y)
print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["VGPMIL", "VGPMILPR"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--policies", nargs="+", choices=["on", "serial", "off", "ungated"], default=["on", "serial"])
    parser.add_argument("--table", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "musk2.csv")
    parser.add_argument("--bags", nargs=2, type=int, metavar=("N_BAGS", "SIZE"), help="generated bags instead of --table")
    args = parser.parse_args()
    data = f"bags:{args.bags[0]}x{args.bags[1]}" if args.bags else str(args.table)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    print(f"data {data if args.bags else args.table.name}, {os.cpu_count()} cores, thread variables unset")
    print("| model | policy | wall s | CPU s | load average (1 min) before |")
    print("|---|---|---|---|---|")
    for _ in range(args.repeats):
        for model in args.models:
            for policy in args.policies:
                load = os.getloadavg()[0]
                out = subprocess.run([sys.executable, "-c", CHILD, model, policy, data], env=env, check=True,
                                     capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(f"| {model} | {policy} | {r['wall']:.1f} | {r['cpu']:.1f} | {load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
