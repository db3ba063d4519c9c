"""Python function calls per training step, 1F1B against the continuous schedules (load-free).

usage: python experiments/noflush_calls.py [OUT] [--cfg tiny|mlp] [-m M] [--steps N] [--top K]

Runs each of 1F1B, continuous PipeDream and continuous 2BW (pp = 2, ``--layout auto``, as
``noflush_ab.sh`` does) with ``cProfile`` switched on inside ``Trainer.train_step`` only, from
step 2 on (step 0 of a continuous run builds its lists; step 1 starts the lagged reductions), so
the counts are those of the measured steps: the per-step work of the training loop, the executor,
the stash and the optimizer, and nothing of start-up or the dump. Prints per rank the calls per
step of each schedule and, for each continuous one, the functions whose calls per step differ
most from 1F1B's (call counts depend on the code, not on the machine's load: run it anywhere).
About 20 s per configuration on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCHEDS = ("1f1b", "pipedream-cont", "pipedream-2bw-cont")
FIRST = 2  # the first profiled step


def _worker(out: str, argv: list[str]) -> int:
    """Inside mpiexec: train with ``train_step`` profiled from step ``FIRST`` on; each rank
    writes OUT/prof.RANK."""
    import cProfile

    from mpipar import cli
    from mpipar.training.trainer import Trainer

    prof, plain = cProfile.Profile(), Trainer.train_step

    def train_step(self, until=None):
        if self.step < FIRST:
            return plain(self, until)
        prof.enable()
        try:
            return plain(self, until)
        finally:
            prof.disable()

    Trainer.train_step = train_step
    try:
        return cli.main(argv)
    finally:
        prof.dump_stats(f"{out}/prof.{cli.launcher_rank() or 0}")


def _run(out: Path, cfg: str, m: int, sched: str, steps: int, data: Path | None) -> None:
    kind = sched.removesuffix("-cont")
    args = ["train", "--config", str(HERE / "configs" / f"{cfg}.toml"), "--out", str(out / "run"),
            "--pp", "2", "--microbatches", str(m), "--schedule", kind,
            "--set", f"parallel.continuous={str(kind != sched).lower()}", "--layout", "auto",
            "--steps", str(steps), "--quiet", "--set", "train.eval_interval=0"]
    if data is not None:
        args[3:3] = ["--data", str(data)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                        "PYTHONPATH": os.environ.get("PYTHONPATH", str(HERE.parent))}
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["mpiexec", "-n", "2", sys.executable, __file__, "--worker", str(out), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")


# the per-step work a continuous schedule adds, by the function that does it
WORK = {("parallel/pipeline/stash.py", "_bind"): "weight swaps (a chunk's parameters rebound)",
        ("parallel/pipeline/stash.py", "_swapped"): "weight swaps inside F (generator resumes)",
        ("nn/flat.py", "copy"): "weight-version copies",
        ("~", "<method 'copy' of 'numpy.ndarray' objects>"): "arrays copied into new memory",
        ("~", "<method 'fill' of 'numpy.ndarray' objects>"): "gradient fills",
        ("nn/optim.py", "block"): "optimizer blocks (13 vector passes each)"}


def counts(path: Path, steps: int) -> dict:
    """{(file under mpipar or module, function): calls per profiled step}."""
    out = {}
    for (f, _, fn), v in pstats.Stats(str(path)).stats.items():
        key = (f.split("/mpipar/")[-1] if "/mpipar/" in f else Path(f).name, fn)
        out[key] = out.get(key, 0) + v[1] / steps
    return out


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        return _worker(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(prog="experiments/noflush_calls.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default="/tmp/noflush_calls")
    p.add_argument("--cfg", choices=("tiny", "mlp"), default="tiny")
    p.add_argument("-m", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    if a.steps <= FIRST:
        sys.exit(f"--steps must be above {FIRST} (steps 0..{FIRST - 1} are not profiled)")
    out = Path(a.out)
    data = None
    if a.cfg == "tiny":
        data = out / "pattern.h5"
        if not data.exists():
            out.mkdir(parents=True, exist_ok=True)
            from mpipar.datasets import prepare_synthetic
            prepare_synthetic(str(data), "pattern", 200000, 256, seed=1)
    n = a.steps - FIRST
    got = {}
    for s in SCHEDS:
        _run(out / s, a.cfg, a.m, s, a.steps, data)
        got[s] = [counts(out / s / f"prof.{r}", n) for r in (0, 1)]
    print(f"{a.cfg} m={a.m}, pp=2: Python calls per step (steps {FIRST}..{a.steps - 1})")
    for s in SCHEDS:
        print(f"  {s:20s} " + "  ".join(f"rank {r}: {sum(c.values()):8.0f}"
                                         for r, c in enumerate(got[s])))
    print("\nweight-version and optimizer work per step (rank 0 / rank 1)")
    for key, what in WORK.items():
        print(f"  {what:44s} " + "  ".join(
            f"{s}: " + " / ".join(f"{c.get(key, 0):.1f}" for c in got[s]) for s in SCHEDS))
    for s in SCHEDS[1:]:
        for r in (0, 1):
            ref, mine = got[SCHEDS[0]][r], got[s][r]
            diff = sorted(((mine.get(k, 0) - ref.get(k, 0), k) for k in set(ref) | set(mine)),
                          key=lambda x: -abs(x[0]))
            print(f"\n{s}, rank {r}: calls per step against 1f1b (most different first)")
            for d, (f, fn) in diff[:a.top]:
                print(f"  {d:+8.1f}  {ref.get((f, fn), 0):7.1f} -> {mine.get((f, fn), 0):7.1f}  "
                      f"{f}:{fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
