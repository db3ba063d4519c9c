"""Pipeline schedules as data: generators, checker, text format, the `mpipar schedule` command."""

import subprocess
import sys

import pytest

from mpipar.parallel.pipeline.actions import Action, Schedule, ScheduleError
from mpipar.parallel.pipeline.check import check_schedule
from mpipar.parallel.pipeline.generators import (
    MULTI_CHUNK,
    SCHEDULES,
    build_schedule,
    default_virtual_stages,
    validate,
    weight_versions,
)


def grid():
    """(kind, pp, m, v) over pp 1..8 and m below, equal to, above and not a multiple of pp."""
    for kind in SCHEDULES:
        for pp in range(1, 9):
            for m in sorted({1, 2, 3, pp, pp + 1, 2 * pp, 3 * pp + 1}):
                for v in ((2, 3) if kind in MULTI_CHUNK else (default_virtual_stages(kind),)):
                    try:
                        validate(kind, pp, m, v)
                    except ScheduleError:
                        continue
                    yield kind, pp, m, v


def test_every_generator_passes_the_checker():
    n = 0
    for kind, pp, m, v in grid():
        s = build_schedule(kind, pp, m, v)
        check_schedule(s)
        assert len(s.ranks) == pp
        n += 1
    assert n > 200


@pytest.mark.parametrize("kind", SCHEDULES)
def test_pp1_is_plain_gradient_accumulation(kind):
    m = 1 if kind == "naive" else 4
    s = build_schedule(kind, 1, m, default_virtual_stages(kind))
    check_schedule(s)
    assert not any(a.is_comm for a in s.ranks[0])


def test_format_parse_round_trip(tmp_path):
    for kind, pp, m, v in [("1f1b", 4, 6, 1), ("interleaved", 2, 4, 3), ("pipedream", 3, 5, 1),
                           ("zb-h1", 3, 7, 1)]:
        s = build_schedule(kind, pp, m, v)
        t = Schedule.parse(s.format())
        assert t == s
        s.save(tmp_path / "s.txt")
        assert Schedule.load(tmp_path / "s.txt") == s


def test_parse_reports_line_and_column():
    text = "schedule kind=x pp=1 microbatches=1\nrank 0: F0.0 BX0.0\n"
    with pytest.raises(ScheduleError, match=r"line 2, column 14: bad action 'BX0.0'"):
        Schedule.parse(text)
    with pytest.raises(ScheduleError, match="no 'rank 1:' line"):
        Schedule.parse("schedule pp=2 microbatches=1\nrank 0: F0.0 BW0.0\n")
    with pytest.raises(ScheduleError, match="unknown header key 'q'"):
        Schedule.parse("schedule pp=2 q=1 microbatches=1\n")


