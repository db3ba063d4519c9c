"""What the timing dump costs a rank's resident memory: the tracer's events held between two
flushes and the HDF5 part writer. Measured once per machine, in one process without MPI: the
resident high-water mark above a base taken after the imports (``mpipar.training.memory``, as
the trainer takes it), while a ``Tracer`` records N events per step and the rank's part is
written every F steps (``trace_parts``, as ``mpi/job/dump.py`` writes it).

Prints, per (events per step, flush interval, steps), the growth, and the fit
``growth = DUMP_WRITER_BYTES + TRACE_EVENT_BYTES x events held`` (least squares) that
``mpipar.analysis.memory_model`` uses: copy the two numbers there when a machine differs.
``python experiments/memory_runtime.py`` (about 30 s; each setting in its own process).

``--runtime``: the third per-machine constant, ``RUNTIME_BYTES`` (what MPI, BLAS and the
allocator touch during the steps, per rank): the probe of ``mpipar plan measure`` (a tiny traced
pp = 2 run under ``mpiexec -n 2``), its ranks' measured peak less the memory model's prediction
(``mpipar.plan.measure.runtime_bytes``); copy the number it prints into
``mpipar/analysis/memory_model.py``. About 30 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, os, sys, tempfile
import h5py  # noqa: F401 (the trainer has it loaded before its base: the data set is HDF5)
import numpy as np
from mpipar import trace_parts as parts
from mpipar.trace import METRICS_DTYPE, Tracer
from mpipar.training.memory import peak_resident_bytes, reset_peak, resident_bytes

per_step, steps, flush = (int(x) for x in sys.argv[1:4])
path = os.path.join(tempfile.mkdtemp(), "trace.h5")
t, coords, m = Tracer(), {"dp": 0, "pp": 0, "tp": 0}, np.empty(0, METRICS_DTYPE)
with h5py.File(path + ".data", "w") as f:  # the trainer has read its data set before its base
    f["tokens"] = np.zeros(1 << 16, np.uint8)
with h5py.File(path + ".data", "r") as f:
    f["tokens"][:4096]
reset_peak()
base = resident_bytes()
parts.write_index(path, {"config": {}, "grid": {"dp": 1, "pp": 1, "tp": 1}}, 1, "probe")
first = True
for s in range(steps):
    t.step = s
    for i in range(per_step):  # a collective's row: every field a number of its own
        t.record("tp.allreduce", s + i * 1e-3, s + i * 1e-3 + 5e-4, mb=i % 4, chunk=0,
                 nbytes=65536 + i)
    if (s + 1) % flush == 0 or s == steps - 1:
        ev = t.events()
        if first:
            parts.write_part(path, 0, "probe", ev, coords, m)
            first = False
        else:
            parts.append_part(path, 0, ev, coords, m)
        t.clear()
print(json.dumps({"growth": peak_resident_bytes() - base}))
"""

SETTINGS = [(33, 200, 50), (66, 200, 50), (132, 200, 50), (66, 200, 100), (66, 200, 200),
            (66, 400, 50)]


def runtime() -> int:
    """Print ``RUNTIME_BYTES`` as the probe of ``mpipar plan measure`` measures it."""
    import os

    sys.path.insert(0, str(ROOT))  # this checkout's mpipar, here and in the probe's ranks
    os.environ["PYTHONPATH"] = str(ROOT)
    from mpipar.analysis.memory_model import RUNTIME_BYTES
    from mpipar.plan.measure import executor_costs

    _, got = executor_costs(False, 600)
    print(f"RUNTIME_BYTES = {got:.0f}  ({got / 2**20:.2f} MiB a rank; "
          f"memory_model has {RUNTIME_BYTES / 2**20:.2f})")
    return 0


def main() -> int:
    if "--runtime" in sys.argv[1:]:
        return runtime()
    import numpy as np

    rows = []
    for per_step, steps, flush in SETTINGS:
        out = subprocess.run([sys.executable, "-c", PROBE, str(per_step), str(steps),
                              str(flush)], capture_output=True, text=True, timeout=300,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                  "OMP_NUM_THREADS": "1"}, check=True)
        growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
        rows.append((per_step, steps, flush, per_step * min(flush, steps), growth))
        print(f"events/step {per_step:4d}  steps {steps:4d}  flush every {flush:4d}  "
              f"held {rows[-1][3]:6d}  growth {growth / 2**20:6.2f} MiB", flush=True)
    held = np.array([r[3] for r in rows], dtype=float)
    growth = np.array([r[4] for r in rows], dtype=float)
    slope, icpt = np.polyfit(held, growth, 1)
    print(f"fit: DUMP_WRITER_BYTES = {icpt / 2**20:.2f} MiB, TRACE_EVENT_BYTES = {slope:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
