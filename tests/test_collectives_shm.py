"""The shared-memory collective algorithm (``mpipar/mpi/shm.py``) and its place in the choice."""

import math

import pytest
from mpi_util import assert_snippet_ok, python_script

from mpipar.mpi import shm, tuning


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_shm_collectives_under_mpiexec(n):
    """Bitwise the rank-order reduction, growth, chunks, disagreeing ranks (an error on every
    rank, not a hang), non-blocking posts, and the fallback where ranks span nodes."""
    p = python_script(n, "coll_shm.py", timeout=240, check=True,
                      env={"MPIPAR_COLLECTIVES_TABLE": "/nonexistent"})
    assert p.stdout.count("coll_shm OK") == n, p.stdout


def test_window_size_classes():
    assert shm.size_class(1) == shm.MIN_BYTES
    assert shm.size_class(shm.MIN_BYTES + 1) == 2 * shm.MIN_BYTES
    assert shm.size_class(3 << 20) == 4 << 20
    assert shm.size_class(1 << 40) == shm.MAX_BYTES  # larger messages go in chunks


def test_choice_offers_shm_only_on_one_node():
    big = 64 << 20
    for kind in tuning.DEFAULT:
        assert tuning.choose(kind, 8, 2, tuned={}) == "library"
        assert tuning.choose(kind, big, 4, tuned={}, shm=False) != "shm"
    for kind in ("allreduce", "reduce_scatter"):  # all-gather: the library's ring copies less
        assert tuning.choose(kind, big, 4, tuned={}) == "shm"
    assert tuning.choose("allreduce", big, 2, tuned={}) == "rabenseifner"  # halves: fewer copies
    assert tuning.choose("reduce_scatter", big, 2, tuned={}) == "shm"
    assert tuning.choose("allreduce", big, 2, tuned={}, shm=False) == "rabenseifner"
    # a tuned table that chose shm: across nodes the defaults without it decide
    table = tuning.validate(tuning.tuned_table(
        {"allreduce": {2: [(big, {"library": 3.0, "ring": 2.0, "shm": 1.0})]}}, "mpich"))
    assert tuning.choose("allreduce", big, 2, tuned=table) == "shm"
    assert tuning.choose("allreduce", big, 2, tuned=table, shm=False) == "rabenseifner"


def test_tune_ignores_algorithms_not_measured():
    """commbench records NaN for shm where the ranks span nodes: --tune never picks it."""
    assert tuning.pick({"library": 2.0, "ring": 1.0, "shm": math.nan}) == "ring"
    assert tuning.pick({"library": 1.0, "ring": 2.0, "shm": math.nan}) == "library"
    assert tuning.pick({"library": 2.0, "ring": 1.5, "shm": 1.0}) == "shm"


def test_commbench_table_without_shm():
    """Across nodes commbench leaves shm unmeasured (NaN): its table and --tune skip it."""
    import numpy as np

    from mpipar.mpi.bench import collbench, report

    samples = np.ones((len(collbench.VARIANTS), 1, 3))
    samples[collbench.VARIANTS.index("ring")] = 0.5
    samples[collbench.VARIANTS.index("shm")] = np.nan
    rows = collbench.table("allreduce", 2, [1 << 20], samples, ["ring"])
    assert np.isnan(rows["shm_s"][0]) and rows["best"][0] == b"ring"
    assert rows["ring_s"][0] == 0.5 and rows["best_busbw"][0] == (1 << 20) / 0.5 / 1e9
    tuned = tuning.tuned_table(collbench.tune_results({"allreduce": rows}, 2), "mpich")
    assert tuned["choices"]["allreduce"]["2"] == [[1 << 20, "ring"]]
    assert "nan" in "\n".join(report.format_kind("allreduce", rows, 2))


def test_auto_keeps_device_arrays_off_host_shared_memory():
    """shm copies device arrays to the host and back: auto chooses as if shm were not offered for
    them (forced, shm still runs); host arrays keep the shm default. In a subprocess: building a
    Comm loads mpi4py, which this test process should not initialise."""
    code = (
        "import numpy as np\n"
        "from mpipar.mpi import collectives, tuning\n"
        "from mpipar.mpi import Comm\n"
        "class Two:\n"
        "    def Get_size(self): return 2\n"
        "    def Get_rank(self): return 0\n"
        "Comm.shm_offered = lambda self: True\n"
        "c = Comm(Two(), 'dp', world_ranks=[0, 1])\n"
        "big, x = 64 << 20, np.zeros(4)\n"
        "assert c.algorithm_for('reduce_scatter', big, x) == 'shm'\n"
        "collectives.is_device = lambda a: True  # x stands for a CuPy array\n"
        "want = tuning.choose('reduce_scatter', big, 2, shm=False)\n"
        "assert c.algorithm_for('reduce_scatter', big, x) == want != 'shm', want\n"
        "c.coll_mode = 'shm'\n"
        "assert c.algorithm_for('reduce_scatter', big, x) == 'shm'\n"
        "print('ok')\n"
    )
    assert_snippet_ok(code)
