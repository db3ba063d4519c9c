"""Registered buffers (``Comm.registered_zeros``, ``mpipar/mpi/shm_registered.py``): the
zero-copy shared-memory all-reduce and reduce-scatter, and their place in the choice."""

import pytest
from mpi_util import python_script

from mpipar.mpi import tuning


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_registered_collectives_under_mpiexec(n):
    """Bitwise the rank-order reduction on every rank (float64 and float32, sum and mean, sizes
    not divisible by p, 0 and 1 element), blocking and overlapped, reduce-scatter (also into a
    block of its own input), disagreeing ranks raising on every rank, no copy window grown."""
    p = python_script(n, "coll_registered.py", timeout=300, check=True,
                      env={"MPIPAR_COLLECTIVES_TABLE": "/nonexistent"})
    assert p.stdout.count("coll_registered OK") == n, p.stdout


def test_registered_rows_choose_shm_sooner():
    for p in (2, 4):
        for kind, reg in tuning.REGISTERED.items():
            assert tuning.choose(reg, 8, p, tuned={}) == "library"
            assert tuning.choose(reg, 16 << 20, p, tuned={}) == "shm"
            assert tuning.choose(reg, 16 << 20, p, tuned={}, shm=False) == tuning.choose(
                kind, 16 << 20, p, tuned={}, shm=False)
    # 16 MiB on 2 ranks: plain arrays exchange halves; registered ones are reduced in place
    assert tuning.choose("allreduce", 16 << 20, 2, tuned={}) == "rabenseifner"


def test_registered_rows_in_tables():
    """--tune writes the registered rows like the others; a table tuned before they existed
    leaves them to the defaults."""
    table = tuning.validate(tuning.tuned_table(
        {"allreduce_registered": {2: [(1 << 20, {"library": 2.0, "shm": 1.0})]},
         "allreduce": {2: [(1 << 20, {"library": 1.0, "shm": 2.0})]}}, "mpich"))
    assert tuning.choose("allreduce_registered", 1 << 20, 2, tuned=table) == "shm"
    assert tuning.choose("allreduce", 1 << 20, 2, tuned=table) == "library"
    old = tuning.validate({"choices": {"allreduce": {"2": [[1 << 20, "library"]]}}})
    assert tuning.choose("reduce_scatter_registered", 16 << 20, 2, tuned=old) == "shm"
    with pytest.raises(ValueError, match="unknown collective 'allgather_registered'"):
        tuning.validate({"choices": {"allgather_registered": {}}})