@pytest.mark.parametrize(
    "args, match",
    [
        (("bogus", 2, 4), "valid schedules: naive, gpipe, 1f1b, interleaved, zb-h1, pipedream, "
                          "zb-h2, zb-v, looped-bfs, v-half, v-min, dualpipev"),
        (("zb-v", 2, 4), "set virtual_stages=2"),
        (("looped-bfs", 2, 4, 1), "virtual_stages >= 2.*gpipe"),
        (("dualpipev", 4, 7, 2), "microbatches >= 2 \\* pp = 8"),
        (("1f1b", 2, 0), "microbatches must be a positive integer"),
        (("interleaved", 2, 4, 1), "virtual_stages >= 2"),
        (("interleaved", 4, 6, 2), "multiple of pp=4.*microbatches=4 or 8"),
        (("gpipe", 2, 4, 2), "only meaningful for the interleaved"),
        (("naive", 2, 4), "microbatches must be 1"),
    ],
)
def test_bad_settings_are_rejected(args, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule(*args)


def two_rank(text0, text1, asynchronous=False):
    acts = [[Action(t[0], int(t[1]), int(t[2])) for t in (w.split(":") for w in x.split())]
            for x in (text0, text1)]
    return Schedule("custom", 2, 1, 1, acts, asynchronous)


GOOD0 = "F:0:0 SEND_F:0:0 RECV_B:0:0 BW:0:0"
GOOD1 = "RECV_F:0:1 F:0:1 BW:0:1 SEND_B:0:1"


def test_checker_accepts_the_hand_made_good_one():
    check_schedule(two_rank(GOOD0, GOOD1))


def test_checker_missing_receive():
    s = two_rank(GOOD0, "F:0:1 BW:0:1 SEND_B:0:1")
    with pytest.raises(ScheduleError, match=r"rank 1: missing RECV_F0\.1"):
        check_schedule(s)


def test_checker_cycle_under_rendezvous():
    # Each rank sends before it receives: fine with buffering, a deadlock with blocking sends.
    s = Schedule.parse(
        "schedule pp=2 microbatches=2\n"
        "rank 0: F0.0 F1.0 SEND_F1.0 SEND_F0.0 RECV_B0.0 BW0.0 RECV_B1.0 BW1.0\n"
        "rank 1: RECV_F0.1 F0.1 RECV_F1.1 F1.1 BW0.1 SEND_B0.1 BW1.1 SEND_B1.1\n"
    )
    with pytest.raises(ScheduleError, match=r"deadlock: cycle rank 0 at SEND_F1\.0 -> rank 1 at "
                       r"RECV_F0\.1 -> rank 0") as e:
        check_schedule(s)
    assert "rank 0, action 2 (SEND_F1.0)" in str(e.value)


def test_checker_wrong_rank():
    s = two_rank(GOOD0 + " F:0:1", GOOD1)
    with pytest.raises(ScheduleError, match=r"rank 0, action 4 \(F0\.1\): wrong rank"):
        check_schedule(s)


def test_checker_w_before_b():
    s = Schedule.parse(
        "schedule pp=2 microbatches=1\n"
        "rank 0: F0.0 SEND_F0.0 RECV_B0.0 W0.0 B0.0\n"
        "rank 1: RECV_F0.1 F0.1 B0.1 SEND_B0.1 W0.1\n"
    )
    with pytest.raises(ScheduleError, match=r"rank 0, action 3 \(W0\.0\) comes before rank 0, "
                       r"action 4 \(B0\.0\)"):
        check_schedule(s)


def test_checker_duplicate_and_update_in_flush_schedule():
    with pytest.raises(ScheduleError, match=r"action 4 \(BW0\.0\): duplicate"):
        check_schedule(two_rank(GOOD0 + " BW:0:0", GOOD1))
    with pytest.raises(ScheduleError, match="UPDATE is only allowed in asynchronous"):
        check_schedule(two_rank(GOOD0 + " UPDATE:0:0", GOOD1))


def test_checker_send_before_compute():
    s = two_rank("SEND_F:0:0 F:0:0 RECV_B:0:0 BW:0:0", GOOD1)
    with pytest.raises(ScheduleError, match=r"SEND_F0\.0\) comes before .*F0\.0"):
        check_schedule(s)


def test_1f1b_shape():
    s = build_schedule("1f1b", 4, 8)
    comp = [[str(a) for a in acts if a.is_compute] for acts in s.ranks]
    assert comp[0][:5] == ["F0.0", "F1.0", "F2.0", "F3.0", "BW0.0"]  # 3 warm-up + 1F1B
    assert comp[3][:4] == ["F0.3", "BW0.3", "F1.3", "BW1.3"]


def test_pipedream_updates_and_weight_versions():
    pp, m = 3, 6
    s = build_schedule("pipedream", pp, m)
    assert s.asynchronous
    vers = weight_versions(s)
    for r in range(pp):
        for mb in range(m):
            # F(mb) on rank r comes after the BW+UPDATE of micro-batches 0..mb-(pp-r) there.
            assert vers[(mb, r)] == max(0, mb - (pp - r - 1))
        comp = [a for a in s.ranks[r] if a.is_compute]  # the gradient goes out, then UPDATE
        for i, a in enumerate(comp):
            if a.op == "BW":
                assert comp[i + 1] == Action("UPDATE", a.mb, a.chunk)
    assert all(v == 0 for v in weight_versions(build_schedule("1f1b", pp, m)).values())


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mpipar.cli", "schedule", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_chart_png_file_costs(tmp_path):
    png, txt = tmp_path / "s.png", tmp_path / "s.txt"
    p = run_cli("--kind", "1f1b", "--pp", "4", "--microbatches", "8", "--png", str(png),
                "--save", str(txt))
    assert p.returncode == 0, p.stderr
    assert "rank 3: .  .  .  F0 B0 B0 F1" in p.stdout
    assert "bubble fraction (simulated): 0.2727" in p.stdout  # 3 / 11
    assert "bubble fraction (textbook): 0.2727" in p.stdout
    assert "peak activations (micro-batch x chunk held, per rank): 4 3 2 1" in p.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    p = run_cli("--file", str(txt), "--costs", "F=1,B=1,W=1,comm=0.5")
    assert p.returncode == 0, p.stderr
    assert "comm=0.5" in p.stdout and "BW=2" in p.stdout
    for flag in ("--virtual-stages", "--virtual"):  # --virtual: the older name, still accepted
        p = run_cli("--kind", "interleaved", "--pp", "2", "--microbatches", "4", flag, "3")
        assert p.returncode == 0, p.stderr
        assert "F0a" in p.stdout and "(simulated): 0.0769" in p.stdout  # (p-1)/(v m+p-1) = 1/13
        assert "virtual_stages=3" in p.stdout


@pytest.mark.parametrize(
    "args, match",
    [
        (("--kind", "nope"), "valid schedules"),
        (("--kind", "interleaved", "--microbatches", "6"), "multiple of pp"),
        (("--costs", "F=oops"), "bad --costs item"),
        (("--file", "/nonexistent/x.txt"), "cannot read schedule file"),
    ],
)
def test_cli_bad_input(args, match):
    p = run_cli(*args)
    assert p.returncode != 0
    assert match in p.stderr and "Traceback" not in p.stderr


def test_cli_rejects_broken_file(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_text("schedule pp=2 microbatches=1\nrank 0: F0.0 SEND_F0.0 RECV_B0.0 BW0.0\n"
                 "rank 1: F0.1 BW0.1 SEND_B0.1\n")
    p = run_cli("--file", str(f))
    assert p.returncode != 0 and "missing RECV_F0.1" in p.stderr and "Traceback" not in p.stderr


def test_placement_reports_orders_that_cannot_run():
    from mpipar.parallel.pipeline.generators import _add_communication

    # rank 0 wants BW0.0 (needs rank 1's BW0.1, which needs rank 0's F0.0) before F0.0
    orders = [[Action("BW", 0, 0), Action("F", 0, 0)], [Action("F", 0, 1), Action("BW", 0, 1)]]
    with pytest.raises(ScheduleError, match=r"compute orders deadlock: rank 0 at BW0\.0; "
                       r"rank 1 at F0\.1"):
        _add_communication(2, 2, orders)


def test_simulate_reports_a_receive_whose_send_never_comes():
    from mpipar.parallel.pipeline.simulate import simulate

    s = two_rank("F:0:0 RECV_B:0:0 BW:0:0", GOOD1)
    with pytest.raises(ScheduleError, match=r"simulation stuck .*rank 0 at RECV_B0\.0; "
                       r"rank 1 at RECV_F0\.1"):
        simulate(s)


# -- issue 16: placement and the 2023-2025 schedules ----------------------------------------------

UNIT = {"F": 1, "B": 1, "W": 1}


def sim(kind, pp, m):
    from mpipar.parallel.pipeline.formulas import peak_stage_activations, span_bubble
    from mpipar.parallel.pipeline.simulate import simulate

    v = default_virtual_stages(kind)
    s = build_schedule(kind, pp, m, v)
    check_schedule(s)
    r = simulate(s, UNIT)
    return r.bubble_fraction, span_bubble(r), peak_stage_activations(r, v)


@pytest.mark.parametrize("kind", ["zb-h2", "zb-v"])
def test_zero_bubble_schedules_match_the_paper(kind):
    from mpipar.parallel.pipeline.formulas import published

    for pp in (2, 3, 4, 6, 8):
        for m in (2 * pp - 1, 2 * pp, 3 * pp + 1):
            sync, span, peak = sim(kind, pp, m)
            pub = published(kind, pp, m)
            assert span == pytest.approx(0.0, abs=1e-12), (kind, pp, m)  # parallelogram
            assert sync == pytest.approx(pub["sync"], abs=1e-12), (kind, pp, m)
            assert peak == pub["peak"], (kind, pp, m)
    # below the minimum the schedule still runs, with a bubble
    assert sim(kind, 4, 3)[1] > 0


def test_zb_v_holds_1f1b_memory_zb_h2_twice():
    for pp in (2, 4, 8):
        f1b = sim("1f1b", pp, 4 * pp)[2]
        assert sim("zb-v", pp, 4 * pp)[2] == f1b == pp
        assert sim("zb-h2", pp, 4 * pp)[2] == 2 * pp - 1


def test_looped_bfs_is_gpipe_over_the_chunks():
    for pp, m in [(2, 4), (4, 4), (4, 8), (8, 16)]:
        sync, _, peak = sim("looped-bfs", pp, m)
        assert sync == pytest.approx((pp - 1) / (2 * m + pp - 1), abs=1e-12)
        assert peak == m
    s = build_schedule("looped-bfs", 2, 3, 2)
    comp = [str(a) for a in s.ranks[0] if a.is_compute]
    assert comp == ["F0.0", "F1.0", "F2.0", "F0.2", "F1.2", "F2.2",
                    "BW2.2", "BW1.2", "BW0.2", "BW2.0", "BW1.0", "BW0.0"]


@pytest.mark.parametrize("kind, frac", [("v-half", 2), ("v-min", 3)])
def test_v_half_and_v_min_memory(kind, frac):
    from mpipar.parallel.pipeline.formulas import published

    for pp in (2, 4, 6, 8):
        for m in (pp, 2 * pp, 4 * pp):
            sync, span, peak = sim(kind, pp, m)
            assert peak == published(kind, pp, m)["peak"]  # (p+2)//2 or (p+4)//3, exactly
            assert peak * frac <= pp + 4  # about 1/2 (1/3) of 1F1B's pp
            if kind == "v-half":  # half the memory, still less bubble than 1F1B
                assert sync < sim("1f1b", pp, m)[0]


def test_dualpipev_memory_and_bubble():
    for pp in (2, 4, 8):
        for m in (2 * pp, 3 * pp):
            sync, _, peak = sim("dualpipev", pp, m)
            assert peak == pp + 0.5  # DeepSeek: PP + 1 chunk activations, PP = 2 pp chunks
            # F&B in sequence, waiting for both inputs: ZB-H1's bubble (derived, formulas.py)
            assert sync == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12)


def test_v_placement():
    s = build_schedule("zb-v", 4, 8, 2)
    assert s.placement == "v"
    assert [s.rank_of(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert s.chunks_of(0) == [0, 7] and s.chunks_of(3) == [3, 4]
    assert [s.local_chunk(c) for c in (0, 7, 3, 4)] == [0, 1, 0, 1]
    # chunks 3 and 4 share rank 3: no send or receive between them
    assert not any(a.is_comm and a.chunk in (3, 4) and a.op in ("SEND_F", "RECV_B")
                   and a.chunk == 3 for a in s.ranks[3])
    t = Schedule.parse(s.format())
    assert t == s and "placement=v" in s.header()
    assert Schedule.parse(build_schedule("1f1b", 2, 2).format()).placement == "loop"


def test_v_placement_errors():
    with pytest.raises(ScheduleError, match="placement must be one of loop, v"):
        Schedule.parse("schedule pp=2 virtual=2 microbatches=1 placement=w\n")
    with pytest.raises(ScheduleError, match="exactly two chunks per rank"):
        Schedule.parse("schedule pp=2 virtual=3 microbatches=1 placement=v\n")
    s = build_schedule("zb-v", 2, 2, 2)
    s.placement = "loop"  # the same actions under the wrong placement
    with pytest.raises(ScheduleError, match=r"wrong rank: chunk 3 lives on rank 1 "
                       r"\(placement loop\)"):
        check_schedule(s)
    bad = Schedule.parse(
        "schedule pp=1 virtual=2 microbatches=1 placement=v\n"
        "rank 0: F0.0 SEND_F0.0 RECV_F0.1 F0.1 B0.1 W0.1 B0.0 W0.0\n")
    with pytest.raises(ScheduleError, match="both on rank 0.*remove SEND_F0.0"):
        check_schedule(bad)


def test_forward_only_and_build_chunks_follow_the_placement():
    from mpipar.parallel.pipeline.executor import build_chunks
    from mpipar.parallel.pipeline.generators import forward_only

    s = forward_only(3, 2, 2, "v")
    assert all(s.rank_of(a.chunk) == r for r, acts in enumerate(s.ranks) for a in acts)
    assert "RECV_F0.3" not in [str(a) for a in s.ranks[2]]  # chunks 2 and 3 both on rank 2
    assert "RECV_F0.4" in [str(a) for a in s.ranks[1]]

    class Model:
        units = list(range(12))

    bounds = {c: (2 * c, 2 * c + 2) for c in range(6)}
    v = build_schedule("zb-v", 3, 3, 2)
    assert sorted(build_chunks(Model, bounds, 0, 3, rank_of=v.rank_of)) == [0, 5]
    assert sorted(build_chunks(Model, bounds, 0, 3)) == [0, 3]


def test_dualpipev_pairs_forward_and_backward_of_other_micro_batches():
    s = build_schedule("dualpipev", 2, 4, 2)
    comp = [a for a in s.ranks[0] if a.is_compute]
    # the main phase: F of one chunk right before a backward of the other, other micro-batch
    pairs = [(a, b) for a, b in zip(comp, comp[1:])
             if a.op == "F" and b.op in ("B", "BW") and a.chunk != b.chunk and a.mb != b.mb]
    assert len(pairs) >= 2
    assert s.pairs and all(s.ranks[r][i].op == "F" for r, i in s.pairs)
    # nothing between the halves; the text form writes F&B and reads it back
    assert "F3.0&BW1.3" in s.format() and Schedule.parse(s.format()) == s
    bad = Schedule.parse(s.format().replace("F3.0&BW1.3", "F3.0 BW1.3"))
    check_schedule(bad)  # unpaired, still a valid schedule
    broken = Schedule.parse(s.format())
    broken.pairs.append((0, 0))
    with pytest.raises(ScheduleError, match="F&B of two different micro-batches"):
        check_schedule(broken)


def test_pipedream_2bw_applies_gradients_one_step_late(tmp_path):
    """PipeDream-2BW's weight versions on one rank: W(k+1) = W(k) - lr g_k(W(k-1)), W(-1) = W(0)
    (SGD without momentum, so the replay is one line). Grids are checked against this one rank
    in tests/test_parallel_equivalence.py."""
    import numpy as np

    from mpipar.backend import Backend
    from mpipar.config import load_config
    from mpipar.datasets import prepare_synthetic
    from mpipar.mpi import ProcessGrid
    from mpipar.trace import Tracer
    from mpipar.training import Trainer, step_lr

    data = tmp_path / "d.h5"
    prepare_synthetic(data, "markov", 5000, 256, seed=0)

    def trainer(schedule):
        cfg = load_config(None, {
            "train.dtype": "float64", "train.steps": 3, "train.batch_size": 4,
            "train.seq_len": 8, "train.lr": 0.1, "train.warmup_steps": 0, "train.grad_clip": 0,
            "train.eval_interval": 0, "train.optimizer": "sgd", "train.momentum": 0.0,
            "train.weight_decay": 0.0, "parallel.schedule": schedule,
            "parallel.microbatches": 2, "run.trace": False, "data.path": str(data),
            "model.n_layer": 2, "model.n_embd": 16, "model.n_head": 4, "model.block_size": 8})
        b = Backend("cpu", "float64")
        return Trainer(cfg, ProcessGrid(1, 1, 1, backend=b), Tracer(enabled=False), b, str(data))

    tbw, ref = trainer("pipedream-2bw"), trainer("1f1b")
    weights = [[p.data.copy() for p in ref.params]]
    for k in range(3):
        for p, w in zip(ref.params, weights[max(k - 1, 0)]):  # the older buffer
            p.data[...] = w
        ref.step = k
        ref.forward_backward()
        lr = step_lr(ref.cfg, k)
        weights.append([w - lr * p.grad for w, p in zip(weights[k], ref.params)])
        tbw.train_step()
    assert all(np.array_equal(p.data, w) for p, w in zip(tbw.params, weights[3]))
    plain = trainer("1f1b")
    for _ in range(3):
        plain.train_step()
    assert not all(np.array_equal(p.data, w) for p, w in zip(plain.params, weights[3]))
