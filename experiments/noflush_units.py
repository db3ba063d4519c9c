"""Are a continuous run's forwards and backwards slower than 1F1B's, round after round?

usage: python experiments/noflush_units.py OUT [OUT ...]   (folders of noflush_ab.sh)

``noflush_feasible.py``'s ``units`` term (1F1B's F and backward costs given to the continuous
run) mixes what the continuous code adds to a forward or a backward with the machine's drift
between two runs. This separates them: per continuous run, the median F and the median B of
each rank over the measured steps against those of the 1F1B run of the same round,
configuration and m, then per row the mean over the rounds of all folders given, the range,
and in how many rounds the continuous run was the slower. A difference of one sign in every
round is the code's; one that changes sign from round to round is drift. Seconds, no MPI.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

RUN = re.compile(r"r(\d+)_(\w+)_m(\d+)_(.+)$")


def medians(run_dir: Path) -> np.ndarray:
    """[rank][F, B]: the median duration (s) over the run's measured steps."""
    from mpipar.analysis import load
    from mpipar.analysis.breakdown import select_steps

    run = load(str(run_dir / "trace.h5"))
    steps, _ = select_steps(run)
    out = []
    for ev in run.events:
        sel = ev[np.isin(ev["step"], steps)]
        out.append([float(np.median(sel["end"][sel["kind"] == k] - sel["start"][sel["kind"] == k]))
                    for k in ("F", "B")])
    return np.array(out)


def ratios(outs) -> dict:
    """{(cfg, m, schedule): [array rank x (F, B) of continuous / 1F1B - 1, one per round]}."""
    got = defaultdict(list)
    for out in outs:
        runs = {}
        for d in sorted(Path(out).iterdir()):
            m = RUN.match(d.name)
            if m and (d / "trace.h5").exists():
                runs[(int(m[1]), m[2], int(m[3]), m[4])] = d
        for (rnd, cfg, m, sched), d in runs.items():
            ref = runs.get((rnd, cfg, m, "1f1b"))
            if sched.endswith("-cont") and ref is not None:
                got[(cfg, m, sched)].append(medians(d) / medians(ref) - 1)
    return got


def main() -> int:
    outs = sys.argv[1:]
    if not outs or not all(Path(o).is_dir() for o in outs):
        sys.exit("usage: python experiments/noflush_units.py OUT [OUT ...] (folders written by "
                 "experiments/noflush_ab.sh)")
    got = ratios(outs)
    if not got:
        sys.exit(f"no continuous run with its round's 1F1B run in {', '.join(outs)}")
    print("median F and B against the same round's 1F1B, per rank: mean over rounds "
          "[min..max] (rounds slower)")
    print(f"{'config':6s} {'m':>2s} {'schedule':20s} {'rank':>4s} {'F':>26s} {'B':>26s}")
    for (cfg, m, sched), rs in sorted(got.items()):
        rs = np.array(rs)  # rounds x ranks x (F, B)
        for r in range(rs.shape[1]):
            cells = []
            for k in (0, 1):
                x = 100 * rs[:, r, k]
                cells.append(f"{x.mean():+6.1f}% [{x.min():+4.0f}..{x.max():+4.0f}] "
                             f"({int((x > 0).sum())}/{len(x)})")
            print(f"{cfg:6s} {m:2d} {sched:20s} {r:4d} {cells[0]:>26s} {cells[1]:>26s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
