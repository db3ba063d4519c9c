"""``mpipar plan measure``: a spec of this machine in the bundled schema (tiny sizes here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpipar.plan import load_cluster
from mpipar.plan.measure import fit_gemm

ROOT = Path(__file__).resolve().parent.parent


def test_gemm_fit_recovers_the_bundled_form():
    """r(n) = R n / (n + h) sampled exactly: the fit returns R and h."""
    rates = [(n, 5e10 * n / (n + 40.0)) for n in (16, 32, 64, 128, 256)]
    peak, half = fit_gemm(rates)
    assert peak == pytest.approx(5e10, rel=0.01) and half == pytest.approx(40.0, rel=0.01)


def test_gemm_fit_shrugs_off_one_slowed_size():
    """One size run beside a busy neighbour at a fifth of its rate: R stays within 10 %."""
    rates = [(n, 5e10 * n / (n + 40.0)) for n in (32, 64, 128, 256, 512)]
    rates[-1] = (512, rates[-1][1] / 5)
    peak, half = fit_gemm(rates)
    assert peak == pytest.approx(5e10, rel=0.1) and half == pytest.approx(40.0, rel=0.2)


@pytest.mark.mpi
def test_measure_writes_a_spec_that_cluster_reads(tmp_path):
    out = tmp_path / "here.toml"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "mpipar.cli", "plan", "measure", "--quick",
                           "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    for what in ("matrix products", "element-wise", "p2p latency", "action_overhead"):
        assert what in done.stdout
    c = load_cluster(str(out))
    assert c.peak["fp32"] > 0 and c.gemm_max_efficiency == 1.0 and c.sms == 1
    assert c.gemm_efficiency(10 * c.gemm_half_dim) == pytest.approx(10 / 11)  # R n / (n + h)
    assert c.intra.latency > 0 and c.intra.bandwidth > 0 and c.collective is not None
    assert dict(c.executor).keys() >= {"action_overhead", "send_post", "step_pre", "step_post"}
    assert c.hbm_capacity > 1e8 and c.cores_per_rank > 0
    # the probe's runtime memory (plan.memory_terms) and the scheduler slice (plan.sharing)
    assert 0 <= c.runtime < 64 * 2**20 and "runtime memory" in done.stdout
    assert 1e-5 < dict(c.executor)["sched_slice"] < 0.1
    # the core's cache and the warm OPT costs (plan.opt_region), a step's variation
    # (plan.replicas)
    assert c.cache >= 0 and 0 <= c.step_cv < 1 and "OPT region" in done.stdout
    assert (c.cache > 0) == ("opt_value_warm" in dict(c.units))
    # processes beyond the cores: slower than their share by a measured factor (plan.oversub)
    assert c.shared_slowdown >= 1.0 and "processes at once" in done.stdout
    # how steady the machine is (plan.steadiness): printed and written, read by no term
    assert "machine steadiness" in done.stdout and "[steadiness]" in out.read_text()


def test_measure_refuses_a_missing_out(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mpipar.cli", "plan", "measure"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 2 and "--out" in done.stderr


def test_unit_bench_times_every_phase_of_a_chain():
    """The chain bench gives a positive time for every unit kind and phase, the MLP's loss,
    and the OPT region per tensor and per value (tiny shapes, a minimal budget)."""
    from mpipar.plan import unit_bench as ub

    got = ub.gpt_units(*ub.FLOOR["gpt"], 0.0) | ub.mlp_units(*ub.FLOOR["mlp"], 0.0)
    assert set(got) == {f"{u}_{p}" for u in ("embed", "block", "head", "linear")
                        for p in ub.PHASES} | {"loss_f", "loss_b"}
    assert all(t > 0 for k, t in got.items() if k != "embed_b")  # a gather has no dx
    # two timings solved for two costs, each clamped at 0 (``_solve``): under load either can
    # come out 0, so only the range is checked here; the arithmetic is checked exactly below
    opt = ub.optimizer_costs(0.0)
    assert set(opt) == {"opt_tensor", "opt_value"}
    assert all(0 <= v < 1 for v in opt.values())


def test_opt_costs_are_solved_from_two_timings_and_clamped_at_zero():
    """``unit_bench._solve``: the per-tensor and per-value costs that made two timings come
    back from them; a timing below its tensors' cost (noise) gives 0, never a negative."""
    from mpipar.plan import unit_bench as ub

    tensor, value = 5e-6, 2e-9
    big, many = (2, 500_000), (150, 40_000)  # (tensors, values) of the two models
    timing = [(n * tensor + v * value, n, v) for n, v in (big, many)]
    assert ub._solve(*timing) == pytest.approx((tensor, value), rel=1e-6)
    per_tensor, per_value = ub._solve((1e-9, 2, 500_000), (1e-3, 150, 40_000))
    assert per_value == 0.0 and per_tensor == pytest.approx(1e-3 / 150)
