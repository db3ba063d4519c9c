"""``mpipar bench --quick`` end to end (tables and HDF5 produced; no timing assertions), the GEMM
peak probe, bad input, and the GPU script's CPU dry run."""

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpipar.bench.gemm import model_gemm_shapes, shape_flops
from mpipar.bench.steps import shape
from mpipar.perf import measure_gemm_peak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "mpipar.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def test_quick_bench_writes_table_and_hdf5(tmp_path):
    out = tmp_path / "bench.h5"
    proc = run_cli("bench", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout and "memory per rank" in proc.stdout
    assert "tiny" in proc.stdout
    with h5py.File(out) as f:
        tp = f["throughput"][:]
        assert len(tp) == 1 and tp["config"][0] == b"tiny" and tp["threads"][0] == 1
        assert tp["mpipar_tokens_per_s"][0] > 0 and tp["gemm_peak"][0] > 0
        assert 0 < tp["mfu"][0] < 10  # a fraction of the peak, not a unit slip
        mem = f["memory"][:]
        assert mem["analytic_total"][0] > 0 and mem["measured_total"][0] > 0
        assert len(f["gemm_shapes"]) == 7
        assert len(f["samples/tiny/threads1/mpipar"]) == 3
        assert "6*N*T" in f.attrs["flop_formula"]


def test_bad_input_says_what_to_change(tmp_path):
    proc = run_cli("bench", "--quick", "--configs", "huge")
    assert proc.returncode == 2 and "choose from" in proc.stderr
    proc = run_cli("bench", "--quick", "--threads", "0")
    assert proc.returncode == 2 and ">= 1" in proc.stderr
    proc = run_cli("bench", "--quick", "--out", str(tmp_path / "no" / "such" / "dir.h5"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_gemm_peak_and_flop_counts():
    flops = measure_gemm_peak(np.float32, n=64, seconds=0.01)
    assert flops > 1e6
    with pytest.raises(ValueError, match="n >= 1"):
        measure_gemm_peak(np.float32, n=0)
    # the products listed for a step add up to the model-FLOP formula (times 3 for backward)
    sh = shape("small")
    from mpipar.analysis.flops import flops_per_step

    shapes = model_gemm_shapes(sh.n_layer, sh.n_embd, sh.n_head, sh.vocab_size, sh.batch, sh.seq)
    total = sum(c * shape_flops(a, b) for _, c, a, b in shapes)
    assert total == pytest.approx(flops_per_step(sh.flops_config()), rel=1e-12)


def test_gpu_script_dry_run(tmp_path):
    out = tmp_path / "gpu.h5"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "gpu_bench.py"),
                           "--dry-run", "--iters", "2", "--warmup", "1", "--no-torch",
                           "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "torch column skipped" in proc.stdout
    assert out.exists() and out.with_suffix(".txt").exists()
    with h5py.File(out) as f:
        assert np.isnan(f["throughput"]["torch_tokens_per_s"][0])


def test_blocked_pooled_kernels_equal_whole_array(monkeypatch):
    """Cache blocks change no bit (per row the arithmetic is the same); buffers are reused only
    when free."""
    from mpipar.nn import cpu
    from mpipar.nn import functional as F

    monkeypatch.setattr(cpu, "POOL_MIN_BYTES", 0)  # these small arrays go through the pool too
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 5, 12))
    g, b = rng.normal(size=12), rng.normal(size=12)
    dy = rng.normal(size=x.shape)
    q, k, v, do = (rng.normal(size=(2, 3, 7, 4)) for _ in range(4))
    mask = F.causal_mask(np, 7, 7)

    def everything():
        y, t = F.gelu_forward(x)
        ln = F.layernorm_forward(x, g, b)
        out, p = F.attention_forward(q, k, v, mask)
        return [y, t, F.gelu_backward(dy, x, t), *ln,
                F.layernorm_backward_input(dy, ln[1], ln[2], g), out, p,
                *F.attention_backward(do, q, k, v, p, out=out)]

    whole = everything()
    monkeypatch.setattr(cpu, "BLOCK_ELEMENTS", 16)  # many blocks of a few rows or heads
    for a, c in zip(whole, everything(), strict=True):
        assert np.array_equal(a, c)
    # pooled buffers are handed out again only once nobody holds them
    y1, t1 = F.gelu_forward(x)
    y2, t2 = F.gelu_forward(x)
    arrays = (whole[0], whole[1], y1, t1, y2, t2)
    assert not any(np.shares_memory(a, c) for i, a in enumerate(arrays) for c in arrays[i + 1:])

    def ptr(a):
        return a.__array_interface__["data"][0]

    freed = {ptr(y1), ptr(t1)}
    del y1, t1, arrays
    y3, t3 = F.gelu_forward(x + 1.0)
    assert {ptr(y3), ptr(t3)} == freed


