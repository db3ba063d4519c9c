"""The batch scripts: one bash body for the rendered scripts and the checked-in templates."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path

from .spec import JobSpec, SlurmError, allocation, sweep_line

_HEADER = """\
#!/bin/bash
# {title}
# {origin}
"""

_SETTINGS_DOC = """\
# ---- run settings {how} ----
# CONFIG        training config (TOML)               DP, PP, TP   the parallel grid
# SCHEDULE      pipeline schedule (empty: config's)  MICROBATCHES, STEPS (empty: config's)
# EXTRA_ARGS    more `mpipar train` flags; arguments after the script name are appended too
# RUN_ROOT      each job writes RUN_ROOT/<jobid> (arrays: RUN_ROOT/<arrayjobid>_<taskid>)
# RUN_NAME      write RUN_ROOT/<RUN_NAME> (arrays: <RUN_NAME>_<taskid>) instead: a resubmitted
#               job with the same name resumes there (--resume auto); empty: the job id
# LAUNCHER      srun (PMI-2, default) or mpiexec (MPICH Hydra / Open MPI inside the allocation)
# DEVICE        empty (config's device) or cuda (one rank per GPU: --gpus-per-task=1)
# MPIPAR_CUDA_AWARE=1  CuPy arrays go straight to a CUDA-aware MPI (also sets
#               MPICH_GPU_SUPPORT_ENABLED=1 for Cray MPICH; Open MPI+UCX: export OMPI_MCA_pml=ucx
#               yourself); unset or 0: staged through host memory
# MPIPAR        the mpipar command; rendered scripts: the absolute python that rendered them
#               ("/abs/python -m mpipar.cli"), so the job never depends on the submitter's PATH
# VENV          a virtual environment the script activates first (empty: none)
# MPIEXEC       the mpiexec of LAUNCHER=mpiexec (rendered: absolute, found at render time)
# REQUEUE       1: a job stopped by the warning signal (--signal=B:USR1@S, forwarded to the
#               ranks: checkpoint, exit 75) requeues itself and resumes (--resume auto); 0: ends
# SRUN_NOLOCAL  auto|1|0: 1 exports MPIR_CVAR_NOLOCAL=1 for srun launches. The PyPI mpich wheel
#               under Slurm's PMI-2 disagrees between ranks on which peers share the node and
#               aborts in MPI_Init ("Message truncated") or hangs; NOLOCAL sends all traffic
#               through the network module (UCX still uses shared memory on one node).
#               auto: 1 when the python of MPIPAR has the PyPI `mpich` package, else 0
# SWEEP_FILE    (job arrays) one grid per line, e.g. "dp=2 pp=2 tp=1 schedule=1f1b microbatches=4";
#               array task i runs line i (0-based, blank and '#' lines skipped)
"""

# The part every script shares. Plain bash, readable on its own (slurm/README.md explains it).
_BODY = r"""
set -euo pipefail
die() { echo "mpipar-slurm: error: $*" >&2; exit 2; }

