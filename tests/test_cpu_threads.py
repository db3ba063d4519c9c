"""mpipar's own CPU threads (mpipar.nn.cpu): they change which thread computes what, never the
result. Thresholds are lowered so that small float64 arrays are split into many blocks."""

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_models import BK, gpt_cfg, loss_and_grads, randomize

from mpipar.models import build_model
from mpipar.nn import cpu
from mpipar.nn import functional as F
from mpipar.nn.optim import AdamW


@pytest.fixture
def threads(monkeypatch):
    """Small blocks and no size thresholds; gives a setter for the kernel threads, and puts the
    process's own count back afterwards."""
    monkeypatch.setattr(cpu, "BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 1)
    monkeypatch.setattr(cpu, "PARALLEL_MIN_MNK", 1)
    before = cpu.kernel_threads()
    yield cpu.set_kernel_threads
    cpu.set_kernel_threads(before)


def kernels(rng):
    """Every threaded kernel on random float64 inputs; returns all the arrays they produce."""
    # products are shared out in ROW_ALIGN-row multiples: at least two shares of every one here
    x = rng.normal(size=(6, 37, 100))
    w, b = rng.normal(size=(100, 104)), rng.normal(size=104)
    dy = rng.normal(size=(6, 37, 104))
    g, beta = rng.normal(size=100), rng.normal(size=100)
    dln = rng.normal(size=x.shape)
    q, k, v, do = (rng.normal(size=(3, 4, 70, 8)) for _ in range(4))
    mask = F.causal_mask(np, 70, 70)
    ids = rng.integers(0, 9, size=(6, 37))

    out = [F.linear_forward(x, w, b), F.linear_backward_input(dy, w)]
    dw, db = rng.normal(size=w.shape), rng.normal(size=b.shape)  # accumulating onto non-zeros
    F.linear_backward_weight(x, dy, dw, db)
    y, t = F.gelu_forward(dy)
    out += [dw, db, y, t, F.gelu_backward(dy, dy, t)]
    ln = F.layernorm_forward(x, g, beta)
    dg, dbeta = rng.normal(size=100), rng.normal(size=100)
    F.layernorm_backward_weight(dln, ln[1], dg, dbeta)
    out += [*ln, F.layernorm_backward_input(dln, ln[1], ln[2], g), dg, dbeta]
    att, p = F.attention_forward(q, k, v, mask)
    out += [att, p, *F.attention_backward(do, q, k, v, p, out=att, mask=mask)]
    table = rng.normal(size=(9, 104))
    F.embedding_backward_weight(ids, dy, table)
    out += [table, F.add(x, g, out=np.empty_like(x)), F.add(dy, dy, out=dy.copy())]
    return [a.copy() for a in out]


def test_kernels_give_the_same_bits_on_any_number_of_threads(threads):
    threads(1)
    ref = kernels(np.random.default_rng(0))
    for n in (2, 3):
        threads(n)
        for i, (a, c) in enumerate(zip(ref, kernels(np.random.default_rng(0)), strict=True)):
            assert np.array_equal(a, c), (n, i)


def test_adamw_and_a_whole_gpt_step_do_not_depend_on_the_threads(threads):
    def run():
        model = build_model(gpt_cfg(n_embd=16, block_size=24), BK, seed=2)
        randomize(model, 5)
        rng = np.random.default_rng(1)
        x, y = rng.integers(0, 13, size=(3, 24)), rng.integers(0, 13, size=(3, 24))
        loss = loss_and_grads(model, x, y)
        AdamW(model.params(), 1e-2, weight_decay=0.1).step()
        return loss, [p.grad.copy() for p in model.params()], [p.data.copy() for p in
                                                               model.params()]

    threads(1)
    loss1, g1, w1 = run()
    threads(2)
    loss2, g2, w2 = run()
    assert loss1 == loss2
    for a, b in zip(g1 + w1, g2 + w2, strict=True):
        assert np.array_equal(a, b)


def test_embedding_gradient_equals_add_at():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50, size=(8, 300))  # many repeats
    dy = rng.normal(size=(8, 300, 16))
    start = rng.normal(size=(50, 16))
    ref = start.copy()
    np.add.at(ref, ids.reshape(-1), dy.reshape(-1, 16))
    got = start.copy()
    F.embedding_backward_weight(ids, dy, got)
    assert np.allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_run_blocks_runs_each_block_once_and_raises_after_all_stopped(threads):
    threads(3)
    seen, lock = [], threading.Lock()

    def record(i):
        with lock:
            seen.append(i)

    cpu.run_blocks(range(100), record)
    assert sorted(seen) == list(range(100))

    done = []

    def fail_on_7(i):
        if i == 7:
            raise RuntimeError("block 7 failed")
        with lock:
            done.append(i)

    with pytest.raises(RuntimeError, match="block 7"):
        cpu.run_blocks(range(50), fail_on_7)
    n = len(done)
    time.sleep(0.05)
    assert len(done) == n and 7 not in done  # nothing still running after the raise


