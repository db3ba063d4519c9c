"""experiments/lean_phases.py: the phase budget of mpipar against the lean loop, in one job per
case (both timed by one clock in alternating blocks) and as separate runs. Its table is written
for every rank with every phase; no timing is asserted."""

from pathlib import Path

import pytest
from mpi_util import run_experiment

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("data", "forward", "loss", "backward", "p2p", "grad sync", "zero grads", "norm",
          "step reduce", "optimizer", "dispatch", "step", "total")


def phases(tmp_path, *args):
    run_experiment("lean_phases.py", tmp_path, *args)
    text = (tmp_path / "phases.md").read_text()
    table = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in PHASES:
            table[cells[0]] = [float(c.replace(",", "")) for c in cells[1:]]
    return text, table


@pytest.mark.mpi
def test_same_job_budget_of_a_pipeline(tmp_path):
    text, table = phases(tmp_path, "--cases", "mlp-pp2-gpipe", "--lean-data-rows", "3686")
    assert set(table) == set(PHASES), text
    assert all(len(cells) == 6 for cells in table.values())  # lean, mpipar, diff per rank
    lean0, mine0, diff0 = table["total"][:3]
    assert lean0 > 0 and mine0 > 0 and diff0 == pytest.approx(mine0 - lean0, abs=1.0)
    assert table["forward"][0] > 0 and table["forward"][1] > 0  # both computed on rank 0
    assert table["loss"][3] > 0 and table["loss"][4] > 0  # and their loss on rank 1
    assert table["dispatch"][0] == 0  # the lean loop has no executor
    assert "same job, 2 block pairs of 3 steps" in text and "drawn from 3686" in text


@pytest.mark.mpi
def test_separate_runs_budget_of_one_rank_of_a_given_checkout(tmp_path):
    text, table = phases(tmp_path, "--cases", "mlp-1rank", "--separate", "--checkout", str(ROOT))
    assert set(table) == set(PHASES) and all(len(c) == 3 for c in table.values()), text
    assert table["total"][0] > 0 and table["total"][1] > 0
    assert "1 interleaved pairs of separate runs, 20 steps each" in text
    assert f"mpipar of {ROOT}" in text
