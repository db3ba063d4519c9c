"""Write torch.distributed.pipelining's schedules as CSV files, for mpipar to load.

Needs torch (the ``bench`` extra, or a separate venv so the project's Python stays untouched):

    python3 -m venv --system-site-packages /work/wt/torchenv
    /work/wt/torchenv/bin/pip install torch==2.13.0
    /work/wt/torchenv/bin/python experiments/torch_schedules.py [--out experiments/data/torch]

No process group, no model: torch's multi-stage schedules compute their action lists in the
constructor from the stages' sizes alone, so light stand-in stages are enough. For every schedule
class below, at the (pp, microbatches) pairs listed, it writes ``<name>_pp<P>_m<M>.csv``
(compute only, torch's ``_dump_csv(format="compute_only")``) and, where torch lowers it,
``<name>_pp<P>_m<M>_comms.csv`` (with torch's sends and receives), plus ``versions.txt``.
The checked-in files are data: ``tests/test_torch_csv.py`` loads them, checks them with mpipar's
checker and the equivalence suite runs them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

CASES = [  # (torch class, mpipar name, stages per rank, [(pp, microbatches)])
    ("ScheduleLoopedBFS", "looped-bfs", 2, [(2, 4), (4, 4)]),
    ("ScheduleInterleaved1F1B", "interleaved", 2, [(2, 4), (4, 8)]),
    ("ScheduleInterleavedZeroBubble", "interleaved-zb", 2, [(2, 4), (4, 8)]),
    ("ScheduleZBVZeroBubble", "zb-v", 2, [(2, 4), (4, 8)]),
    ("ScheduleDualPipeV", "dualpipev", 2, [(2, 4), (4, 8)]),
]


class StandInStage:
    """What the schedules' constructors read from a pipeline stage, and nothing else."""

    def __init__(self, index, n_stages, rank, pp):
        self.stage_index, self.num_stages = index, n_stages
        self.group_rank, self.group_size = rank, pp
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.has_backward = True
        self.submod = None
        self.stage_index_to_group_rank = {}


def stages_of(rank, pp, per_rank, v_shape):
    n = pp * per_rank
    if v_shape:
        idx = [rank, 2 * pp - 1 - rank]
    else:
        idx = [rank + k * pp for k in range(per_rank)]
    return [StandInStage(i, n, rank, pp) for i in sorted(idx)]


def main():
    import torch
    import torch.distributed.pipelining.schedules as S

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data" / "torch"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for cls_name, name, per_rank, sizes in CASES:
        cls = getattr(S, cls_name)
        v_shape = name in ("zb-v", "dualpipev")
        for pp, m in sizes:
            stages = stages_of(0, pp, per_rank, v_shape)
            sched = cls(stages, n_microbatches=m, loss_fn=lambda a, b: a)
            base = out / f"{name}_pp{pp}_m{m}"
            sched._dump_csv(str(base) + ".csv", format="compute_only")
            written.append(base.name + ".csv")
            if getattr(sched, "pipeline_order_with_comms", None):
                sched._dump_csv(str(base) + "_comms.csv", format="compute_comms")
                written.append(base.name + "_comms.csv")
    (out / "versions.txt").write_text(f"torch {torch.__version__}\n" + "\n".join(written) + "\n")
    print("\n".join(written))


if __name__ == "__main__":
    main()
