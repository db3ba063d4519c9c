"""`mpipar plan`: closed forms vs the simulator, FLOP counts, SC'21 Table 1, ranking, CLI."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpipar.plan import GPTShape, describe, korthikanti, load_cluster, load_model, parse_fix, plan
from mpipar.plan.costs import STATE_BYTES, state_bytes
from mpipar.plan.evaluate import executed_flops
from mpipar.plan.figures import load_checks, run_check
from mpipar.plan.fit import GRID_EFF, GRID_HALF, fit, leave_one_out, log_errors
from mpipar.plan.model import layer_gemm_flops, megatron_sc21_flops, model_flops_per_step
from mpipar.plan.pipeline import closed_form, in_flight, run_simulation
from mpipar.plan.sc21 import DTYPE, paper_fix, paper_row, predict, shape, table1

COSTS = [(1, 1, 1), (1, 2, 0.5), (1, 1.5, 1.5), (1, 0.6, 0.3), (2, 1, 1), (1, 0.5, 1.2)]


def _cases():
    for kind in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        for p in range(1, 7):
            for m in sorted({1, 2, p, p + 1, 2 * p, 3 * p}):
                for v in ((2, 3) if kind == "interleaved" else (1,)):
                    if kind != "interleaved" or m % p == 0:
                        yield kind, p, m, v


@pytest.mark.parametrize("kind,p,m,v", list(_cases()))
def test_closed_forms_match_the_simulator(kind, p, m, v):
    for f, b, w in COSTS:
        costs = {"F": f, "B": b, "W": w} if kind == "zb-h1" else {"F": f, "BW": b + w}
        sim = run_simulation(kind, p, m, v, costs)
        cf = closed_form(kind, p, m, v, f, b, w)
        if cf is not None:
            assert cf == pytest.approx(sim.makespan, rel=1e-12), (f, b, w)
        assert in_flight(kind, p, m, v) * v == sim.peak_activations[0]
    assert closed_form("zb-h1", 4, 2, 1, 1, 1, 1) is None  # m < p: simulated instead


def test_layer_flops_by_hand():
    m = GPTShape(layers=1, hidden=8, heads=2, seq=4, vocab=16)
    b = 3  # tokens T = 12; QKV 12x8 @ 8x24; scores 3*2 heads of 4x4 @ 4x4 ... by hand:
    hand = {
        "qkv": 2 * 12 * 8 * 24,
        "scores": 2 * (3 * 2) * 4 * 4 * 4,  # b*a matrices (s x h/a) @ (h/a x s)
        "values": 2 * (3 * 2) * 4 * 4 * 4,  # (s x s) @ (s x h/a)
        "proj": 2 * 12 * 8 * 8,
        "mlp": 2 * 12 * 8 * 32 + 2 * 12 * 32 * 8,
    }
    assert layer_gemm_flops(m, b) == hand
    logits = 2 * 12 * 8 * 16
    assert model_flops_per_step(m, b) == 3 * (sum(hand.values()) + logits)
    # Megatron's closed forms: 72 B s l h^2 (1 + s/6h + V/12lh), and 96 ... with full recompute.
    assert model_flops_per_step(m, b) == pytest.approx(72 * b * 4 * 64 * (1 + 4 / 48 + 16 / 96))
    assert executed_flops(m, b, "full") == pytest.approx(megatron_sc21_flops(m, b))


@pytest.mark.parametrize("row", table1(), ids=lambda r: f"{r['params_b']}B")
def test_sc21_table1_within_15_percent(row):
    got = predict(row)
    assert got["fits"]
    assert got["paper_tflops"] == pytest.approx(row["tflops"], rel=0.15)
    assert got["paper_tflops"] == pytest.approx(got["tflops_per_gpu"])  # full recompute


# Rows where the planner ranks a 2021-feature layout (full recompute, no SP, no ZeRO-1) ahead of
# the paper's by more than four places, and what its faster layout does differently (checked):
# the weak-scaling series raised tp with the model to keep the study regular; at full
# recomputation these models fit with less tensor parallelism, which saves the per-layer
# all-reduces (experiments/README.md, SC'21 section); 310.1B: the paper's own dp x pp x tp, with
# a larger micro-batch (fuller last waves of the GEMMs) and more chunks per rank.
JUSTIFIED = {7.5: "less tp", 18.4: "less tp", 39.1: "less tp", 145.6: "less tp",
             310.1: "same layout"}


@pytest.mark.parametrize("row", table1(), ids=lambda r: f"{r['params_b']}B")
def test_paper_configuration_ranks_in_top_five_or_justified(row):
    c = load_cluster("dgx-a100-80gb")
    fix = paper_fix(row)
    same = {k: fix[k] for k in ("recompute", "sp", "zero1", "dp_overlap", "placement")}
    rows = plan(shape(row), c, row["gpus"], row["batch"], DTYPE, fixed=same, top=None)
    keys = ("dp", "pp", "tp", "schedule", "v", "microbatch_size")
    pos = next(i for i, r in enumerate(rows) if all(r[k] == fix[k] for k in keys)) + 1
    if row["params_b"] not in JUSTIFIED:
        assert pos <= 5, describe(rows[0])
        return
    best = rows[0]
    assert best["step_time_s"] < rows[pos - 1]["step_time_s"]
    if JUSTIFIED[row["params_b"]] == "less tp":
        assert best["tp"] < row["tp"], describe(best)
    else:
        assert (best["tp"], best["pp"], best["dp"]) == (row["tp"], row["pp"], fix["dp"])


FIGURES = Path(__file__).resolve().parents[1] / "experiments" / "data" / "sc21_figures.toml"
# Claims of SC'21's text the model still misses (strict: a fix that makes one hold must move it
# out of here). Fig. 12 without scatter/gather: the model keeps interleaving 2.8% ahead of 1F1B at
# batch 60, i.e. it prices cross-node p2p too cheaply (an inter-node efficiency of ~0.6 instead of
# 0.8 would make both this and Fig. 18's <= 11% hold). Fig. 17: 145B without recomputation is
# predicted at 69 GiB for 16 micro-batches in flight, under 80 GB by 5 GiB; the paper ran out.
KNOWN_MISSES = {"without scatter/gather, 1F1B beats interleaved at larger batch sizes (batch 60)",
                "145B, (8,16): without recomputation large batches do not fit (best with it is "
                "up to 2x)"}


@pytest.mark.parametrize("check", load_checks(FIGURES), ids=lambda ch: f"fig{ch['figure']}")
def test_sc21_figure_claims(check):
    ok, shown = run_check(check, load_cluster("dgx-a100-80gb"))
    if check["claim"] in KNOWN_MISSES:
        assert not ok, f"now holds, move it out of KNOWN_MISSES: {check['claim']} ({shown})"
    else:
        assert ok, f"{check['claim']}: model {shown}"


def test_wave_quantization_by_hand():
    c = load_cluster("dgx-a100-80gb")  # 108 SMs, 256 x 128 tiles
    assert c.wave_efficiency(2048, 5760) == pytest.approx(360 / 432)  # 8 x 45 tiles, 4 waves
    assert c.wave_efficiency(4096, 5760) == pytest.approx(720 / 756)
    assert c.wave_efficiency(256, 128, batch=108) == 1.0


@pytest.fixture(scope="module")
def sc21_errors():
    c = load_cluster("dgx-a100-80gb")
    return c, table1(), log_errors(c, table1())


def test_bundled_constants_are_the_fit_on_all_ten_rows(sc21_errors):
    c, rows, errors = sc21_errors
    eff, half, rms = fit(c, rows, errors)
    assert (eff, half) == (c.gemm_max_efficiency, c.gemm_half_dim)
    assert rms < 0.05
    assert GRID_EFF[0] < eff < GRID_EFF[-1] and GRID_HALF[0] < half < GRID_HALF[-1]  # interior


def test_sc21_leave_one_out_within_15_percent(sc21_errors):
    """Each row predicted with the constants fitted on the other nine: out of sample."""
    c, rows, errors = sc21_errors
    loo = leave_one_out(c, rows, errors)
    for r in loo:
        assert abs(r["error"]) < 0.15, (r["row"]["params_b"], r["error"])
    # the fitted constants barely move when any one row is left out: a hardware property
    assert max(r["max_efficiency"] for r in loo) - min(r["max_efficiency"] for r in loo) < 0.05


def test_paper_row_matches_the_fix_path():
    c = load_cluster("dgx-a100-80gb")
    for row in table1()[::3]:
        assert paper_row(row, c)["step_time_s"] == pytest.approx(predict(row, c)["step_time_s"])


@pytest.mark.parametrize("row", korthikanti.table(), ids=lambda r: f"{r['model']}-{r['mode']}")
def test_korthikanti_2022_predicted_with_frozen_constants(row):
    """A second paper, nothing refitted: iteration time within 15%, and the published MFU (where
    given) agrees with the published time under our FLOP count (the data are consistent)."""
    got = korthikanti.predict(row)
    assert got["fits"]
    assert abs(got["error"]) < 0.15, got["error"]
    if row["mfu_pct"] is not None:
        assert 100 * got["published_mfu"] == pytest.approx(row["mfu_pct"], abs=0.5)


def test_korthikanti_seqsel_faster_than_full_as_published():
    rows = {(r["model"], r["mode"]): r for r in korthikanti.table()}
    for model in ("22B", "175B", "530B", "1T"):
        full = korthikanti.predict(rows[model, "full"])["step_time_s"]
        seqsel = korthikanti.predict(rows[model, "seqsel"])["step_time_s"]
        published = rows[model, "full"]["iteration_s"] / rows[model, "seqsel"]["iteration_s"]
        assert full / seqsel == pytest.approx(published, rel=0.08)


def test_state_bytes_are_megatrons():
    """Megatron-LM distrib_optimizer.md: 20 / 18 / 16 bytes per parameter, and 4 + 16/d,
    6 + 12/d, 8 + 8/d with the distributed optimizer."""
    assert {k: sum(v) for k, v in STATE_BYTES.items()} == {"fp16": 20, "bf16": 18, "fp32": 16}
    assert state_bytes(1.0, "bf16", 8, True) == pytest.approx(6 + 12 / 8)
    assert state_bytes(1.0, "fp16", 4, True) == pytest.approx(4 + 16 / 4)
    assert state_bytes(1.0, "fp32", 2, False) == 16


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mpipar.cli", "plan", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_json_schema_and_order():
    r = _cli("--model", "gpt-39b", "--gpus", "64", "--global-batch", "128", "--top", "4",
             "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 4
    need = {"dp", "pp", "tp", "schedule", "microbatch_size", "recompute", "step_time_s",
            "tflops_per_gpu", "mfu", "memory_gib", "fits", "bubble", "v", "sp", "zero1"}
    for row in rows:
        assert need <= set(row)
        assert row["fits"] and 0 < row["mfu"] < 1 and 0 <= row["bubble"] < 1
        assert row["dp"] * row["pp"] * row["tp"] == 64
    times = [row["step_time_s"] for row in rows]
    assert times == sorted(times)


def test_fix_evaluates_one_configuration():
    r = _cli("--layers", "48", "--hidden", "8192", "--heads", "64", "--seq", "2048", "--gpus",
             "512", "--global-batch", "1536", "--fix",
             "dp=32,pp=2,tp=8,schedule=1f1b,mbs=4,recompute=full,sp=0,zero1=0", "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 1
    got = tuple(rows[0][k] for k in ("dp", "pp", "tp", "microbatch_size"))
    assert got == (32, 2, 8, 4)
    assert rows[0]["microbatches"] == 12
    # partly fixed: the rest is searched, every row keeps the fixed part
    part = plan(load_model("gpt-39b"), load_cluster("h200"), 512, 1536, fixed=parse_fix("tp=4"))
    assert part and all(row["tp"] == 4 for row in part)


@pytest.mark.parametrize("args,words", [
    (("--model", "gpt-1.7b", "--gpus", "7", "--global-batch", "512"), "gpus"),
    (("--layers", "4", "--hidden", "96", "--heads", "7", "--seq", "64", "--gpus", "16",
      "--global-batch", "16"), "heads"),
    (("--model", "gpt-1t", "--gpus", "8", "--global-batch", "8"), "fits"),
    (("--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512", "--fix", "tp=3"), "--fix"),
    (("--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512", "--fix", "foo=1"), "KEY"),
    (("--model", "nope", "--gpus", "8", "--global-batch", "8"), "preset"),
    (("--model", "gpt-1.7b", "--cluster", "nope", "--gpus", "8", "--global-batch", "8"), "bundled"),
])
def test_bad_inputs_exit_2_with_a_message(args, words):
    r = _cli(*args)
    assert r.returncode == 2
    assert words in r.stderr and "error" in r.stderr


def test_bundled_clusters_load():
    for name in ("dgx-a100-80gb", "dgx-h100", "h200"):
        c = load_cluster(name)
        assert c.gpus_per_node == 8 and c.peak["bf16"] > 3e14


@pytest.mark.slow
def test_1t_on_3072_gpus_is_fast():
    t0 = time.perf_counter()
    r = _cli("--model", "gpt-1t", "--gpus", "3072", "--global-batch", "3072", "--top", "5")
    seconds = time.perf_counter() - t0
    print(f"mpipar plan, 1T model on 3072 GPUs, full search: {seconds:.1f} s (machine under load)")
    assert r.returncode == 0, r.stderr
    assert seconds < 120


def test_placement_megatron_vs_mpipar():
    """Megatron-LM's rank order (tp, dp, pp) puts a tp 2, pp 4 pipeline's stages 64 ranks apart
    (every boundary across nodes) and its DP groups 4 to a node; mpipar's (tp, pp, dp) keeps the
    pipeline in one node and spreads each DP group one to a node."""
    from mpipar.plan import Config, evaluate

    c = load_cluster("dgx-a100-80gb")
    m = load_model("gpt-18b")
    base = dict(dp=32, pp=4, tp=2, schedule="1f1b", v=1, microbatch_size=2, recompute="full",
                sp=False, zero1=False, dp_overlap=False)
    ours, meg = Config(**base), Config(**base, placement="tp-dp-pp")
    assert ours.strides() == (2, 8) and meg.strides() == (64, 2)
    a, b = (evaluate(m, c, c.peak["fp16"], "fp16", 1024, x) for x in (ours, meg))
    assert b["p2p_s"] > a["p2p_s"] and b["dp_allreduce_s"] < a["dp_allreduce_s"]
    assert b["placement"] == "tp-dp-pp"
    assert parse_fix("placement=tp-dp-pp") == {"placement": "tp-dp-pp"}
    with pytest.raises(Exception, match="placement"):
        parse_fix("placement=pp-tp-dp")


def test_figure_16_needs_wave_quantization():
    """The figure checks discriminate: without wave quantization (one-element tiles: every wave
    full) and with the constants fitted without it, Figure 16's optimum (micro-batch 2) is lost."""
    import dataclasses

    c = load_cluster("dgx-a100-80gb")
    old = dataclasses.replace(c, tile=(1, 1), gemm_max_efficiency=0.705, gemm_half_dim=48.0)
    fig16 = [ch for ch in load_checks(FIGURES) if ch["figure"] == "16"]
    assert fig16 and all(run_check(ch, c)[0] for ch in fig16)
    assert not any(run_check(ch, old)[0] for ch in fig16)
