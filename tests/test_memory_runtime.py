"""The runtime term of the memory model (MPI, BLAS, allocator; one number per machine): one home
(``memory_model.with_runtime``) for the analysis prediction and the planner, its own line in
``mpipar analyze`` (the planner's use of it: tests/test_plan_here.py)."""

from pathlib import Path

from mpipar.analysis import breakdown, load
from mpipar.analysis.memory_model import RUNTIME_BYTES, with_runtime
from mpipar.analysis.report import prediction_text

README_V1 = Path(__file__).parent / "data" / "readme_v1_steps0-5.h5"


def test_with_runtime_adds_one_part_to_every_rank():
    rows = [{"params": 10, "total": 10}, {"params": 4, "total": 4}]
    got = with_runtime([dict(r) for r in rows], 1000)
    assert [r["runtime"] for r in got] == [1000, 1000]
    assert [r["total"] for r in got] == [1010, 1004]
    assert with_runtime(None) is None
    assert with_runtime([{"total": 0}])[0]["runtime"] == RUNTIME_BYTES


def test_analyze_predicts_with_the_runtime_and_shows_it_on_its_own_line():
    res = breakdown(load(README_V1))
    pred = res["summary"]["predicted"]
    parts = pred["memory_parts"]
    for p, row in enumerate(parts):
        assert row["runtime"] == RUNTIME_BYTES
        assert pred["memory"][p] == row["total"] == sum(v for k, v in row.items() if k != "total")
    text = prediction_text(res)
    line = [s for s in text.splitlines() if s.strip().startswith("runtime (")]
    assert line == [f"  runtime (MPI, BLAS, allocator; measured once per machine): "
                    f"{RUNTIME_BYTES / 2**20:.1f} MiB a rank"]