# ---- job arrays: this task's grid comes from its line of the sweep --------------------------
if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
    if [ ${#SWEEP_LINES[@]} -eq 0 ] && [ -n "${SWEEP_FILE:-}" ]; then
        [ -r "$SWEEP_FILE" ] || die "SWEEP_FILE $SWEEP_FILE is not readable"
        mapfile -t SWEEP_LINES < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$SWEEP_FILE")
    fi
    if [ ${#SWEEP_LINES[@]} -gt 0 ]; then
        line=${SWEEP_LINES[$SLURM_ARRAY_TASK_ID]:-}
        [ -n "$line" ] || die "array task $SLURM_ARRAY_TASK_ID has no line in the sweep" \
            "(${#SWEEP_LINES[@]} grids): submit with --array=0-$((${#SWEEP_LINES[@]} - 1))"
        for kv in $line; do
            case ${kv%%=*} in
                dp) DP=${kv#*=} ;;
                pp) PP=${kv#*=} ;;
                tp) TP=${kv#*=} ;;
                schedule) SCHEDULE=${kv#*=} ;;
                microbatches) MICROBATCHES=${kv#*=} ;;
                steps) STEPS=${kv#*=} ;;
                *) die "unknown key '${kv%%=*}' in sweep line '$line'" \
                       "(known: dp pp tp schedule microbatches steps)" ;;
            esac
        done
    fi
fi

# ---- the Python that runs mpipar: never the submitting shell's PATH by accident ----------------
if [ -n "${VENV:-}" ]; then
    [ -r "$VENV/bin/activate" ] || die "VENV=$VENV has no bin/activate"
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
fi
# shellcheck disable=SC2086
$MPIPAR --help >/dev/null 2>&1 || die "MPIPAR='$MPIPAR' does not run here: set" \
    "MPIPAR='/abs/path/python -m mpipar.cli' or VENV=/path/to/venv (mpipar slurm render does)"

[ -n "$CONFIG" ] || die "CONFIG is not set:" \
    "export CONFIG=path/to/config.toml (or sbatch --export=ALL,CONFIG=...)"
for var in DP PP TP MICROBATCHES STEPS; do
    value=${!var}
    if [ -n "$value" ] && ! [[ $value =~ ^[1-9][0-9]*$ ]]; then
        die "$var must be a positive integer, got '$value'"
    fi
done
NP=$((DP * PP * TP))
NTASKS=${SLURM_NTASKS:-$NP}
[ "$NP" -le "$NTASKS" ] || die "grid dp=$DP x pp=$PP x tp=$TP needs $NP ranks but this" \
    "allocation has $NTASKS tasks: submit with --ntasks=$NP (mpipar slurm render sizes it for you)"

# ---- where this job writes: RUN_ROOT/<jobid> --------------------------------------------------
if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then
    JOB_TAG=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
else
    JOB_TAG=${SLURM_JOB_ID:-local$$}
fi
case $RUN_ROOT in /*) ;; *) RUN_ROOT=${SLURM_SUBMIT_DIR:-$PWD}/$RUN_ROOT ;; esac
# RUN_NAME: a directory a resubmitted job finds again (--resume auto continues there)
case $RUN_NAME in */*|..) die "RUN_NAME must be a plain name, got '$RUN_NAME'" ;; esac
RUN_DIR=$RUN_ROOT/${RUN_NAME:-$JOB_TAG}
[ -z "$RUN_NAME" ] || RUN_DIR=$RUN_DIR${SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR/slurm_exit"  # a requeued or resubmitted incarnation: the old code is stale

# ---- per-rank threads: BLAS uses the CPUs Slurm gave each task, no more -------------------------
CPUS=${SLURM_CPUS_PER_TASK:-1}
export OMP_NUM_THREADS=$CPUS OPENBLAS_NUM_THREADS=$CPUS MKL_NUM_THREADS=$CPUS

# ---- GPUs: one rank per GPU; CUDA-aware MPI only when asked for --------------------------------
GPU_FLAGS=()
if [ "$DEVICE" = cuda ]; then
    GPU_FLAGS=(--gpus-per-task=1)
    if [ "${MPIPAR_CUDA_AWARE:-0}" = 1 ]; then
        export MPIPAR_CUDA_AWARE=1
        export MPICH_GPU_SUPPORT_ENABLED=1  # Cray MPICH: allow device pointers
    fi
fi

# ---- the command ----------------------------------------------------------------------------
# shellcheck disable=SC2206  # MPIPAR and EXTRA_ARGS are split into words on purpose
# --resume auto: a requeued job continues from its run directory's latest checkpoint
cmd=($MPIPAR train --config "$CONFIG" --dp "$DP" --pp "$PP" --tp "$TP" --resume auto)
[ -z "$SCHEDULE" ] || cmd+=(--schedule "$SCHEDULE")
[ -z "$MICROBATCHES" ] || cmd+=(--microbatches "$MICROBATCHES")
[ -z "$STEPS" ] || cmd+=(--steps "$STEPS")
[ -z "$DEVICE" ] || cmd+=(--device "$DEVICE")
# shellcheck disable=SC2206
cmd+=(--out "$RUN_DIR" $EXTRA_ARGS "$@")

cat > "$RUN_DIR/slurm_job.json" <<EOF
{"job": "$JOB_TAG", "dp": $DP, "pp": $PP, "tp": $TP, "schedule": "$SCHEDULE",
 "microbatches": ${MICROBATCHES:-null}, "steps": ${STEPS:-null}, "ranks": $NP,
 "launcher": "$LAUNCHER", "nodes": "${SLURM_JOB_NODELIST:-}", "cpus_per_task": $CPUS,
 "device": "$DEVICE"}
EOF
echo "mpipar-slurm: job $JOB_TAG: $NP ranks (dp=$DP pp=$PP tp=$TP) via $LAUNCHER -> $RUN_DIR"
echo "mpipar-slurm: ${cmd[*]}"

# ---- run, forwarding the warning signal; exit codes (docs: slurm/README.md) -----------------
# 0 done, 2 bad input / handled error, 1 a bug, 75 stopped by the signal (checkpoint written),
# 124 the watchdog, 128+n killed by signal n. The code is also written to RUN_DIR/slurm_exit.
PREEMPTED=0
forward() { PREEMPTED=1; [ -z "${pid:-}" ] || kill -USR1 "$pid" 2>/dev/null || true; }
trap forward USR1
set +e
case $LAUNCHER in
    srun)  # PMI-2: MPICH (incl. the PyPI wheel, see SRUN_NOLOCAL) and Slurm-aware Open MPI
        if [ "$SRUN_NOLOCAL" = auto ]; then  # asks the python that runs mpipar ($MPIPAR)
            SRUN_NOLOCAL=0
            py=$(command -v "${MPIPAR%% *}" || echo "${MPIPAR%% *}")
            case ${py##*/} in
                python*) ;;
                *) py=$(awk 'NR==1 { sub(/^#![ \t]*/, ""); print ($1 ~ /\/env$/ ? $2 : $1)
                             exit }' "$py" 2>/dev/null || true) ;;  # a script: its shebang
            esac
            if [ -n "$py" ] && "$py" -c 'import importlib.metadata as m; m.distribution("mpich")' \
                2>/dev/null; then SRUN_NOLOCAL=1; fi
        fi
        [ "$SRUN_NOLOCAL" = 0 ] || export MPIR_CVAR_NOLOCAL=1
        srun --mpi="${SRUN_MPI:-pmi2}" --ntasks="$NP" --cpus-per-task="$CPUS" \
            --kill-on-bad-exit=1 "${GPU_FLAGS[@]}" "${cmd[@]}" &
        pid=$! ;;
    mpiexec)  # Hydra / ORTE find the allocation themselves and start their daemons with srun
        "$MPIEXEC" -n "$NP" "${cmd[@]}" &
        pid=$! ;;
    *) die "LAUNCHER must be srun or mpiexec, got '$LAUNCHER'" ;;
