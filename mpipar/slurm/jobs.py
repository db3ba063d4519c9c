"""Talking to Slurm: submit, job states, wait, cancel, error text, and collecting results."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .spec import ACTIVE_STATES, NO_SBATCH, OK_STATES, SlurmError

# ---- talking to Slurm ----------------------------------------------------------------------

def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if name == "sbatch":
            raise SlurmError(NO_SBATCH)
        raise SlurmError(f"{name} not found: run this on a Slurm login node")
    return path


def submit(script: str, script_path: Path, env: dict | None = None) -> str:
    """Write `script` to `script_path`, sbatch it; returns the job id (array: the array job id)."""
    sbatch = _tool("sbatch")
    script_path.parent.mkdir(parents=True, exist_ok=True)
    script_path.write_text(script)
    proc = subprocess.run([sbatch, "--parsable", str(script_path)], capture_output=True,
                          text=True, env=env, timeout=60)
    if proc.returncode != 0:
        raise SlurmError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]  # --parsable prints "jobid[;cluster]"


def _registry() -> Path:
    """Where `submit` notes each job's run root, so `collect JOB` needs no --run-root again."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "mpipar" / "slurm_jobs.tsv"


def remember(job_id: str, run_root) -> None:
    """Note that job ``job_id`` writes under ``run_root`` (best effort: a read-only home only
    means `collect` needs --run-root)."""
    try:
        path = _registry()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(f"{job_id}\t{Path(run_root).resolve()}\n")
    except OSError:
        pass


def run_root_of(job_id: str) -> str | None:
    """The run root `submit` noted for ``job_id`` (an array task: its array job's), or None."""
    job = str(job_id).split("_")[0]
    try:
        lines = _registry().read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        jid, _, root = line.partition("\t")
        if jid == job and root:
            return root
    return None


@dataclass
class JobState:
    job_id: str  # "123", or "123_4" for an array task
    state: str
    exit_code: str  # "rc:signal"
    reason: str = ""
    stdout: str = ""
    stderr: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def failed(self) -> bool:
        return not self.active and self.state not in OK_STATES


def _parse_scontrol(line: str) -> dict:
    # `scontrol show job -o`: space-separated Key=Value pairs; a value may itself hold spaces.
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"(\w[\w:/]*)=(.*?)(?=\s\w[\w:/]*=|$)", line)}


def _task_order(state: "JobState"):
    # scontrol lists array tasks newest first; show them in task order (pending ranges last).
    task = state.job_id.partition("_")[2]
    return (0, int(task)) if task.isdigit() else (1, 0) if task else (-1, 0)


def job_states(job_id: str, env: dict | None = None) -> list[JobState]:
    """State of a job (every task of an array). Empty when Slurm no longer knows the job."""
    scontrol = _tool("scontrol")
    proc = subprocess.run([scontrol, "show", "job", "-o", str(job_id)], capture_output=True,
                          text=True, env=env, timeout=30)
    states = []
    if proc.returncode == 0:
        for line in proc.stdout.splitlines():
            if not line.strip():
                continue
            f = _parse_scontrol(line)
            jid = f.get("JobId", "")
            if f.get("ArrayJobId") and f.get("ArrayTaskId"):
                jid = f"{f['ArrayJobId']}_{f['ArrayTaskId']}"
            states.append(JobState(jid, f.get("JobState", "UNKNOWN"), f.get("ExitCode", ""),
                                   f.get("Reason", ""), f.get("StdOut", ""), f.get("StdErr", "")))
        return sorted(states, key=_task_order)
    if "Invalid job id" not in proc.stderr:
        raise SlurmError(f"scontrol show job {job_id} failed: {proc.stderr.strip()}")
    # scontrol forgets a job MinJobAge after it ends; accounting (sacct) remembers it
    states = _sacct_states(job_id, env)
    if states:
        return states
    # Fall back to squeue (jobs still listed with -t all), e.g. when scontrol lost the record.
    squeue = _tool("squeue")
    proc = subprocess.run([squeue, "-h", "-t", "all", "-j", str(job_id), "-o", "%i|%T|%r"],
                          capture_output=True, text=True, env=env, timeout=30)
    for line in proc.stdout.splitlines():
        jid, state, reason = (line.split("|") + ["", ""])[:3]
        states.append(JobState(jid.strip(), state.strip(), "", reason.strip()))
    return states


def _sacct_states(job_id: str, env: dict | None) -> list[JobState]:
    """The job's allocations as sacct knows them; empty without accounting (or sacct)."""
    sacct = shutil.which("sacct")
    if sacct is None:
        return []
    proc = subprocess.run([sacct, "-n", "-P", "-X", "-j", str(job_id),
                           "-o", "JobID,State,ExitCode,Reason"], capture_output=True, text=True,
                          env=env, timeout=30)
    if proc.returncode != 0:
        return []
    states = []
    for line in proc.stdout.splitlines():
        jid, state, code, reason = (line.split("|") + ["", "", ""])[:4]
        if jid.strip():  # "CANCELLED by 0" -> CANCELLED
            states.append(JobState(jid.strip(), (state.split() or ["UNKNOWN"])[0], code.strip(),
                                   reason.strip()))
    return sorted(states, key=_task_order)


