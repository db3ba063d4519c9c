"""Experiment: the planner's unit costs against the unit chain at the rows' own shapes.

``plan_here.py`` compares plans with runs; between the two, the machine's level drifts (the
samples). This script holds the level fixed: in one process, ``--rounds`` times (default 4,
interleaved), it takes what ``mpipar plan measure`` takes for ``[units]``
(``unit_bench.unit_times``: the floor, the reference shape and the other GPT shapes) and, with
the same chain and budget, the GPT units at the shapes of the models ``plan_here.py`` runs (the
tiny GPT and the 8-block one: one micro-batch of 4 sequences of 64 tokens). Then each unit
and phase of those models is priced from the medians (``plan.unit_fit``: as the plan prices
it, from the reference shape alone, and fitted over the shapes) and set beside its measured
chain time: the
planner's form against the machine at one moment, with no run and no drift between them.
Nothing here feeds the spec or the plan.

Run: ``python experiments/plan_here_shapes.py --spec here.toml [--out DIR] [--rounds N]``
(about 1 minute alone with 4 rounds; one BLAS thread). ``--spec``: the machine's rates (GEMM
curve, element-wise rate) the counted parts are priced at; its ``[units]`` are replaced by
the ones timed here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

for _k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_k] = "1"  # a rank's share, as plan measure times it; before NumPy loads BLAS

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's mpipar
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "plan_here_shapes"
COLUMNS = ["model", "unit", "phase", "measured_us", "planned_us", "err_pct", "shapes_us",
           "shapes_err_pct"]
# the models plan_here.py runs (experiments/configs/tiny.toml, exp_bubble.toml): n_embd,
# n_head, seq, rows per micro-batch (batch 16 / 4 micro-batches)
MODELS = {"tiny": (64, 4, 64, 4), "gpt8": (128, 4, 64, 4)}


def measure(rounds: int, budget: float) -> tuple[dict, dict]:
    """(the spec's [units] keys in seconds, {model: unit times}), medians over the rounds."""
    from mpipar.plan.unit_bench import gpt_units, unit_times

    units, models = [], {m: [] for m in MODELS}
    for _ in range(rounds):
        units.append(unit_times(budget))
        for m, shape in MODELS.items():
            models[m].append(gpt_units(*shape, budget))
    med = {k: float(np.median([u[k] for u in units])) for k in units[0]}
    return med, {m: {k: float(np.median([r[k] for r in got])) for k in got[0]}
                 for m, got in models.items()}


def rows_of(cluster, units: dict, models: dict) -> list[dict]:
    from mpipar.plan.here import calibration, unit_costs
    from mpipar.plan.unit_fit import (
        _gpt_config,
        _parts_by_kind,
        one_shape,
        phase_times,
    )

    c = dataclasses.replace(cluster, units=tuple(sorted(units.items())))
    cals = {"fit": calibration(c), "one": calibration(one_shape(c))}
    out = []
    for m, shape in MODELS.items():
        parts = _parts_by_kind(_gpt_config(*shape), c, unit_costs)
        for unit in ("embed", "block", "head"):
            got = {k: dict(zip("fbw", phase_times({**parts[unit], "loss": False}, cal, "none"),
                               strict=True)) for k, cal in cals.items()}
            for ph in "fbw":
                meas = models[m][f"{unit}_{ph}"] * 1e6
                fit, one = got["fit"][ph] * 1e6, got["one"][ph] * 1e6
                out.append({"model": m, "unit": unit, "phase": ph, "measured_us": meas,
                            "planned_us": one, "err_pct": 100 * (one / meas - 1),
                            "shapes_us": fit, "shapes_err_pct": 100 * (fit / meas - 1)})
    return out


def main() -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--spec", required=True,
                   help="a spec of this machine (mpipar plan measure --out FILE): its rates")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    p.add_argument("--budget", type=float, default=0.4,
                   help="seconds per chain (default 0.4, plan measure's)")
    args = p.parse_args()
    if args.rounds < 1 or args.budget < 0:
        print("plan_here_shapes: give --rounds >= 1 and --budget >= 0", file=sys.stderr)
        return 2
    from mpipar.plan import PlanError, load_cluster

    try:
        cluster = load_cluster(args.spec)
    except PlanError as exc:
        print(f"plan_here_shapes: {exc}", file=sys.stderr)
        return 2
    out = common.out_dir(args, NAME)
    units, models = measure(args.rounds, args.budget)
    rows = rows_of(cluster, units, models)
    common.write_results(out, NAME, rows, COLUMNS, {"rounds": args.rounds, "spec": args.spec,
                                                   "machine": common.machine_note()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
