"""How steady this machine's speed is, and what that lets a timing comparison resolve.

A fixed piece of work is timed in short windows (``WINDOW_S``) for a few seconds, one BLAS
thread, nothing else running: a 256-wide float32 product, a small MLP's forward and backward
(32 rows, four 128-wide layers) and a Python dictionary loop, in turn, the kinds of work a
small model's step is made of. Each window's time per call is divided by the median of its
kind, so the kinds pool into one series of relative times.

Where the machine's speed is steady, the windows agree and the spread is near 1. On a virtual
machine whose host shares the physical core (a hyperthread sibling, another guest), the speed
can switch between two levels within a second, every kind of work at once (the 2-core VM of
``experiments/README.md`` section 10: 1.42x apart, the slow level 30 % of the time). Then a
run of a few seconds lands at either level, and no single run can be compared with a
prediction (or with another single run) more finely than the two levels are apart.
``summary`` says how far that goes:

- ``p10`` / ``p50`` / ``p90`` of the relative window time and ``spread`` = p90 / p10;
- ``slow_over_fast``: the two levels (two-means on the log of the window times, where the
  split explains ``SEPARATE`` of the variance; else one level, 1.0) and ``slow_share``, the
  fraction of windows at the slow one; ``dwell_s``, how long the machine stays at one level
  on average;
- per run length ``run_s``: ``cv``, std / mean of the mean window time over every stretch of
  that length in the series (a run of that length); ``within``, the share of those stretches
  within ``BOUND`` of the median stretch (a per-run bound of ``BOUND`` can hold at most that
  often, whatever predicts the run), ``within_median`` the same for the median of ``REPEATS``
  runs (stretches drawn at random: a row of ``experiments/plan_here.py``); ``pairs``, the
  interleaved A/B pairs of such runs for the 95 % interval of their mean ratio to be within
  ``EFFECT``, 2 (1.96 cv / EFFECT)^2 (the two runs of a pair independent).

``mpipar bench --steadiness`` prints it; ``mpipar plan measure`` writes it to the spec's
``[steadiness]`` section; ``experiments/plan_here.py`` prints it beside its tables.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mpipar.threads import VARS

from .errors import PlanError

WINDOW_S = 0.02  # one window: long enough for tens of calls, short against the levels' dwell
RUN_S = (0.5, 2.0, 5.0)  # run lengths the summary reads the series at
BOUND = 0.10  # a per-run bound (experiments/plan_here.py's step bound)
EFFECT = 0.05  # a difference an A/B comparison should resolve (issue bars of 5 %)
REPEATS, DRAWS = 3, 4000  # within_median: the median of REPEATS runs, DRAWS draws of them


def _work() -> dict:
    """{kind: a call of fixed work}: made once, the same data every call."""
    rng = np.random.default_rng(0)
    a, b = (rng.random((256, 256), dtype=np.float32) for _ in range(2))
    x = rng.random((32, 128), dtype=np.float32)
    ws = [rng.standard_normal((128, 128)).astype(np.float32) * 0.1 for _ in range(4)]

    def product():
        a @ b

    def small_mlp():
        h, kept = x, []
        for w in ws:
            h = np.maximum(h @ w, 0.0)
            kept.append(h)
        g = np.ones_like(h)
        for w, h in zip(reversed(ws), reversed(kept), strict=True):
            g = (g * (h > 0)) @ w.T

    def python():
        d = {}
        for i in range(300):
            d[i % 17] = d.get(i % 17, 0) + i

    return {"product": product, "small MLP": small_mlp, "Python": python}


def sample(seconds: float, window: float = WINDOW_S) -> dict:
    """{"start": s since the first window, "time": s per call, "kind": index into "kinds"} of
    every window timed over ``seconds``, the kinds in turn."""
    if seconds <= 0 or window <= 0:
        raise ValueError(f"seconds and window must be > 0, got {seconds}, {window}")
    work = _work()
    for fn in work.values():  # first calls (allocation, code warm-up) are not the machine's
        fn()
    fns = list(work.values())
    starts, times, kinds = [], [], []
    t_begin = time.perf_counter()
    while time.perf_counter() - t_begin < seconds or len(times) < 2 * len(fns):
        k = len(times) % len(fns)
        fn, n = fns[k], 0
        t0 = time.perf_counter()
        while True:
            fn()
            n += 1
            t1 = time.perf_counter()
            if t1 - t0 >= window:
                break
        starts.append(t0 - t_begin)
        times.append((t1 - t0) / n)
        kinds.append(k)
    return {"start": np.array(starts), "time": np.array(times), "kind": np.array(kinds),
            "kinds": list(work)}


def sample_one_thread(seconds: float, timeout: float | None = None) -> dict:
    """``sample`` in a child process started with one BLAS thread (BLAS reads its thread
    count at import, and this process may have imported it with more)."""
    code = ("import json; from mpipar.plan.steadiness import sample; "
            f"g = sample({float(seconds)!r}); "
            "print(json.dumps({k: (v.tolist() if hasattr(v, 'tolist') else v) "
            "for k, v in g.items()}))")
    env = dict(os.environ, **{v: "1" for v in VARS})
    # the child imports this checkout's mpipar, as its caller did (an experiment may run one
    # that is not the installed one)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    limit = timeout if timeout is not None else 60 + 2 * seconds
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=limit)
    except subprocess.TimeoutExpired:
        raise PlanError(f"the steadiness sample ({seconds:g} s) took over {limit:.0f} s: the "
                        "machine is too loaded to sample; run it alone") from None
    if done.returncode != 0:
        raise PlanError(f"the steadiness sample failed (exit {done.returncode}): "
                        f"{done.stderr.strip()[-500:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: (np.array(v) if k != "kinds" else v) for k, v in got.items()}


def measured(seconds: float, timeout: float | None = None) -> dict:
    """``summary`` of a ``sample_one_thread`` of ``seconds``."""
    return summary(sample_one_thread(seconds, timeout))


def report(summ: dict, when: str) -> str:
    """``lines`` under a heading saying when the sample was taken, indented, for a table."""
    return f"{when}:\n" + "\n".join("  " + line for line in lines(summ)) + "\n"


def relative(got: dict) -> np.ndarray:
    """Each window's time over the median of its kind's windows."""
    t, k = got["time"], got["kind"]
    out = np.empty_like(t)
    for kind in np.unique(k):
        sel = k == kind
        out[sel] = t[sel] / np.median(t[sel])
    return out


SEPARATE = 0.8  # two levels: the split explains this much of the log-time variance at least


def _two_levels(rel: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(fast, slow) centres of a two-means on log(rel) and the windows' labels (True: slow).
    One level (fast = slow, no window slow) unless the split explains ``SEPARATE`` of the
    variance: a single noisy level split in two explains 2 / pi of it (0.64)."""
    x = np.log(rel)
    lo, hi = np.percentile(x, 10), np.percentile(x, 90)
    slow = x > (lo + hi) / 2
    for _ in range(50):
        if slow.all() or not slow.any():
            break
        lo, hi = x[~slow].mean(), x[slow].mean()
        new = x > (lo + hi) / 2
        if (new == slow).all():
            break
        slow = new
    total = float(((x - x.mean()) ** 2).sum())
    if slow.all() or not slow.any() or total == 0.0:
        return 1.0, 1.0, np.zeros_like(slow)
    within = float(((x[slow] - hi) ** 2).sum() + ((x[~slow] - lo) ** 2).sum())
    if 1.0 - within / total < SEPARATE:
        one = math.exp(float(np.median(x)))
        return one, one, np.zeros_like(slow)
    return math.exp(lo), math.exp(hi), slow