esac
# `wait` returns early when the trap runs: wait again until the launcher has really ended
while :; do
    wait "$pid"
    rc=$?
    kill -0 "$pid" 2>/dev/null || break
done
set -e
echo "$rc" > "$RUN_DIR/slurm_exit"
name=${RUN_NAME:-${SLURM_ARRAY_JOB_ID:-$JOB_TAG}}
RESUBMIT="resubmit it with RUN_NAME=$name (sbatch --export=ALL,RUN_NAME=$name"
RESUBMIT+="${SLURM_ARRAY_TASK_ID:+ --array=$SLURM_ARRAY_TASK_ID} ..., or mpipar slurm submit"
RESUBMIT+=" --name $name ...): it resumes from $RUN_DIR"
echo "mpipar-slurm: job $JOB_TAG finished with exit code $rc"
if [ "$rc" = 75 ] && [ "$PREEMPTED" = 1 ] && [ "$REQUEUE" = 1 ]; then
    echo "mpipar-slurm: job $JOB_TAG stopped before its time limit: requeueing it (it resumes)"
    # slurmctld refuses a requeue while the job's last step is still completing: retry briefly
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        scontrol requeue "$JOB_TAG" 2>/dev/null && exit 0
        sleep 1
    done
    echo "mpipar-slurm: job $JOB_TAG could not be requeued: $RESUBMIT" >&2