def test_kernel_threads_hold_blas_at_one_thread_and_give_it_back():
    from threadpoolctl import threadpool_info

    def blas():
        return {i["filepath"]: i["num_threads"] for i in threadpool_info()
                if i["user_api"] == "blas"}

    before_threads = cpu.kernel_threads()
    try:
        cpu.set_kernel_threads(1)
        free = blas()
        cpu.set_kernel_threads(2)
        assert set(blas().values()) == {1}
        with cpu.blas_threads(2):
            assert set(blas().values()) == {2}
        assert set(blas().values()) == {1}
        cpu.set_kernel_threads(1)
        assert blas() == free
        with pytest.raises(ValueError, match="kernel threads must be >= 1"):
            cpu.set_kernel_threads(0)
    finally:
        cpu.set_kernel_threads(before_threads)


def test_split_product_handles_strided_views(threads):
    """cpu.matmul with a transposed left operand and a strided output, accumulating."""
    threads(2)
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(50, 30)), rng.normal(size=(50, 20))
    out = rng.normal(size=(60, 20))
    ref = out.copy()
    ref[::2] += a.T @ b
    cpu.matmul(np, a.T, b, out[::2], accumulate=True)
    assert np.allclose(out, ref, rtol=1e-13, atol=1e-13)
    assert np.array_equal(out[1::2], ref[1::2])  # rows in between untouched


def test_without_threadpoolctl_the_kernels_still_run(monkeypatch, threads):
    """A machine without threadpoolctl (say, a GPU node's preinstalled Python): a warning,
    BLAS left as it is, the same results."""
    threads(1)
    ref = kernels(np.random.default_rng(2))
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "threadpoolctl", None)  # import now raises ImportError
        with pytest.warns(RuntimeWarning, match="threadpoolctl is not installed"):
            threads(2)
        with cpu.blas_threads(2):
            pass
        got = kernels(np.random.default_rng(2))
        threads(1)
    for a, c in zip(ref, got, strict=True):
        assert np.array_equal(a, c)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_threaded_kernels(threads):
    """After fork the child has none of the parent's kernel threads: it starts its own (and
    never waits on the parent's, which would hang)."""
    threads(2)
    x = np.random.default_rng(0).normal(size=(64, 50))
    ref = F.gelu_forward(x)[0].copy()  # the parent's pool is running now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: compute and report, whatever happens
        ok = b"0"
        try:
            seen = set()

            def slow(_):
                seen.add(threading.get_ident())
                time.sleep(0.02)

            cpu.run_blocks(range(10), slow)
            same = np.array_equal(F.gelu_forward(x)[0], ref)
            ok = b"1" if same and len(seen) == 2 else b"0"
        finally:
            os.write(w, ok)
            os._exit(0)
    os.close(w)
    deadline = time.time() + 30
    while time.time() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the parent's kernel threads")
    assert os.read(r, 1) == b"1"


@pytest.mark.parametrize("value", ["0", "abc", "-2", "1.5"])
def test_a_bad_thread_count_is_refused_with_what_to_change(value, monkeypatch, capsys):
    from mpipar.cli import main

    monkeypatch.setenv("MPIPAR_KERNEL_THREADS", value)
    config = Path(__file__).resolve().parents[1] / "experiments/configs/tiny.toml"
    assert main(["train", "--config", str(config), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"MPIPAR_KERNEL_THREADS={value!r}" in err and "whole number" in err
    with pytest.raises(ValueError, match="MPIPAR_KERNEL_THREADS"):
        cpu._threads_from_environment()


def test_the_readme_tiny_model_keeps_every_kernel_on_the_calling_thread(monkeypatch):
    """README's one-rank tiny run (experiments/configs/tiny.toml: 4 blocks of width 64, a
    micro-batch of 4 x 64 tokens) with two kernel threads: every product, element-wise chain and
    the AdamW update are below the sizes that pay for a hand-off, so the size of the work keeps
    it on one thread, where it ran fastest (README); the pool is never used."""
    from mpipar.backend import Backend

    def no_pool():
        raise AssertionError("a tiny model's kernel was handed to the kernel threads")

    before = cpu.kernel_threads()
    cpu.set_kernel_threads(2)
    monkeypatch.setattr(cpu, "_thread_pool", no_pool)
    try:
        model = build_model(gpt_cfg(vocab_size=256, block_size=64, n_layer=4, n_embd=64,
                                    n_head=4), Backend("cpu", "float32"))
        rng = np.random.default_rng(0)
        x, y = (rng.integers(0, 256, size=(4, 64)) for _ in range(2))
        for p in model.params():
            p.zero_grad()
        loss_and_grads(model, x, y)
        AdamW(model.params(), 1e-3, weight_decay=0.1).step()
    finally:
        cpu.set_kernel_threads(before)
