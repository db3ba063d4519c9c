"""How much slower a rank computes when more ranks than cores share a node: measured, not fitted.

``plan.sharing`` gives each of R ranks on C < R cores C / R of one. The dumps of the 8-block
GPT on 4 ranks and 2 cores show more: a rank without tp computes 2.0-2.8 x as long as the plan
of it on a core of its own (not 2.0), where its units on 2 ranks and 2 cores took 1.0-1.15 x.
Whatever costs the extra (the scheduler's switches, the caches the ranks evict from each
other), it is the machine's, so ``mpipar plan measure`` times it: the reference GPT chain
(``unit_bench.gpt_units`` at ``REF``: a step's forward and backward, ~50 ms a repeat) in one
process, then in ``2 C`` processes at once (one BLAS thread each, as the ranks run), and
``shared_slowdown`` = (the concurrent processes' median time per repeat) / (alone x 2C / C),
at least 1. ``sharing.core_share`` divides the share by it. A spec without it: 1.
"""

from __future__ import annotations

import json
import subprocess
import sys

from .errors import PlanError

REPEATS = 24  # chain repeats per process (the first left out): ~1.2 s alone, ~2.5 s shared
# each child imports and builds first, says so, and starts on the parent's word: the
# processes compute together, not one still importing while another runs
CHILD = (
    "import json, sys\n"
    "from mpipar.plan.unit_bench import REF, gpt_units\n"
    "gpt_units(*REF['gpt'], 0.0, None, 2)\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "totals = []\n"
    "gpt_units(*REF['gpt'], 0.0, totals, int(sys.argv[1]))\n"
    "print(json.dumps(sorted(totals)[len(totals) // 2]), flush=True)\n"
)


def _start(repeats: int, env: dict | None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(repeats)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)


def _median_repeat(procs: list[subprocess.Popen], timeout: float) -> list[float]:
    """Each process's median time per repeat, all of them started together once all are
    ready; a child that fails or a probe past ``timeout``: one PlanError, every child ended."""
    import threading

    timer = threading.Timer(timeout, lambda: [q.kill() for q in procs])
    timer.start()
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise PlanError(f"the shared-core probe failed: {_tail(p)}")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        out = []
        for p in procs:
            got = p.stdout.readline()
            if p.wait() != 0 or not got.strip():
                raise PlanError(f"the shared-core probe failed: {_tail(p)}")
            out.append(float(json.loads(got)))
        return out
    except PlanError:
        raise
    except (OSError, ValueError) as exc:
        raise PlanError(f"the shared-core probe failed: {exc}") from None
    finally:
        timer.cancel()
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()


def _tail(p: subprocess.Popen) -> str:
    if p.poll() is None:
        p.kill()
        p.wait()
    killed = p.returncode is not None and p.returncode < 0
    return ("killed: over the probe's time limit" if killed
            else f"exit {p.returncode}: {p.stderr.read()[-800:]}")


def shared_slowdown(cores: int, quick: bool = False, timeout: float = 300.0,
                    env: dict | None = None) -> float:
    """The factor by which ``2 cores`` processes computing at once are slower than the share
    ``cores / (2 cores)`` of one process alone gives (module doc); >= 1. ``env``: the
    children's environment (``measure.THREAD_ENV``: one BLAS thread, as a rank runs)."""
    import statistics

    repeats = 4 if quick else REPEATS
    alone = _median_repeat([_start(repeats, env)], timeout)[0]
    procs = [_start(repeats, env) for _ in range(2 * max(cores, 1))]
    shared = statistics.median(_median_repeat(procs, timeout))
    return max(shared / (alone * 2), 1.0)
