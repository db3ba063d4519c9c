"""The train command: outputs, bad input, checkpoints across grids, exact resume, faults."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi_util import ONE_THREAD, REPO, SMALL_GPT, run_mpi

from mpipar.config import ConfigError, load_config
from mpipar.training import check_model, preflight

SMALL = SMALL_GPT


def train_args(tokens, out, *extra):
    return [sys.executable, "-m", "mpipar.cli", "train", "--data", tokens, "--out", str(out),
            *SMALL, *extra]


def metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text())


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))


# ----- config errors, before any MPI work -------------------------------------------------------

@pytest.mark.parametrize("over, words", [
    ({"train.lrr": "1"}, "unknown config key train.lrr"),
    ({"model.n_embd": "30", "model.n_head": "4"}, "not divisible by model.n_head"),
    ({"train.seq_len": "512"}, "longer than the context"),
    ({"parallel.dp": "2", "parallel.microbatches": "3"}, "multiple of 6"),
    ({"parallel.pp": "4", "parallel.virtual_stages": "2", "model.n_layer": "2"}, "only 4 units"),
    ({"model.tie_embeddings": "true", "parallel.pp": "2"}, "tie_embeddings"),
    ({"parallel.tp": "3"}, "not divisible by tp = 3"),
    ({"parallel.order": "tp-pp"}, "permutation"),
    ({"model.kind": "mlp", "model.sizes": "[8, 6, 4]", "parallel.tp": "4"},
     r"model.sizes\[1\] = 6 is split over tp = 4"),
    ({"model.kind": "mlp", "model.sizes": "[8, 8, 4]", "parallel.pp": "3"}, "only 2 units"),
])
def test_config_errors_name_the_field(over, words):
    """Settings alone fail in load_config; against the model's shapes, in preflight's
    check_model; either way before any MPI work, with a ConfigError naming the field."""
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        check_model(load_config(None, over))


def test_preflight_builds_the_checked_schedule_once(tmp_path, monkeypatch):
    from mpipar.parallel.pipeline import build

    calls = []
    real = build.build_schedule
    monkeypatch.setattr(build, "build_schedule",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    cfg = load_config(None, {"parallel.pp": "2", "parallel.microbatches": "4",
                             "run.out": str(tmp_path / "r")})
    r = preflight(cfg, 2)
    s = r.schedule
    assert (s.pp, r.microbatches, r.mode) == (2, 4, "synchronous") and len(calls) == 1
    assert s.lowered and r.eval_schedule.lowered and r.bounds == {0: (0, 2), 1: (2, 4)}
    with pytest.raises(ConfigError, match="mpiexec -n 2"):
        preflight(cfg, 4)
    with pytest.raises(ConfigError, match="zigzag"):
        preflight(load_config(None, {"parallel.schedule": "zigzag", "run.trace": "false"}), 1)


def test_unknown_schedule_and_wrong_world_size_fail_cleanly(tokens, tmp_path):
    res = run_mpi(1, train_args(tokens, tmp_path / "a", "--schedule", "zigzag"), timeout=60)
    assert res.returncode == 2 and "zigzag" in res.stderr and "Traceback" not in res.stderr
    res = run_mpi(2, train_args(tokens, tmp_path / "b", "--dp", "1"), timeout=60)
    assert res.returncode != 0 and "mpiexec -n 1" in res.stderr


def test_missing_data_file(tmp_path):
    res = subprocess.run([sys.executable, "-m", "mpipar.cli", "train", "--data",
                          str(tmp_path / "nope.h5"), "--out", str(tmp_path / "r"), *SMALL,
                          "--steps", "1"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **ONE_THREAD})
    assert res.returncode == 2 and "nope.h5" in res.stderr and "prepare-data" in res.stderr


# ----- a run's outputs ---------------------------------------------------------------------------

def test_plain_python_run_writes_metrics_and_dump(tokens, tmp_path):
    out = tmp_path / "run"
    res = subprocess.run(train_args(tokens, out, "--steps", "4", "--microbatches", "2",
                                    "--set", "train.eval_interval=2"),
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, **ONE_THREAD})
    assert res.returncode == 0, res.stderr
    m = metrics(out)
    assert len(m["losses"]) == 4 and np.isfinite(m["val_loss"])
    from mpipar.analysis import load

    run = load(out / "trace.h5")
    assert run.complete and run.world_size == 1 and len(run.metrics) == 4
    kinds = {k for k in run.events[0]["kind"]}
    assert {"F", "B", "OPT", "STEP", "LOSS"} <= kinds


# ----- checkpoints -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_run(tokens, tmp_path_factory):
    """6 float64 steps on dp2 pp2 tp2 (8 ranks), a checkpoint every 3 steps."""
    out = tmp_path_factory.mktemp("ckpt") / "full"
    res = run_mpi(8, train_args(tokens, out, "--dp", "2", "--pp", "2", "--tp", "2",
                                "--microbatches", "2", "--steps", "6", "--dtype", "float64",
                                "--set", "run.checkpoint_interval=3"), timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_checkpoint_holds_full_tensors(saved_run):
    ck = saved_run / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_000006.h5"
    with h5py.File(ck / "step_000003.h5", "r") as f:
        assert f.attrs["step"] == 3
        assert f["params/blocks.0.mlp.fc.weight"].shape == (16, 64)
        assert f["params/blocks.0.attn.qkv.weight"].shape == (16, 3, 16)
        assert "optim/head.weight/exp_avg_sq" in f
    assert not list(ck.glob(".*tmp*"))


@pytest.mark.parametrize("n, grid", [(8, ("2", "2", "2")), (8, ("1", "4", "2")),
                                     (1, ("1", "1", "1"))],
                         ids=["same-grid", "dp1-pp4-tp2", "one-rank"])
def test_resume_is_exact_on_any_grid(tokens, saved_run, tmp_path, n, grid):
    dp, pp, tp = grid
    out = tmp_path / "resumed"
    res = run_mpi(n, train_args(tokens, out, "--dp", dp, "--pp", pp, "--tp", tp,
                                "--microbatches", "2", "--steps", "6", "--dtype", "float64",
                                "--resume", str(saved_run / "checkpoints/step_000003.h5")),
                  timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    full, resumed = metrics(saved_run)["losses"][3:], metrics(out)["losses"]
    assert len(resumed) == 3
    tol = 1e-12 if grid == ("2", "2", "2") else 1e-9
    assert rel(resumed, full) <= tol, (resumed, full)


def test_checkpoint_of_another_model_names_the_tensor(tokens, saved_run, tmp_path):
    res = run_mpi(1, train_args(tokens, tmp_path / "x", "--steps", "4", "--dtype", "float64",
                                "--set", "model.n_embd=32",
                                "--resume", str(saved_run / "checkpoints/step_000003.h5")),
                  timeout=60)
    assert res.returncode == 2
    assert "embed.tok.weight" in res.stderr and "shape" in res.stderr


def test_corrupt_checkpoint_is_refused_and_the_previous_one_kept(tokens, saved_run, tmp_path):
    good = saved_run / "checkpoints/step_000003.h5"
    before = good.read_bytes()
    bad = tmp_path / "step_000003.h5"
    bad.write_bytes(before[: len(before) // 2])
    res = run_mpi(1, train_args(tokens, tmp_path / "x", "--steps", "4", "--dtype", "float64",
                                "--resume", str(bad)), timeout=60)
    assert res.returncode == 2 and "truncated or corrupted" in res.stderr
    assert good.read_bytes() == before


# ----- faults ------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_killed_rank_ends_the_job_and_keeps_checkpoint_and_dump(tokens, tmp_path):
    out = tmp_path / "killed"
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO)}
    cmd = ["mpiexec", "-n", "4", *train_args(tokens, out, "--pp", "2", "--dp", "2",
                                              "--microbatches", "2", "--steps", "100000",
                                              "--set", "run.checkpoint_interval=2",
                                              "--set", "run.flush_interval=2")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (out / "checkpoints/latest").exists() or not (out / "trace.h5").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        pids = subprocess.run(["pgrep", "-f", "--", f"--out {out} "], capture_output=True,
                              text=True).stdout.split()
        victims = [int(p) for p in pids if int(p) != proc.pid]
        assert victims, "rank processes not found"
        os.kill(victims[-1], signal.SIGKILL)
        t0 = time.time()
        proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert time.time() - t0 < 30, "job did not end promptly after a rank died"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    ck = out / "checkpoints" / (out / "checkpoints/latest").read_text().strip()
    with h5py.File(ck, "r") as f:
        assert f.attrs["complete"] and f.attrs["step"] >= 2
    from mpipar.analysis import load

    run = load(out / "trace.h5")
    assert run.world_size == 4 and not run.complete and len(run.events[0]) > 0
    shutil.rmtree(out, ignore_errors=True)


# ----- the dump of a real multi-rank run through the analysis ------------------------------------

def test_analyze_a_real_8_rank_run(saved_run, tmp_path):
    from mpipar.analysis import summarize

    s = summarize(saved_run / "trace.h5")
    summary = s["summary"]
    assert (summary["dp"], summary["pp"], summary["tp"]) == (2, 2, 2)
    assert summary["steps_measured"] == 5  # step 0 skipped as warm-up
    assert 0.0 < summary["bubble"] < 1.0 and summary["tokens_per_s"] > 0
    assert summary["flops_per_s"] > 0 and summary["peak"] > 0  # the run measured its GEMM peak
    res = subprocess.run([sys.executable, "-m", "mpipar.cli", "analyze", str(saved_run),
                          "--plots", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "dp1/pp1/tp1" in res.stdout and "bubble" in res.stdout
    assert list(tmp_path.glob("*.png"))


def test_cuda_without_a_gpu_is_a_clear_error(tokens, tmp_path):
    from mpipar.backend import cupy_available

    if cupy_available()[0]:
        pytest.skip("a GPU is present")
    res = subprocess.run(train_args(tokens, tmp_path / "g", "--device", "cuda", "--steps", "1"),
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, **ONE_THREAD})
    assert res.returncode == 2 and "--device cpu" in res.stderr and "Traceback" not in res.stderr


# ----- the pieces of a step, without MPI ---------------------------------------------------------

def test_gradients_ready_launch_every_bucket_once():
    """The executor's callbacks go straight to GradSync; whichever reports a chunk (a unit, the
    chunk, or finish), each dp bucket is reduced exactly once per step."""
    from mpipar.backend import Backend
    from mpipar.config import ModelConfig
    from mpipar.models import build_model
    from mpipar.mpi import LocalComm
    from mpipar.parallel.data import GradSync
    from mpipar.parallel.tensor import TPContext

    class TwoRanks(LocalComm):  # a dp axis of 2 whose reductions are identities, counted
        size = 2

        def __init__(self):
            super().__init__("dp")
            self.launched = []

        def iallreduce(self, x, op="sum"):
            self.launched.append(id(x))
            return super().iallreduce(x, op)

    model = build_model(ModelConfig(kind="mlp", sizes=[4, 6, 6, 3]), Backend("cpu", "float64"))
    units = model.units
    comm = TwoRanks()
    sync = GradSync({0: model.params(units[:2]), 1: model.params(units[2:])}, comm,
                    Backend("cpu", "float64"), TPContext(), bucket_mb=1e-4)
    buckets = [id(b.grad) for bs in sync.buckets.values() for b in bs]
    assert len(buckets) > 2 and sync.overlap
    for report in ([], [("unit", 1, units[2]), ("chunk", 1), ("chunk", 1)],
                   [("unit", 0, units[1]), ("chunk", 0), ("unit", 1, units[2])]):
        comm.launched.clear()
        sync.start()
        for r in report:
            sync.unit_ready(*r[1:]) if r[0] == "unit" else sync.chunk_ready(r[1])
        sync.finish()
        assert sorted(comm.launched) == sorted(buckets), report


def test_step_lr_keeps_a_warmup_that_fits_a_short_run():
    from mpipar.nn.optim import lr_at
    from mpipar.training import step_lr

    cfg = load_config(None, {"train.steps": "3", "train.warmup_steps": "10", "train.lr": "0.3",
                             "train.min_lr": "0.0"})
    assert [step_lr(cfg, s) for s in range(3)] == [lr_at(s, 0.3, 2, 3, 0.0) for s in range(3)]
    assert step_lr(cfg, 1) == pytest.approx(0.3)  # the last warm-up step reaches the peak


def test_device_peak_scales_the_host_by_its_ranks(monkeypatch):
    from mpipar import perf
    from mpipar.backend import Backend

    monkeypatch.setattr(perf, "measure_gemm_peak", lambda *a, **k: 1e9)
    monkeypatch.setattr(perf.os, "cpu_count", lambda: 8)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    cpu = Backend("cpu", "float32")
    assert perf.device_peak(cpu, ranks_on_host=1) == pytest.approx(1e9)
    assert perf.device_peak(cpu, ranks_on_host=3) == pytest.approx(3e9)
    assert perf.device_peak(cpu, ranks_on_host=16) == pytest.approx(4e9)  # capped at the cores