def wait(job_id: str, timeout: float, env: dict | None = None,
         poll: float = 0.25) -> list[JobState]:
    """Poll until every task of the job has ended (sbatch --wait polls too slowly)."""
    deadline = time.monotonic() + timeout
    while True:
        states = job_states(job_id, env)
        if states and not any(s.active for s in states):
            return states
        if time.monotonic() > deadline:
            raise SlurmError(f"job {job_id} still {', '.join(sorted({s.state for s in states}))} "
                             f"after {timeout:.0f} s (scancel {job_id} to stop it)")
        time.sleep(poll)


def cancel(job_id: str, env: dict | None = None) -> None:
    proc = subprocess.run([_tool("scancel"), str(job_id)], capture_output=True, text=True,
                          env=env, timeout=30)
    if proc.returncode != 0:
        raise SlurmError(f"scancel {job_id} failed: {proc.stderr.strip()}")


def error_text(state: JobState, lines: int = 15) -> str:
    """The last lines of a job's stderr file (the batch log), where a failure says why."""
    path = Path(state.stderr or state.stdout)
    if not state.stderr and not state.stdout:
        return ""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def collect(run_root: str | Path, job_id: str, states: list | None = None) -> list[dict]:
    """Results of a job (or each task of an array) under run_root: slurm_job.json+metrics.json,
    the exit code the script recorded, and a state and reason. ``states``: what Slurm knows of
    the job (``job_states``), when it can be asked: a task that never created its run directory
    still gets a row, and a job killed before writing its exit code (cancelled, timed out)
    shows Slurm's state instead of RUNNING?."""
    known = {s.job_id: s for s in states or []}
    rows = []
    for tag, d in _run_dirs(Path(run_root), str(job_id)):
        row: dict = {"job": tag, "run_dir": str(d)}
        for name in ("slurm_job.json", "metrics.json"):
            if (d / name).exists():
                try:
                    row.update(json.loads((d / name).read_text()))
                except (OSError, ValueError):
                    pass
        row["job"] = tag
        row["trace"] = str(d / "trace.h5") if (d / "trace.h5").exists() else None
        row["exit_code"], row["state"] = _exit_state(d)
        slurm_state = known.pop(tag, None)
        if slurm_state is not None and (slurm_state.active or row["exit_code"] is None):
            row["state"] = slurm_state.state  # running again (requeued), or killed by Slurm
        row["reason"] = _reason(Path(run_root), tag, row, slurm_state)
        rows.append(row)
    for tag, st in known.items():  # never created its run directory
        rows.append({"job": tag, "run_dir": None, "trace": None, "exit_code": None,
                     "state": st.state, "reason": ("" if st.active else
                                                   _log_error(Path(run_root), tag, st))
                     or _never_started(st)})
    return sorted(rows, key=lambda r: _task_order(JobState(r["job"], "", "")))


def _run_dirs(root: Path, job_id: str):
    """(job tag, run directory) of the job's runs: RUN_ROOT/<jobid>[_<task>] or a RUN_NAME
    directory whose slurm_job.json names the job."""
    found = {}
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not d.is_dir():
            continue
        tag = d.name
        try:
            tag = str(json.loads((d / "slurm_job.json").read_text()).get("job", tag))
        except (OSError, ValueError, AttributeError):
            pass
        if tag == job_id or tag.startswith(f"{job_id}_"):
            found[tag] = d
    return found.items()


def _never_started(st: JobState) -> str:
    if st.active:
        return st.reason if st.reason not in ("", "None") else "not started yet"
    return f"never started its run directory ({st.reason or 'no reason given'})"


def failed_rows(rows: list[dict]) -> list[dict]:
    """The rows of tasks that ended without completing (exit non-zero, killed, never ran)."""
    return [r for r in rows if r["state"] not in OK_STATES | ACTIVE_STATES | {"RUNNING?"}]


def _reason(root: Path, tag: str, row: dict, st: JobState | None) -> str:
    """Why a task did not complete: the last error line of its log, else Slurm's reason."""
    if row["state"] in OK_STATES or row["state"] in ACTIVE_STATES or row["state"] == "RUNNING?":
        return ""
    text = _log_error(root, tag, st)
    if text:
        return text
    if st is not None and st.reason not in ("", "None"):
        return st.reason
    return EXIT_REASONS.get(row["exit_code"], "")


def _log_error(root: Path, tag: str, st: JobState | None) -> str:
    """The last error line of the task's log (the rendered scripts' RUN_ROOT/slurm-<tag>.out,
    else the StdErr Slurm names), or ""."""
    for log in (root / f"slurm-{tag}.out", Path(st.stderr) if st and st.stderr else None):
        try:
            lines = log.read_text(errors="replace").splitlines() if log else []
        except OSError:
            continue
        for line in reversed(lines):
            if "error" in line.lower() or line.startswith("[mpipar] rank"):
                return " ".join(line.split())
    return ""


# the codes of `mpipar train` (mpipar.mpi.job.failfast.EXIT_*) as a state a table can show
EXIT_STATES = {0: "COMPLETED", 75: "PREEMPTED", 124: "STALLED"}
EXIT_REASONS = {75: "stopped by the warning signal, checkpoint written: resubmit to resume",
                124: "the watchdog: no progress for run.watchdog_s", 2: "bad input"}


def _exit_state(run_dir: Path) -> tuple[int | None, str]:
    """(exit code, state) the batch script recorded in run_dir/slurm_exit; RUNNING? when it has
    not (still running, or the job was killed before it could write it)."""
    try:
        code = int((run_dir / "slurm_exit").read_text().strip())
    except (OSError, ValueError):
        return None, "RUNNING?"
    return code, EXIT_STATES.get(code, "FAILED")
