"""`mpipar slurm render|submit|status|cancel|collect`: training runs as Slurm batch jobs.

    mpipar slurm render --config C --dp 2 --pp 2 --tp 1 --tasks-per-node 4      # print the script
    JOB=$(mpipar slurm submit --config C --dp 2 --pp 2 --steps 20)               # sbatch it
    mpipar slurm submit --config C --sweep grids.txt                             # one job array
    mpipar slurm status $JOB [--wait]                                 # state, exit, error
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from mpipar import slurm

HELP = "render, submit and watch Slurm batch jobs for training runs (srun --mpi=pmi2)"


def _job_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="training config (TOML), as for `mpipar train`")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--schedule", help="pipeline schedule (default: the config's)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step (default: config's)")
    p.add_argument("--steps", type=int, help="training steps (default: the config's)")
    p.add_argument("--extra-args", default="", help="more `mpipar train` flags, one string")
    p.add_argument("--run-root", default="runs/slurm",
                   help="each job writes RUN_ROOT/<jobid>/ (arrays <jobid>_<task>); default "
                        "runs/slurm")
    p.add_argument("--name", default="",
                   help="write RUN_ROOT/NAME/ (arrays NAME_<task>) instead of RUN_ROOT/<jobid>/: "
                        "a job resubmitted with the same name resumes there")
    p.add_argument("--gpus-per-node", type=int,
                   help="GPU job: one rank per GPU (--gpus-per-task=1, --device cuda)")
    p.add_argument("--tasks-per-node", type=int, help="ranks per node (CPU jobs)")
    p.add_argument("--nodes", type=int, help="nodes to ask for (default: computed)")
    p.add_argument("--cpus-per-task", type=int, default=1,
                   help="CPUs (BLAS threads) per rank (default 1)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--time", help="time limit HH:MM:SS")
    p.add_argument("--job-name", help="job name (default mpipar-train / mpipar-sweep)")
    p.add_argument("--launcher", choices=("srun", "mpiexec"), default="srun",
                   help="srun --mpi=pmi2 (default) or mpiexec inside the allocation")
    p.add_argument("--srun-nolocal", choices=("auto", "1", "0"), default="auto",
                   help="export MPIR_CVAR_NOLOCAL=1 under srun (needed by the PyPI mpich wheel; "
                        "auto: when the job's python3 has it)")
    p.add_argument("--signal-s", type=int, default=90, metavar="S",
                   help="USR1 this many seconds before the time limit: the ranks checkpoint and "
                        "stop, the job requeues itself and resumes (default 90; 0: none)")
    p.add_argument("--no-requeue", action="store_true",
                   help="a job stopped by the signal ends (exit 75) instead of requeueing")
    p.add_argument("--sweep", type=Path,
                   help="file with one grid per line ('dp=2 pp=2 tp=1 schedule=1f1b "
                        "microbatches=4'): submits one job array")
    p.add_argument("--dry-run", action="store_true",
                   help="print the script (and the sbatch command) without submitting")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="slurm_command", metavar="ACTION", required=True)
    p = sub.add_parser("render", help="print the batch script for a run or a sweep")
    _job_arguments(p)
    p.add_argument("-o", "--output", type=Path, help="write the script here instead of stdout")
    p = sub.add_parser("submit", help="render and sbatch; prints the job id")
    _job_arguments(p)
    p.add_argument("--wait", action="store_true",
                   help="wait for the job to end; exit 1 when it (or any array task) failed")
    p.add_argument("--timeout", type=float, default=3600, help="seconds to --wait (default 3600)")
    p = sub.add_parser("status", help="state and exit code of a job (squeue/scontrol)")
    p.add_argument("job_id")
    p.add_argument("--wait", action="store_true", help="wait for the job to end first")
    p.add_argument("--timeout", type=float, default=3600, help="seconds to --wait (default 3600)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = sub.add_parser("cancel", help="scancel a job")
    p.add_argument("job_id")
    p = sub.add_parser("collect", help="list the results (metrics.json) of jobs or job arrays; "
                                       "exit 1 when a task failed or never ran")
    p.add_argument("job_id", nargs="+")
    p.add_argument("--run-root", default=None,
                   help="as given to submit (default: the one submit noted, else runs/slurm)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _spec(args) -> slurm.JobSpec:
    sweep = []
    if args.sweep is not None:
        if not args.sweep.is_file():
            raise slurm.SlurmError(f"sweep file {args.sweep} not found")
        sweep = slurm.parse_sweep(args.sweep.read_text(), source=str(args.sweep))
    return slurm.JobSpec(
        config=args.config, dp=args.dp, pp=args.pp, tp=args.tp, schedule=args.schedule,
        microbatches=args.microbatches, steps=args.steps, extra_args=args.extra_args,
        run_root=args.run_root, name=args.name, gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node, nodes=args.nodes, cpus_per_task=args.cpus_per_task,
        partition=args.partition, time=args.time, job_name=args.job_name,
        launcher=args.launcher, srun_nolocal=args.srun_nolocal, sweep=sweep,
        signal_s=args.signal_s, requeue=not args.no_requeue)


def _print_states(states: list[slurm.JobState], as_json: bool) -> None:
    if as_json:
        print(json.dumps([s.__dict__ | {"failed": s.failed} for s in states], indent=1))
        return
    print(f"{'JOBID':<14} {'STATE':<12} {'EXIT':<6} REASON")
    for s in states:
        print(f"{s.job_id:<14} {s.state:<12} {s.exit_code:<6} {s.reason}")
    for s in states:
        if s.failed:
            text = slurm.error_text(s)
            print(f"\n--- job {s.job_id} {s.state} (exit {s.exit_code}); end of {s.stderr}:",
                  file=sys.stderr)
            print(text or "(log empty or unreadable)", file=sys.stderr)


def run(args) -> int:
    try:
        return _run(args)
    except slurm.SlurmError as exc:
        print(f"mpipar slurm: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    action = args.slurm_command
    if action in ("render", "submit"):
        spec = _spec(args)
        script = slurm.render(spec)
        if action == "render":
            if args.output:
                args.output.write_text(script)
            else:
                sys.stdout.write(script)
            return 0
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(spec.run_root) / "scripts" / f"{spec.job_name or 'mpipar'}-{stamp}.sbatch"
        if args.dry_run:  # the script is written, so the printed command works as it stands
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(script)
            sys.stdout.write(script)
            print(f"# wrote {path}; to submit it: sbatch --parsable {path}", file=sys.stderr)
            return 0
        Path(spec.run_root).mkdir(parents=True, exist_ok=True)  # the log (#SBATCH --output) dir
        job_id = slurm.submit(script, path)
        slurm.remember(job_id, spec.run_root)
        print(job_id, flush=True)
        if not args.wait:
            return 0
        states = slurm.wait(job_id, args.timeout)
        _print_states(states, as_json=False)
        return 1 if any(s.failed for s in states) else 0
    if action == "status":
        states = (slurm.wait(args.job_id, args.timeout) if args.wait
                  else slurm.job_states(args.job_id))
        if not states:
            print(f"mpipar slurm: job {args.job_id} unknown to Slurm (finished long ago, or a "
                  "wrong id); its results are under RUN_ROOT/<jobid>", file=sys.stderr)
            return 2
        _print_states(states, args.json)
        return 1 if any(s.failed for s in states) else 0
    if action == "cancel":
        slurm.cancel(args.job_id)
        return 0
    if action == "collect":
        return _collect(args)
    raise slurm.SlurmError(f"unknown action {action}")


def _slurm_states(job_id: str) -> list:
    """What Slurm still knows of the job (nothing where Slurm cannot be asked)."""
    try:
        return slurm.job_states(job_id)
    except (slurm.SlurmError, OSError, subprocess.SubprocessError):
        return []


def _collect(args) -> int:
    rows = []
    for job in args.job_id:
        root = args.run_root or slurm.run_root_of(job) or "runs/slurm"
        found = slurm.collect(root, job, _slurm_states(job))
        if not found:
            raise slurm.SlurmError(f"no results for job {job} under {root} (pass --run-root as "
                                   f"given to submit)")
        rows += found
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _print_rows(rows)
    return 1 if slurm.failed_rows(rows) else 0


def _print_rows(rows: list[dict]) -> None:
    print(f"{'JOB':<14} {'state':<10} {'exit':>4} {'dp':>3} {'pp':>3} {'tp':>3} "
          f"{'schedule':<12} {'mb':>4} {'final_loss':>12} {'tokens/s':>10}  reason")
    for r in rows:
        loss, tps = r.get("final_loss"), r.get("tokens_per_s")
        code = "-" if r["exit_code"] is None else r["exit_code"]
        print(f"{r['job']:<14} {r['state']:<10} {code:>4} {r.get('dp', ''):>3} "
              f"{r.get('pp', ''):>3} {r.get('tp', ''):>3} {r.get('schedule') or '-':<12} "
              f"{r.get('microbatches') or '-':>4} "
              f"{'-' if loss is None else f'{loss:.6f}':>12} "
              f"{'-' if tps is None else f'{tps:.0f}':>10}  {r.get('reason', '')}")
