"""torch.distributed.pipelining's schedule CSV: read, write, and torch's own schedules as data
(experiments/torch_schedules.py wrote experiments/data/torch/ with torch 2.13)."""

from pathlib import Path

import pytest

from mpipar.parallel.pipeline.actions import ScheduleError
from mpipar.parallel.pipeline.check import check_schedule
from mpipar.parallel.pipeline.generators import build_schedule
from mpipar.parallel.pipeline.torch_csv import format_torch_csv, load_torch_csv, parse_torch_csv

TORCH = Path(__file__).resolve().parent.parent / "experiments" / "data" / "torch"
FILES = sorted(TORCH.glob("*.csv"))


def test_the_data_is_there():
    assert len(FILES) >= 20
    assert (TORCH / "versions.txt").read_text().startswith("torch 2.13")


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_torch_schedules_load_and_pass_the_checker(path):
    s = load_torch_csv(path)
    check_schedule(s)
    assert s.placement == ("v" if path.name.startswith(("zb-v", "dualpipev")) else "loop")
    fmt = "compute_comms" if path.stem.endswith("_comms") else "compute_only"
    assert any(a.is_comm for acts in s.ranks for a in acts)  # placed by mpipar, or torch's own
    assert parse_torch_csv(format_torch_csv(s, fmt), fmt, s.kind) == s


@pytest.mark.parametrize("kind", ["zb-v", "dualpipev"])
def test_mpipar_generators_match_torch_compute_orders(kind):
    """Written independently from the papers, mpipar's ZB-V and DualPipeV order the computes of
    pp=2, m=4 exactly as torch 2.13 does."""
    ours = format_torch_csv(build_schedule(kind, 2, 4, 2), "compute_only")
    assert ours == (TORCH / f"{kind}_pp2_m4.csv").read_text().replace("\r\n", "\n").replace(
        "\n,", "\n").lstrip(",")


def test_bad_csv_says_what_is_wrong(tmp_path):
    with pytest.raises(ScheduleError, match="row 1, column 2: cannot read action 'XF0'"):
        parse_torch_csv("0F0,XF0\n")
    with pytest.raises(ScheduleError, match="neither the loop placement"):
        parse_torch_csv("1F0,1B0\n0F0,0B0\n")
    with pytest.raises(ScheduleError, match="holds SEND_F0.0; read it as compute_comms"):
        parse_torch_csv("0F0,0SEND_F0\n1F0\n", "compute_only")
    with pytest.raises(ScheduleError, match="cannot read torch CSV"):
        load_torch_csv(tmp_path / "missing.csv")
    s = build_schedule("pipedream", 2, 2)
    with pytest.raises(ScheduleError, match="no UPDATE action"):
        format_torch_csv(s)
