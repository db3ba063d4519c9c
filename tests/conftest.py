import fnmatch
import os
import sys
from pathlib import Path

# One BLAS thread per process: tests launch several MPI ranks on 2 cores.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402

# Markers given here rather than in the test files, one table each, matched against the test
# id inside tests/ ("file.py::test_name[params]", shell wildcards).
#
# MPI: tests that start MPI jobs without a marker in their file: the multi-rank runs shared by a
# fixture, and scripts that launch mpiexec themselves (the hook below sees only the launches
# of this process). Tests that take the Slurm ``cluster`` fixture are marked slurm and mpi.
MPI = (
    "test_analysis.py::test_chrome_trace_of_real_dump_and_its_prediction",
    "test_train.py::test_unknown_schedule_and_wrong_world_size_fail_cleanly",
    "test_train.py::test_checkpoint_holds_full_tensors",
    "test_train.py::test_resume_is_exact_on_any_grid[[]*",
    "test_train.py::test_checkpoint_of_another_model_names_the_tensor",
    "test_train.py::test_corrupt_checkpoint_is_refused_and_the_previous_one_kept",
    "test_train.py::test_analyze_a_real_8_rank_run",
    "test_experiments.py::test_memory_quick_counts_match_simulator",
    "test_experiments.py::test_tp_comm_quick_bytes_match_megatron_count",
    "test_memory_model.py::test_predicted_peak_meets_the_trainers_record_on_two_ranks",
)

# SLOW: out of the fast loop, `pytest -m "not slow"`: tests of a second or more alone (most
# start MPI jobs). FAST names the exceptions: a representative that stays in the loop, so that
# every package keeps at least one test there (one or two equivalence grids, one nD tensor
# mode, a short continuous run, a 2-rank case of each collective). Tests sharing an expensive
# fixture stay on one side together, or the fixture's cost moves to the one left.
SLOW = (
    "test_parallel_equivalence.py::*",
    "test_tp_nd.py::test_nd_layers_match_finite_differences[[]*",
    "test_tp_nd.py::test_nd_bytes_match_the_papers_and_memory_shrinks[[]*",
    "test_tp_nd.py::test_checkpoint_written_in_2d_resumes_in_1d_3d_and_back",
    "test_tp_nd.py::test_tp_modes_experiment_quick_bytes_match_formulas",
    "test_faults.py::*",
    "test_collective_equivalence.py::*",
    "test_continuous.py::test_continuous_matches_its_one_rank_replay[[]*",
    "test_continuous.py::test_dump_of_a_continuous_2bw_run_shows_no_flush",
    "test_continuous.py::test_a_resumed_continuous_run_equals_the_uninterrupted_one[[]*",
    "test_continuous.py::test_schedule_command_simulates_and_charts_a_continuous_schedule",
    "test_experiments.py::test_memory_quick_counts_match_simulator",
    "test_experiments.py::test_tp_comm_quick_bytes_match_megatron_count",
    "test_comm.py::test_commbench_cli[[]*",
    "test_comm.py::test_collective_algorithms_bitwise_equal_on_every_rank[[]*",
    "test_comm.py::test_every_op_on_every_axis[[]8-*",
    "test_collectives_registered.py::test_registered_collectives_under_mpiexec[[]*",
    "test_collectives_shm.py::test_shm_collectives_under_mpiexec[[]*",
    "test_collectives_hier.py::test_hier_collectives_under_mpiexec[[]*",
    "test_collectives_hier.py::test_dp4_on_two_nodes_matches_one_rank",
    "test_collectives_hier.py::test_train_across_nodes_warns_and_analyze_shows_links",
    "test_collectives_hier.py::test_hier_allreduce_experiment_quick",
    "test_grid.py::test_real_communicators[[]*",
    "test_memory_model.py::test_predicted_peak_meets_the_trainers_record_on_two_ranks",
    "test_memory_model.py::test_planner_counts_each_ranks_own_live_micro_batches",
    "test_trace.py::test_sigkill_during_flushes_leaves_a_readable_dump",
    "test_trace.py::test_soak_script_prints_rss_per_rank",
    "test_train.py::test_checkpoint_holds_full_tensors",
    "test_train.py::test_resume_is_exact_on_any_grid[[]*",
    "test_train.py::test_checkpoint_of_another_model_names_the_tensor",
    "test_train.py::test_corrupt_checkpoint_is_refused_and_the_previous_one_kept",
    "test_train.py::test_analyze_a_real_8_rank_run",
    "test_train.py::test_killed_rank_ends_the_job_and_keeps_checkpoint_and_dump",
    "test_train.py::test_unknown_schedule_and_wrong_world_size_fail_cleanly",
    "test_analysis.py::test_chrome_trace_of_real_dump_and_its_prediction",
    "test_checkpoint.py::test_cli_refuses_a_checkpoint_of_another_depth",
    "test_dataset.py::test_concurrent_prepare_is_atomic",
    "test_dataset.py::test_cli_prepare_data",
    "test_messages.py::test_plots_into_an_unwritable_folder",
    "test_messages.py::test_schedule_into_head_ends_quietly",
    "test_stage_layout.py::test_a_heavy_last_stage_trains_and_its_dump_suggests_a_layout",
    "test_tensor_parallel.py::test_tp_collectives_match_megatron_count[[]4-*",
    "test_failfast.py::test_a_bad_config_under_mpiexec_is_said_once",
)
FAST = (
    "test_parallel_equivalence.py::test_grid_matches_one_rank[[]dp1-pp2-tp2]",
    "test_parallel_equivalence.py::test_grid_matches_one_rank[[]dp2-pp1-tp2]",
    "test_tp_nd.py::test_nd_layers_match_finite_differences[[]2d]",
    "test_continuous.py::test_continuous_matches_its_one_rank_replay[[]1-2-1-2-pipedream-continuous]",
    "test_continuous.py::test_continuous_matches_its_one_rank_replay[[]1-2-1-1-pipedream-2bw-*]",
    "test_comm.py::test_collective_algorithms_bitwise_equal_on_every_rank[[]2]",
    "test_collectives_registered.py::test_registered_collectives_under_mpiexec[[]2]",
    "test_collectives_shm.py::test_shm_collectives_under_mpiexec[[]2]",
    "test_collectives_hier.py::test_hier_collectives_under_mpiexec[[]2x2]",
    "test_grid.py::test_real_communicators[[]2]",
)


