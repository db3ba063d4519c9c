"""Run the real `mpipar train` with one fault injected on one rank before one step.

Run: mpiexec -n N python tests/mpi/fault_inject.py CASE RANK STEP TRAIN_ARGS...
The driver wraps ``Trainer.train_step`` (no test hooks in production code). CASE:
ConfigError DataError CheckpointError FileNotFoundError (the handled types), exit3
(``sys.exit(3)``), python (a plain RuntimeError), sigkill (the rank kills itself), rundir (the
run directory is moved away, so rank 0's next dump flush fails; the dump written so far stays
readable at <out>.moved), stall (the rank sleeps: the watchdog must end the job), usr1 (the
rank sends SIGUSR1 to itself only: every rank must still stop at the same step), usr1_start
(the rank sends SIGUSR1 to itself during the start, after MPI_Init, before any step: STEP is
ignored), term_twice (the rank sends SIGTERM to itself; then every rank sends itself another
while the preemption checkpoint is being written), fsize (the rank can write no file over 4 KiB
in its checkpoint files after step STEP: the next one fails as on a full disk), sigint (Ctrl-C:
the rank sends itself SIGINT; RANK -1: every rank, as Ctrl-C to the process group does), sigstop
(the rank stops itself: its own watchdog cannot fire, its peers' must name it).
Before the fault the rank prints ``fault_inject: CASE rank R step S at <unix time>`` to stderr.
"""

import os
import shutil
import signal
import sys
import time

from mpi4py import MPI

from mpipar.checkpoint import CheckpointError
from mpipar.cli import main
from mpipar.config import ConfigError
from mpipar.datasets import DataError
from mpipar.training.trainer import Trainer

case, rank, at, train_args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
me = MPI.COMM_WORLD.Get_rank()
out = train_args[train_args.index("--out") + 1]
ERRORS = {"ConfigError": ConfigError, "DataError": DataError, "CheckpointError": CheckpointError,
          "FileNotFoundError": FileNotFoundError, "python": RuntimeError}


def inject():
    print(f"fault_inject: {case} rank {me} step {at} at {time.time():.3f}", file=sys.stderr,
          flush=True)
    if case in ERRORS:
        raise ERRORS[case](f"injected {case} on rank {me} at step {at}")
    if case == "exit3":
        sys.exit(3)
    if case == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if case == "rundir":
        shutil.move(out, out + ".moved")
    if case == "stall":
        time.sleep(3600)
    if case in ("usr1", "usr1_start"):
        os.kill(os.getpid(), signal.SIGUSR1)
    if case == "term_twice":
        os.kill(os.getpid(), signal.SIGTERM)
    if case == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if case == "sigint":
        os.kill(os.getpid(), signal.SIGINT)



real_step = Trainer.train_step
if case == "usr1_start":
    import mpipar.training as training

    real_preflight = training.preflight

    def preflight(*args, **kwargs):
        if me == rank:
            inject()
        return real_preflight(*args, **kwargs)

    training.preflight = preflight
if case == "term_twice":
    import mpipar.checkpoint as checkpoint

    real_save = checkpoint.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        print(f"fault_inject: second SIGTERM on rank {me}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs here, inside the window
        return real_save(*args, **kwargs)

    checkpoint.save_checkpoint = save_checkpoint
if case == "fsize":
    import resource

    import mpipar.checkpoint as checkpoint

    real_write_file = checkpoint._write_file

    def write_file(path, trainer, tensors):
        if trainer.step > at and me == rank:  # the disk is full: HDF5's own writes fail
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        return real_write_file(path, trainer, tensors)

    checkpoint._write_file = write_file


def train_step(self, *args, **kwargs):
    if self.step == at and rank in (me, -1):  # -1: every rank
        inject()
    return real_step(self, *args, **kwargs)


Trainer.train_step = train_step
sys.exit(main(["train", *train_args]))
