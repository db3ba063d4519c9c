"""Soak: resident memory (RSS) of every rank against steps, with tracing on, on 1 and 2 ranks.

A small MLP trains for ``--steps`` (default 10,000) with the timing dump flushed every 50 steps
(``run.flush_interval``); 2 ranks run it as a 2-stage pipeline (2 micro-batches), so the dump
also holds send/receive events. While a run goes, this script reads each rank's VmRSS from
/proc whenever rank 0 prints its progress (every ``--every`` steps) and prints one table: RSS per
rank (MiB) against the step. With flushes appending only the new events (docs/dump_schema.md),
the columns should stay flat after the first samples; before, every event was kept and each
flush re-gathered the whole history. Linux only (/proc). ``--quick``: 300 steps.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

NAME = "soak"
STEP_RE = re.compile(r"step (\d+)/(\d+)")
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def _children() -> dict:
    """{parent pid: [child pids]} of every process now running."""
    tree = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def rank_rss(root_pid: int) -> dict:
    """{world rank: RSS in MiB} of the mpipar processes below ``root_pid`` (the mpiexec)."""
    tree, out, todo = _children(), {}, [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, []))
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"mpipar.cli" not in cmd:
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes()
                       .split(b"\0") if b"=" in kv)
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # it ended meanwhile
        rank = next((int(env[v.encode()]) for v in RANK_VARS if v.encode() in env), 0)
        rss = re.search(r"VmRSS:\s+(\d+) kB", status)
        if rss:
            out[rank] = int(rss.group(1)) / 1024
    return out


def soak(ranks: int, steps: int, every: int, run_dir: Path, timeout: float) -> dict:
    """Train on ``ranks`` ranks; return {step: {rank: RSS MiB}}."""
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "mpipar.cli", "train",
           "--out", str(run_dir), "--steps", str(steps), "--batch-size", "16",
           "--set", "model.kind=mlp", "--set", "model.sizes=[32,64,64,10]",
           "--set", "train.eval_interval=0", "--set", "run.trace=true",
           "--set", "run.flush_interval=50", "--set", f"run.log_interval={every}",
           "--set", "run.progress=true"]
    if ranks == 2:
        cmd += ["--pp", "2", "--microbatches", "2"]
    samples, tail = {}, []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=common.env(), cwd=common.ROOT, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            tail = (tail + [line])[-20:]
            m = STEP_RE.search(line)
            if m:
                samples[int(m.group(1))] = rank_rss(proc.pid)
            if time.monotonic() > deadline:
                raise common.ExperimentError(f"{ranks} ranks: timed out after {timeout:.0f} s "
                                             f"(raise --timeout)")
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and its ranks, nothing else
            proc.wait()
    if proc.returncode != 0:
        raise common.ExperimentError(f"{ranks} ranks: exit status {proc.returncode}: "
                                     f"{' '.join(cmd)}\n{''.join(tail)}")
    return samples


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--every", type=int, default=None,
                   help="steps between RSS samples (default steps / 20)")
    p.set_defaults(timeout=7200.0)
    args = p.parse_args(argv)
    steps = args.steps or (300 if args.quick else 10_000)
    every = args.every or max(1, steps // 20)
    out = common.out_dir(args, NAME)
    runs = {n: soak(n, steps, every, out / f"ranks{n}", args.timeout) for n in (1, 2)}
    columns = ["step", "1 rank: r0 MiB", "2 ranks: r0 MiB", "2 ranks: r1 MiB"]
    rows = []
    for step in sorted(set(runs[1]) | set(runs[2])):
        a, b = runs[1].get(step, {}), runs[2].get(step, {})
        rows.append({"step": step, columns[1]: a.get(0), columns[2]: b.get(0),
                     columns[3]: b.get(1)})
    common.write_results(out, f"RSS per rank against steps (flush every 50 steps, {steps} "
                              f"steps)", rows, columns, meta=common.machine_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