def _matches(item, patterns) -> bool:
    name = item.nodeid.split("tests/", 1)[-1]
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        slurm = item.path.name == "test_slurm.py" and "cluster" in item.fixturenames
        if slurm:
            item.add_marker(pytest.mark.slurm)
        if slurm or _matches(item, MPI):
            item.add_marker(pytest.mark.mpi)
        if slurm or (_matches(item, SLOW) and not _matches(item, FAST)):
            item.add_marker(pytest.mark.slow)
    if all(Path(arg).is_dir() for arg in config.args):  # whole files collected, not single tests
        _check_tables(items)


def _check_tables(items):
    """A pattern that matches no test of a collected file is stale (a test renamed): say so."""
    files = {item.path.name for item in items}
    for table, patterns in (("MPI", MPI), ("SLOW", SLOW), ("FAST", FAST)):
        for pattern in patterns:
            if pattern.split("::")[0] in files and not any(_matches(i, [pattern]) for i in items):
                raise pytest.UsageError(f"tests/conftest.py: {table} pattern {pattern!r} "
                                        f"matches no test: update it")


# The markers of the test running now (None between tests): a test not marked ``mpi`` that
# launches mpiexec fails, so `-m "not mpi"` really starts no MPI job. An audit hook sees every
# process this one starts, whichever helper starts it.
_running = None
LAUNCHERS = ("mpiexec", "mpirun")


def _refuse_unmarked_mpiexec(event, args):
    if event != "subprocess.Popen" or _running is None or "mpi" in _running:
        return
    argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    if argv and os.path.basename(str(argv[0])) in LAUNCHERS:
        raise RuntimeError("this test launches mpiexec: mark it @pytest.mark.mpi")


sys.addaudithook(_refuse_unmarked_mpiexec)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _running
    _running = {m.name for m in item.iter_markers()}


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    global _running
    _running = None


@pytest.fixture(scope="session")
def tokens(tmp_path_factory):
    """A small synthetic token file for the training tests (files that need another corpus
    define their own ``tokens``, which takes precedence)."""
    from mpipar.datasets import prepare_synthetic

    path = tmp_path_factory.mktemp("data") / "pattern.h5"
    prepare_synthetic(path, "pattern", 20000, 256, seed=1)
    return str(path)
