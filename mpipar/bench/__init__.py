"""Benchmarks of mpipar against the limits (GEMM peak, memory count) and its peers (PyTorch eager,
raw mpi4py). ``mpipar bench`` (mpipar/commands/bench.py) drives ``run.py``. The GEMM peak the
trainer records in its timing dump is ``mpipar.perf.measure_gemm_peak``, which this tool uses too
(the core never imports ``bench``)."""
