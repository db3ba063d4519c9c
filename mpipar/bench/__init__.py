"""Benchmarks of mpipar against the limits (GEMM peak, memory count) and its peers (PyTorch eager,
raw mpi4py). ``mpipar bench`` (mpipar/commands/bench.py) drives ``run.py``; the trainer may record
``measure_gemm_peak`` in its timing dump."""

from .gemm import measure_gemm_peak

__all__ = ["measure_gemm_peak"]
