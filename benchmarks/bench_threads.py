"""A default fit on MUSK2 with the process's native threads, with and without the small-fit policy of
``mil_core.threadpools`` (one BLAS/OpenMP thread when ``N·M²`` is small).

Each fit runs in a fresh process with the environment's thread settings (no ``OMP_NUM_THREADS``:
OpenBLAS and OpenMP start one thread per core, as a user's session does); "policy off" sets
``SMALL_SWEEP_FLOPS = 0`` in that process, which is the code before the policy. The two run
alternately, so both see the same load; the load average is printed with each row. On an idle
machine the two should be close; on a machine whose cores are busy they are not.

    python benchmarks/bench_threads.py                       # VGPMIL and VGPMILPR, one fit each way
    python benchmarks/bench_threads.py --models VGPMIL --repeats 2
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
import numpy as np
import mil_core
import mil_core.threadpools
from mil_core.validation import standardisation
if sys.argv[2] == "off":
    mil_core.threadpools.SMALL_SWEEP_FLOPS = 0
table = np.loadtxt(sys.argv[3], delimiter=",")
y, bags, X = table[:, 0].astype(int), table[:, 1], table[:, 2:]
mean, scale = standardisation(X)
X = (X - mean) / scale
wall, cpu = time.perf_counter(), time.process_time()
getattr(mil_core, sys.argv[1])(random_state=0).fit(X, bags, y)
print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["VGPMIL", "VGPMILPR"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--table", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "musk2.csv")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    print(f"table {args.table.name}, {os.cpu_count()} cores, thread variables unset")
    print("| model | policy | wall s | CPU s | load average (1 min) before |")
    print("|---|---|---|---|---|")
    for _ in range(args.repeats):
        for model in args.models:
            for policy in ("on", "off"):
                load = os.getloadavg()[0]
                out = subprocess.run([sys.executable, "-c", CHILD, model, policy, str(args.table)], env=env, check=True,
                                     capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(f"| {model} | {policy} | {r['wall']:.1f} | {r['cpu']:.1f} | {load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