def summary(got: dict, run_s=RUN_S, bound: float = BOUND, effect: float = EFFECT) -> dict:
    """What the windows of ``sample`` say (module doc): {"windows", "seconds", "p10", "p50",
    "p90", "spread", "slow_over_fast", "slow_share", "dwell_s", "runs": [{"run_s", "cv",
    "within", "pairs"}]} (a run length longer than the series is left out)."""
    rel = relative(got)
    start = got["start"]
    n = len(rel)
    period = float(np.median(np.diff(start))) if n > 1 else WINDOW_S
    fast, slow, is_slow = _two_levels(rel)
    switches = int(np.count_nonzero(is_slow[1:] != is_slow[:-1]))
    p10, p50, p90 = (float(np.percentile(rel, q)) for q in (10, 50, 90))
    runs = []
    for length in run_s:
        k = int(round(length / period))
        if k < 1 or k >= n:
            continue
        means = np.convolve(rel, np.ones(k) / k, mode="valid")  # every stretch of k windows
        cv = float(means.std() / means.mean())
        dev = np.abs(means / np.median(means) - 1.0)
        # the median of REPEATS runs at stretches drawn at random (a fixed seed: the same
        # windows give the same answer), as experiments/plan_here.py reports a row
        picks = np.random.default_rng(0).integers(0, len(means), size=(DRAWS, REPEATS))
        med = np.median(means[picks], axis=1)
        runs.append({"run_s": float(length), "cv": cv, "within": float(np.mean(dev <= bound)),
                     "within_median": float(np.mean(np.abs(med / np.median(means) - 1.0)
                                                    <= bound)),
                     "pairs": int(math.ceil(2 * (1.96 * cv / effect) ** 2))})
    return {"windows": n, "seconds": float(start[-1] - start[0] + period) if n else 0.0,
            "p10": p10, "p50": p50, "p90": p90, "spread": p90 / p10,
            "slow_over_fast": slow / fast, "slow_share": float(is_slow.mean()),
            "dwell_s": n * period / (switches + 1), "runs": runs,
            "bound": bound, "effect": effect}


