"""The run resolved once (``training.resolved``), the lowering pass (``pipeline.lowering``) and
the step class each training mode runs with (``training.steps``)."""

from __future__ import annotations

import ast
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

from mpipar.config import ConfigError, load_config
from mpipar.parallel.pipeline.actions import Schedule, ScheduleError
from mpipar.parallel.pipeline.check import check_schedule
from mpipar.parallel.pipeline.generators import build_schedule
from mpipar.parallel.pipeline.lowering import lower, sends_first
from mpipar.training import preflight, resolve

ROOT = Path(__file__).resolve().parent.parent


def test_lowering_puts_sends_first_and_is_checked_with_the_executors_sends():
    s = build_schedule("1f1b", 2, 4)
    low = lower(s)
    assert low.lowered and not s.lowered and lower(low) is low
    # the last stage hands B(mb)'s gradient over before waiting for F(mb+1)'s activation
    last = [str(a) for a in low.ranks[1]]
    assert last.index("SEND_B0.1") < last.index("RECV_F1.1")
    assert [str(a) for a in s.ranks[1]].index("RECV_F1.1") < [str(a) for a in s.ranks[1]].index(
        "SEND_B0.1")
    # only messages move: every compute keeps its place in the list
    for before, after in zip(s.ranks, low.ranks):
        assert [(i, a) for i, a in enumerate(before) if a.is_compute] == \
            [(i, a) for i, a in enumerate(after) if a.is_compute]
    check_schedule(low)  # eager sends: what the executor does
    with pytest.raises(ScheduleError, match="deadlock"):  # that order needs non-blocking sends
        check_schedule(replace(low, lowered=False))
    assert Schedule.parse(low.format()) == low and "lowered=true" in low.format()


def test_lowering_keeps_dualpipe_pairs_and_a_check_still_finds_a_real_deadlock():
    s = lower(build_schedule("dualpipev", 2, 4, 2))
    assert s.pairs and all(s.ranks[r][i].op == "F" for r, i in s.pairs)
    check_schedule(s)
    bad = Schedule.parse("schedule pp=2 virtual=1 microbatches=1 lowered=true\n"
                         "rank 0: RECV_B0.0 F0.0 SEND_F0.0 BW0.0\n"
                         "rank 1: RECV_F0.1 F0.1 BW0.1 SEND_B0.1\n")
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(bad)
    assert sends_first([]) == []


def cfg_of(**sets):
    over = {"run.trace": "false", "model.n_layer": "4", "train.steps": "5"}
    over.update({f"parallel.{k}": str(v) for k, v in sets.items()})
    return load_config(None, over)


@pytest.mark.parametrize("sets, mode", [
    ({"schedule": "1f1b", "pp": 2, "microbatches": 4}, "synchronous"),
    ({"schedule": "pipedream-2bw", "pp": 2, "microbatches": 2}, "2bw"),
    ({"schedule": "pipedream", "pp": 2, "microbatches": 2}, "pipedream"),
    ({"schedule": "pipedream", "pp": 2, "microbatches": 2, "continuous": "true"}, "continuous"),
    ({"schedule": "pipedream-2bw", "pp": 2, "microbatches": 2, "continuous": "true"},
     "continuous-2bw"),
])
def test_the_resolved_run_names_its_mode_and_holds_one_lowered_schedule(sets, mode):
    r = resolve(cfg_of(**sets))
    assert r.mode == mode and r.schedule.lowered and r.eval_schedule.lowered
    assert r.microbatches == r.schedule.microbatches == sets["microbatches"]
    assert r.tp_mode == "1d" and sorted(r.bounds) == list(range(r.schedule.n_chunks))
    assert all(r.rank_of(c) == c % 2 for c in r.bounds)
    with pytest.raises(FrozenInstanceError):  # frozen: nothing downstream changes the run
        r.mode = "synchronous"
    if mode.startswith("continuous"):
        seg = r.segment(3)
        assert seg.steps == 3 and seg.lowered and r.segment(3) is seg  # made once per length
        check_schedule(seg)


def test_a_schedule_file_is_lowered_and_must_fit_the_run(tmp_path):
    path = tmp_path / "s.txt"
    build_schedule("gpipe", 2, 8).save(path)
    cfg = cfg_of(pp=2, microbatches=8, schedule_file=path, dp=1)
    r = preflight(cfg, 2)
    assert r.schedule.kind == "gpipe" and r.schedule.lowered and r.microbatches == 8
    with pytest.raises(ConfigError, match="microbatches=8; the run has pp=2, microbatches=4"):
        preflight(cfg_of(pp=2, microbatches=4, schedule_file=path), 2)


def test_the_trainer_runs_the_step_class_of_the_mode_and_the_schedules_order(tmp_path):
    from mpipar.backend import Backend
    from mpipar.datasets import prepare_synthetic
    from mpipar.mpi import ProcessGrid
    from mpipar.trace import Tracer
    from mpipar.training import Trainer
    from mpipar.training.steps import STEP_CLASSES

    data = tmp_path / "d.h5"
    prepare_synthetic(data, "markov", 2000, 64, seed=0)
    b = Backend("cpu", "float64")
    for kind, mode in (("1f1b", "synchronous"), ("pipedream-2bw", "2bw"),
                       ("pipedream", "pipedream")):
        cfg = load_config(None, {"run.trace": "false", "parallel.schedule": kind,
                                 "parallel.microbatches": "2", "train.batch_size": "4",
                                 "train.seq_len": "8", "data.path": str(data),
                                 "model.n_layer": "2", "model.n_embd": "16",
                                 "model.n_head": "2", "model.block_size": "8",
                                 "model.vocab_size": "64"})
        r = resolve(cfg)
        tr = Trainer(cfg, ProcessGrid(1, 1, 1, backend=b), Tracer(enabled=False), b, str(data),
                     resolved=r)
        assert type(tr.mode) is STEP_CLASSES[mode] and tr.run is r
        assert tr.executor.actions is r.schedule.ranks[0]  # run as given, not reordered
        assert (tr.older_weights() is not None) == (mode == "2bw")
        tr.train_step()
    with pytest.raises(ValueError, match="another config"):
        Trainer(load_config(None, {"run.trace": "false"}), None, None, b, resolved=r)


def _imports(path: Path) -> set[str]:
    """Every module a file imports (module-level and inside functions), made absolute."""
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(x for x in (base, node.module) if x)
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("name", ["predict", "predict_continuous", "stage_costs"])
def test_analysis_reads_schedules_not_the_executor_or_the_trainer(name):
    mods = _imports(ROOT / "mpipar" / "analysis" / f"{name}.py")
    assert not {m for m in mods if m.startswith(("mpipar.parallel.pipeline.executor",
                                                 "mpipar.parallel.pipeline.continuous",
                                                 "mpipar.training"))}, mods


def test_pipeline_runtime_has_no_import_circle():
    cont = _imports(ROOT / "mpipar" / "parallel" / "pipeline" / "continuous.py")
    ex = _imports(ROOT / "mpipar" / "parallel" / "pipeline" / "executor.py")
    assert "mpipar.parallel.pipeline.executor" in cont
    assert not any(m.startswith("mpipar.parallel.pipeline.continuous") for m in ex)
    assert "mpipar.mpi.algorithms.PENDING" not in ex
