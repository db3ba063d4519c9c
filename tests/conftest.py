import os
import sys

# One BLAS thread per process: tests launch several MPI ranks on 2 cores.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tokens(tmp_path_factory):
    """A small synthetic token file for the training tests (files that need another corpus
    define their own ``tokens``, which takes precedence)."""
    from mpipar.datasets import prepare_synthetic

    path = tmp_path_factory.mktemp("data") / "pattern.h5"
    prepare_synthetic(path, "pattern", 20000, 256, seed=1)
    return str(path)
