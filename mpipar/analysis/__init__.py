"""Reading and analysing HDF5 timing dumps (docs/dump_schema.md). Never imports MPI.

``load(path) -> Run``; ``breakdown(run, step=None, peak=None) -> dict``; ``compare(results)``;
``summarize(path) -> dict`` (JSON-ready). Plots live in ``mpipar.analysis.plots`` (matplotlib is
imported only there).
"""

from .breakdown import breakdown, union_length
from .compare import compare, summarize, to_dataframe, to_jsonable
from .dump import DumpError, Run, load

__all__ = [
    "DumpError",
    "Run",
    "breakdown",
    "compare",
    "load",
    "summarize",
    "to_dataframe",
    "to_jsonable",
    "union_length",
]