def lines(s: dict) -> list[str]:
    """``summary`` as a short table."""
    out = [f"machine steadiness: {s['windows']} windows over {s['seconds']:.1f} s "
           f"(fixed work, one thread, kinds in turn)",
           f"  window time p10 / p50 / p90 (x median): {s['p10']:.3f} / {s['p50']:.3f} / "
           f"{s['p90']:.3f}; spread p90/p10 {s['spread']:.2f}",
           (f"  two levels {s['slow_over_fast']:.2f}x apart, the slow one "
            f"{100 * s['slow_share']:.0f} % of the windows, a level held {s['dwell_s']:.2f} s "
            "on average" if s["slow_share"] > 0 else "  one level (no two separate speeds)")]
    b, e = 100 * s["bound"], 100 * s["effect"]
    out.append(f"  {'run length':>10}  {'cv':>6}  {f'within {b:.0f} %':>12}  "
               f"{f'median of {REPEATS} within':>20}  {f'A/B pairs for {e:.0f} %':>18}")
    for r in s["runs"]:
        out.append(f"  {r['run_s']:>8.1f} s  {100 * r['cv']:>5.1f}%  {100 * r['within']:>11.0f}%"
                   f"  {100 * r['within_median']:>19.0f}%  {r['pairs']:>18}")
    return out


def spec_section(s: dict) -> dict:
    """The ``[steadiness]`` section of a measured spec (``mpipar plan measure``): read by no
    planner term; it says how finely runs on this machine can be checked against a plan."""
    out = {"spread": s["spread"], "slow_over_fast": s["slow_over_fast"],
           "slow_share": s["slow_share"], "dwell_s": s["dwell_s"]}
    for r in s["runs"]:
        tag = f"{r['run_s']:g}s".replace(".", "_")
        out[f"cv_{tag}"] = r["cv"]
        out[f"within_{tag}"] = r["within"]
    return out


def write_hdf5(path, got: dict, summ: dict) -> None:
    """The windows (start, time, kind) and the summary (attributes), written whole or not at
    all (``mpipar.files.atomic_h5``)."""
    from mpipar.files import atomic_h5

    with atomic_h5(path) as f:
        g = f.create_group("steadiness")
        for key in ("start", "time", "kind"):
            g.create_dataset(key, data=got[key])
        g.attrs["kinds"] = json.dumps(got["kinds"])
        g.attrs["summary"] = json.dumps(summ)