elif [ "$rc" != 0 ] && [ "$rc" != 2 ] && [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    echo "mpipar-slurm: requeued job $JOB_TAG (restart ${SLURM_RESTART_COUNT}) failed with exit" \
        "code $rc; if srun said 'Job credential revoked', the job was released before the" \
        "steps of its previous run had ended (wait, do not force StartTime=now): $RESUBMIT" >&2
fi
exit $rc
"""


def _default_mpipar() -> str:
    # The python that renders the script is the one that has mpipar: absolute, so the job does
    # not depend on the PATH (or the venv) of the shell that submits it.
    return f"{shlex.quote(sys.executable)} -m mpipar.cli"


def _default_mpiexec() -> str:
    """The mpiexec next to the rendering python (a venv's, the PyPI mpich's), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    return str(Path(found).resolve()) if found else "mpiexec"


def _settings(values: dict, fixed: bool) -> str:
    """Settings lines: fixed (`DP=2`, rendered scripts) or environment-overridable defaults
    (`: "${DP:=1}"`, the checked-in templates). Rendered scripts ignore the environment on
    purpose: sbatch exports the submitter's whole environment, and a stray CONFIG or STEPS
    there must not silently change a job that was rendered with explicit choices."""
    if fixed:
        return "".join(f"{var}={shlex.quote(str(value)) if value != '' else ''}\n"
                       for var, value in values.items())
    for value in values.values():  # template defaults are plain words: no quoting needed
        if re.search(r"[$`\\\"\t\n]", str(value)):  # spaces are fine inside "${X:=...}"
            raise SlurmError(f"template default {value!r} needs quoting")
    return "".join(f': "${{{var}:={value}}}"\n' for var, value in values.items())


def _sbatch_lines(options: list[tuple[str, object]]) -> str:
    return "".join(f"#SBATCH --{k}={v}\n" if v != "" else f"#SBATCH --{k}\n"
                   for k, v in options if v is not None)


def render(spec: JobSpec, mpipar: str | None = None) -> str:
    """The batch script for `spec` (a job array when spec.sweep is non-empty)."""
    if not spec.config:
        raise SlurmError("--config is required")
    if spec.launcher not in ("srun", "mpiexec"):
        raise SlurmError(f"launcher must be srun or mpiexec, got {spec.launcher!r}")
    if spec.srun_nolocal not in ("auto", "1", "0"):
        raise SlurmError(f"srun_nolocal must be auto, 1 or 0, got {spec.srun_nolocal!r}")
    if not isinstance(spec.cpus_per_task, int) or spec.cpus_per_task < 1:
        raise SlurmError(f"--cpus-per-task must be a positive integer, got {spec.cpus_per_task!r}")
    for name in ("dp", "pp", "tp", "microbatches", "steps"):
        value = getattr(spec, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise SlurmError(f"--{name} must be a positive integer, got {value!r}")
    if spec.name and (not re.fullmatch(r"[\w.+-]+", spec.name) or spec.name in (".", "..")):
        raise SlurmError(f"--name must be a plain name (letters, digits, . _ + -), got "
                         f"{spec.name!r}")
    if spec.time is not None and not re.fullmatch(r"(\d+-)?\d+(:\d{2}){0,2}", spec.time):
        raise SlurmError(f"--time must look like HH:MM:SS (or D-HH:MM:SS), got {spec.time!r}")
    alloc = allocation(spec.ranks, spec.gpus_per_node, spec.tasks_per_node, spec.nodes)
    gpu = spec.gpus_per_node is not None
    array = bool(spec.sweep)
    name = spec.job_name or ("mpipar-sweep" if array else "mpipar-train")
    log = f"{spec.run_root.rstrip('/')}/slurm-{'%A_%a' if array else '%j'}.out"
    options = [
        ("job-name", name),
        ("nodes", alloc.nodes),
        ("ntasks", alloc.ntasks),
        ("ntasks-per-node", alloc.tasks_per_node),
        ("cpus-per-task", spec.cpus_per_task),
        ("gpus-per-task", 1 if gpu else None),
        ("partition", spec.partition),
        ("time", spec.time),
        ("array", f"0-{len(spec.sweep) - 1}" if array else None),
        ("output", log),
        ("signal", f"B:USR1@{spec.signal_s}" if spec.signal_s else None),
        ("requeue", "") if spec.requeue else ("no-requeue", ""),
        ("open-mode", "append"),  # a requeued job adds to its log instead of replacing it
    ]
    grid = f"dp={spec.dp} pp={spec.pp} tp={spec.tp}" if not array else \
        f"{len(spec.sweep)} grids, allocation sized for the largest ({alloc.ntasks} ranks)"
    kind = "sweep (job array)" if array else "training job"
    text = _HEADER.format(title=f"mpipar {kind}: {grid}",
                          origin="rendered by `mpipar slurm render`; the log directory "
                                 f"({spec.run_root}) must exist before sbatch "
                                 "(`mpipar slurm submit` creates it)")
    text += _sbatch_lines(options)
    text += "\n" + _SETTINGS_DOC.format(how="(as rendered; edit here, not via the environment)")
    text += _settings(fixed=True, values={
        "CONFIG": spec.config, "DP": spec.dp, "PP": spec.pp, "TP": spec.tp,
        "SCHEDULE": spec.schedule or "", "MICROBATCHES": spec.microbatches or "",
        "STEPS": spec.steps or "", "EXTRA_ARGS": spec.extra_args, "RUN_ROOT": spec.run_root,
        "RUN_NAME": spec.name,
        "LAUNCHER": spec.launcher, "DEVICE": "cuda" if gpu else "",
        "MPIPAR": mpipar or _default_mpipar(), "SRUN_NOLOCAL": spec.srun_nolocal,
        "VENV": "", "MPIEXEC": _default_mpiexec(), "REQUEUE": int(spec.requeue),
    })
    text += "SWEEP_LINES=(\n" + "".join(f"    {shlex.quote(sweep_line(e))}\n" for e in spec.sweep) \
        + ")\n" if array else "SWEEP_LINES=()\n"
    return text + _BODY


def render_static(kind: str) -> str:
    """The checked-in templates slurm/train.sbatch and slurm/sweep.sbatch (settings from env)."""
    if kind not in ("train", "sweep"):
        raise SlurmError(f"kind must be train or sweep, got {kind!r}")
    sweep = kind == "sweep"
    title = ("mpipar sweep: one array task per line of $SWEEP_FILE" if sweep
             else "mpipar training job: settings from the environment")
    usage = ("usage: SWEEP_FILE=grids.txt CONFIG=cfg.toml sbatch --array=0-<lines-1> "
             "--ntasks=<largest grid> slurm/sweep.sbatch" if sweep else
             "usage: CONFIG=cfg.toml DP=2 PP=2 TP=1 sbatch --ntasks=4 slurm/train.sbatch "
             "[more mpipar train flags]")
    text = _HEADER.format(title=title, origin=usage)
    text += ("# Generated from mpipar/slurm/render.py (render_static); edit there, then "
             "regenerate with\n")
    text += "#   python -c 'import mpipar.slurm as s; s.write_static()'\n"
    text += _sbatch_lines([("job-name", "mpipar-sweep" if sweep else "mpipar-train"),
                           ("ntasks", 1), ("cpus-per-task", 1), ("time", "00:30:00"),
                           ("signal", "B:USR1@90"), ("requeue", ""), ("open-mode", "append")])
    text += ("# GPU variant: add  --gpus-per-task=1 --ntasks-per-node=<GPUs per node>"
             "  and DEVICE=cuda\n")
    text += "\n" + _SETTINGS_DOC.format(how="(a variable set in the environment wins)")
    text += _settings(fixed=False, values={"CONFIG": "", "DP": 1, "PP": 1, "TP": 1, "SCHEDULE": "",
                       "MICROBATCHES": "", "STEPS": "", "EXTRA_ARGS": "", "RUN_ROOT": "runs/slurm",
                       "RUN_NAME": "",
                       "LAUNCHER": "srun", "DEVICE": "", "MPIPAR": "python3 -m mpipar.cli",
                       "SRUN_NOLOCAL": "auto", "VENV": "", "MPIEXEC": "mpiexec",
                       "REQUEUE": 1})
    if sweep:
        text += ': "${SWEEP_FILE:?set SWEEP_FILE to a file with one grid per line}"\n'
    text += "SWEEP_LINES=()\n"
    return text + _BODY


def write_static(directory: Path | None = None) -> None:
    directory = directory or Path(__file__).resolve().parents[2] / "slurm"
    for kind in ("train", "sweep"):
        (directory / f"{kind}.sbatch").write_text(render_static(kind))