def _attention_reference(q, k, v, do):
    """Plain float64 causal attention and its gradients: full S x S, no tiles, no tricks."""
    s, d = q.shape[-2], q.shape[-1]
    sc = q @ k.swapaxes(-1, -2) / np.sqrt(d)
    sc[..., np.triu(np.ones((s, s), bool), 1)] = -np.inf
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return [p @ v, p, ds @ k / np.sqrt(d), ds.swapaxes(-1, -2) @ q / np.sqrt(d),
            p.swapaxes(-1, -2) @ do]


@pytest.mark.parametrize("s", [65, 100, 192])  # a tile and a row, a ragged last tile, exact tiles
def test_causal_tiles_skip_the_upper_triangle_exactly(s, monkeypatch):
    """With the causal mask the CPU computes only each query tile's visible keys (and the backward
    only the queries that see each key tile); the results, probs included (zeros above the
    diagonal), equal the plain full-matrix computation, and do not depend on the cache blocks."""
    from mpipar.nn import cpu
    from mpipar.nn import functional as F

    rng = np.random.default_rng(5)
    b, h, d = 2, 3, 8
    qkv = rng.normal(size=(b, s, 3, h, d))
    t = qkv.transpose(2, 0, 3, 1, 4)  # strided views, as the layer passes them
    q, k, v = t[0], t[1], t[2]
    do = rng.normal(size=(b, h, s, d))
    mask = F.causal_mask(np, s, s)
    assert len(F._causal_tiles(np, mask, s, s)[0]) == -(-s // F.QUERY_TILE)

    def run():
        out, p = F.attention_forward(q, k, v, mask)
        out, p = out.copy(), p.copy()
        return [out, p, *F.attention_backward(do, q, k, v, p, out=out, mask=mask)]

    p0 = F.attention_forward(q, k, v, mask)[1].copy()
    F.attention_backward(do + 1.0, q, k, v, p0 + 1.0)  # leaves numbers in the pooled scratch
    got = run()
    for a, r in zip(got, _attention_reference(q, k, v, do), strict=True):
        assert np.abs(a - r).max() <= 1e-13 * np.abs(r).max()
    assert np.all(np.triu(got[1], 1) == 0.0)
    # without the mask the backward takes the full products: same numbers up to rounding
    untiled = F.attention_backward(do, q, k, v, got[1], out=got[0])
    for a, r in zip(got[2:], untiled, strict=True):
        assert np.abs(a - r).max() <= 1e-13 * np.abs(r).max()
    monkeypatch.setattr(cpu, "BLOCK_ELEMENTS", 16)  # one head per block
    for a, c in zip(got, run(), strict=True):
        assert np.array_equal(a, c)
    # any other mask gets the full products (tiles are only for the standard causal one)
    assert F._causal_tiles(np, ~mask, s, s)[0] == [(0, s, 0, s)]


def test_causal_tiles_with_more_keys_than_queries():
    """Queries at the end of a longer key sequence (offset not a multiple of the tile): the
    tiled forward and backward equal the full masked computation."""
    from mpipar.nn import functional as F

    rng = np.random.default_rng(6)
    sq, sk, d = 100, 130, 8
    q, do = rng.normal(size=(2, 3, sq, d)), rng.normal(size=(2, 3, sq, d))
    k, v = rng.normal(size=(2, 3, sk, d)), rng.normal(size=(2, 3, sk, d))
    mask = F.causal_mask(np, sq, sk)
    assert len(F._causal_tiles(np, mask, sq, sk)[0]) > 1
    sc = q @ k.swapaxes(-1, -2) / np.sqrt(d)
    sc[..., mask] = -np.inf
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    ref = [p @ v, p, ds @ k / np.sqrt(d), ds.swapaxes(-1, -2) @ q / np.sqrt(d),
           p.swapaxes(-1, -2) @ do]
    out, probs = F.attention_forward(q, k, v, mask)
    # without the mask the backward writes all of its pooled scratch; the tiled one reuses it
    F.attention_backward(do + 1.0, q, k, v, probs + 1.0)
    got = [out, probs, *F.attention_backward(do, q, k, v, probs, out=out, mask=mask)]
    for a, r in zip(got, ref, strict=True):
        assert np.abs(a - r).max() <= 1e-13 * np.abs(r).max()


def test_cpu_threads_experiment_runs(tmp_path):
    script = Path(__file__).resolve().parents[1] / "experiments/cpu_threads.py"
    res = subprocess.run([sys.executable, str(script), "--config", "tiny", "--steps", "1",
                          "--quick"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "mpipar split" in res.stdout and "speedup" in res.stdout
