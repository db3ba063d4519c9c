"""``mpipar plan measure``: a cluster spec of this machine, measured on the spot.

It writes the schema of the bundled specs (``plan/clusters/*.toml``, read by ``cluster.py``),
every number measured here, none taken from a datasheet:

- ``[gemm]`` and ``[peak_tflops]``: one rank's square matrix-product rate r(n) = 2 n^3 / t at
  several sizes n, fitted to the bundled form r(n) = R n / (n + half_dim) (``fit_gemm``: least
  absolute log error, robust to one size slowed by load); R is written as the peak and
  ``max_efficiency`` = 1, so ``Cluster.gemm_efficiency`` reproduces the fit. ``sms = 1`` and
  a 1 x 1 tile: no wave
  quantization on a CPU. fp32 sets ``half_dim``; fp64 is measured for its own peak.
- ``[hbm]``: ``bandwidth_gbs`` the element-wise rate (c = a + b on arrays far beyond the
  caches: 3 arrays of bytes moved per pass), ``capacity_gb`` the node's physical memory.
- ``[intra_node]`` / ``[collective]``: point-to-point one-way latency (the smallest message) and
  bandwidth (the largest), all-reduce latency and bus bandwidth, from ``mpipar commbench``
  (``mpipar/mpi/bench``) run under ``mpiexec`` with ``--ranks`` ranks; ``[inter_node]`` the same
  across nodes with ``--inter-node`` (ranks over the emulated cluster's nodes through
  ``mpipar cluster mpiexec --ppn 1``), else a copy of ``[intra_node]``, marked so.
- ``[executor]``: the fitted per-action overhead, send/receive posting and fixed per-step
  costs of a tiny traced pp = 2 MLP run (``mpipar.analysis.costmodel.fit``; not its
  gradient-norm collective: that fit holds the ranks' imbalance): the executor's own cost,
  what no FLOP count gives.
- ``[units]``: mpipar's own GPT block, head, embedding and MLP unit timed at a tiny and a
  reference shape, the GPT units also at ``unit_bench.SHAPES`` (``shape<i>_*``; run as a chain
  of distinct units): the per-call floor and the weights of a unit's parts
  (``plan.unit_fit``); the MLP's loss; the OPT region per tensor and per value.
- ``step_cv``: how much one rank's compute per step varies (``unit_bench.step_cv``: std /
  mean over repeats of the reference GPT chain), for the wait of dp replicas for the slowest.
- ``cache_mb``: the largest cache of one core alone (``core_cache_bytes``, read from
  ``/sys/devices/system/cpu/cpu0/cache``); the OPT region is timed warm on state that fits it
  and cold on state that does not, and the planner picks per rank by its state's size.
- ``cores_per_node`` (the cores this process may run on), ``cores_per_rank``,
  ``workspace_gb`` (the resident size of a Python process with NumPy).
- ``[steadiness]``: how steady the machine's speed is (``mpipar.plan.steadiness``: fixed work
  timed in short windows for ``STEADY_S`` seconds): the spread of the windows, the two speed
  levels of a shared core, and per run length the share of runs within 10 % of the median.
  No planner term reads it: it says how finely runs here can be checked against a plan.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import steadiness
from .errors import PlanError
from .oversub import shared_slowdown
from .sharing import sched_slice

STEADY_S, STEADY_QUICK_S = 10.0, 0.5  # the steadiness sample (seconds)
SIZES = (32, 64, 128, 256, 512, 768)
QUICK_SIZES = (16, 32, 64)
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _best_time(fn, budget: float, least: int = 3) -> float:
    """The fastest of repeated calls of ``fn`` within ``budget`` seconds (at least ``least``)."""
    best, t_end, n = float("inf"), time.perf_counter() + budget, 0
    while n < least or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def gemm_rates(sizes, dtype, budget: float) -> list[tuple[int, float]]:
    """[(n, FLOP/s)] of an n x n by n x n product in ``dtype``."""
    out = []
    for n in sizes:
        a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
        b = a.T.copy()
        c = np.empty_like(a)
        t = _best_time(lambda a=a, b=b, c=c: np.matmul(a, b, out=c), budget)
        out.append((n, 2.0 * n**3 / t))
    return out


def fit_gemm(rates) -> tuple[float, float]:
    """(R FLOP/s, half_dim) of r(n) = R n / (n + half_dim): for each half_dim on a fine log
    grid, R the median of r / (n / (n + half_dim)), and the pair with the least sum of
    |log(measured / fitted)|: one size slowed by a neighbour's load moves it little (a least-
    squares fit let one slow large size halve R)."""
    n = np.array([x for x, _ in rates], float)
    r = np.array([y for _, y in rates], float)
    best = (np.inf, float(r.max()), 1.0)
    for h in np.geomspace(0.1, 1e5, 4000):
        g = n / (n + h)
        big = float(np.median(r / g))
        cost = float(np.abs(np.log(r / (big * g))).sum())
        if cost < best[0]:
            best = (cost, big, float(h))
    return best[1], best[2]


def memory_rate(elements: int, budget: float) -> float:
    """Bytes/s of c = a + b in float32 (read 2, write 1)."""
    a = np.ones(elements, np.float32)
    b = np.ones(elements, np.float32)
    c = np.empty_like(a)
    t = _best_time(lambda: np.add(a, b, out=c), budget)
    return 3 * 4 * elements / t


def _physical_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _run(cmd: list[str], timeout: float, what: str) -> str:
    env = dict(os.environ, **THREAD_ENV)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise PlanError(f"{what} took over {timeout:.0f} s: {' '.join(cmd)}") from None
    except FileNotFoundError as exc:
        raise PlanError(f"{what}: {exc.filename} not found (is MPI installed?)") from None
    if done.returncode != 0:
        raise PlanError(f"{what} failed (exit {done.returncode}): {' '.join(cmd)}\n"
                        f"{(done.stdout + done.stderr)[-1500:]}")
    return done.stdout


def _launcher(ranks: int, inter_node: bool, cluster: str = "mpc") -> list[str]:
    if inter_node:
        return [sys.executable, "-m", "mpipar.cli", "cluster", "mpiexec", "--name", cluster,
                "--ppn", "1", "--"]
    return ["mpiexec", "-n", str(ranks)]


def links(ranks: int, inter_node: bool, quick: bool, timeout: float,
          cluster: str = "mpc") -> dict:
    """{"p2p": (latency s, bytes/s), "allreduce": (latency s, bus bytes/s)} from commbench
    (``inter_node``: one rank on each node of the emulated cluster named ``cluster``)."""
    sizes = "8,1M" if quick else "8,64K,4M"
    p2p, ar = commbench_tables(ranks, inter_node, quick, timeout, cluster, sizes)
    return {"p2p": _lat_bw(p2p, 1.0), "allreduce": _lat_bw(ar, 2.0 * (ranks - 1) / ranks)}


def commbench_tables(ranks: int, inter_node: bool, quick: bool, timeout: float,
                     cluster: str, sizes: str):
    """(p2p rows, all-reduce rows) of ``mpipar commbench`` at ``sizes`` (its --sizes)."""
    import h5py

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "commbench.h5"
        cmd = _launcher(ranks, inter_node, cluster) + [
            sys.executable, "-m", "mpipar.cli", "commbench", "--sizes", sizes, "--iters",
            "3" if quick else "10", "--collectives", "allreduce", "--out", str(out)]
        _run(cmd, timeout, "commbench")
        with h5py.File(out, "r") as f:
            return f["p2p"][()], f["allreduce"][()]


def _lat_bw(rows, bus: float, largest: bool = True) -> tuple[float, float]:
    """(latency, bandwidth): the latency the smallest message's Comm time, the bandwidth from
    the largest one's time beyond it (``largest`` False: the median of that over every size
    above the smallest: the sizes a run sends, ``plan.resample``); ``bus`` the nccl-tests
    factor (2 (n-1)/n for all-reduce): bytes/s that moves per rank."""
    order = np.argsort(rows["bytes"])
    lat = float(rows[order[0]]["comm_s"])
    rates = [float(r["bytes"]) / max(float(r["comm_s"]) - lat, 1e-12)
             for r in rows[order[1:] if not largest else order[-1:]]]
    return lat, bus * float(np.median(rates))


# the executor probe: an MLP of four tiny linears over pp = 2, 1F1B, m = 4; its units cost
# their measured floor (``unit_bench.FLOOR``'s shape), so what its compute events take beyond
# them is the executor's own (``here.action_floor`` rebuilds it)
PROBE = {"model": {"kind": "mlp", "sizes": [8, 8, 8, 8, 8], "task": "regression"},
         "train": {"batch_size": 8, "dtype": "float32"},
         "parallel": {"schedule": "1f1b", "microbatches": 4, "partition": "uniform"}}


def executor_costs(quick: bool, timeout: float) -> dict:
    """The fitted executor costs of the tiny traced pp = 2 run ``PROBE`` (module doc), and its
    mean measured F (+ LOSS) and backward per chunk action (``here.action_floor``) and its
    OPT region (``here.opt_floor``); and the bytes its runtime touched (``runtime_bytes``)."""
    from mpipar.analysis.dump import load as load_run
    from mpipar.analysis.predict import run_model

    sets = [f"{sec}.{k}={v}" for sec, body in PROBE.items() for k, v in body.items()]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpipar.cli", "train", "--out", tmp,
               "--pp", "2", "--set", f"train.steps={3 if quick else 6}",
               "--set", "train.eval_interval=0", "--set", "run.progress=false",
               "--set", "run.trace=true"]
        for one in sets:
            cmd += ["--set", one]
        _run(cmd, timeout, "the tiny training run")
        run = load_run(str(Path(tmp) / "trace.h5"))
        steps = [s for s in run.steps() if s > 0] or list(run.steps())
        _, model, _, _ = run_model(run, steps, "1f1b", 2, 4, 1)
        runtime = runtime_bytes(run, steps)
    per = model.per_unit
    fwd = [t for (_, _, op), t in per.items() if op == "F"]
    bwd = [t for (_, _, op), t in per.items() if op == "B"]
    return {"action_overhead_us": model.overhead, "send_post_us": model.send_post,
            "recv_post_us": model.recv_post, "step_pre_us": model.step_pre,
            "step_post_us": model.step_post, "probe_f_us": float(np.mean(fwd)),
            "probe_b_us": float(np.mean(bwd)),
            # the OPT region of the rank that waits least in its norm all-reduce
            "probe_opt_us": float(min(model.optimizer.values()))}, runtime


def runtime_bytes(run, steps) -> float:
    """What the probe's ranks touched during the steps beyond the memory model's prediction of
    them (its trace included): the runtime's own (``plan.memory_terms``); their mean, >= 0."""
    from mpipar.analysis.memory_model import predict_run
    from mpipar.analysis.predict import events_per_step, measured_memory

    got = measured_memory(run)
    rows = predict_run(run.config, run.grid, events_per_step(run, steps))
    if not got or not rows:
        return 0.0
    pp = [int(run.coords[r, 1]) for r in range(len(got))]
    return max(float(np.mean([g - rows[p]["total"] for g, p in zip(got, pp)])), 0.0)


CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def core_cache_bytes(root: Path = CACHE_DIR) -> float:
    """Bytes of the largest data or unified cache that cpu0 has to itself (its
    ``shared_cpu_list`` names one cpu: a rank's own, whatever its neighbours do); 0 where
    the kernel does not say."""
    best = 0.0
    for index in sorted(root.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction" or "," in shared or "-" in shared:
            continue
        try:
            got = float(size[:-1]) * _UNITS[size[-1]] if size[-1] in _UNITS else float(size)
        except ValueError:
            continue
        best = max(best, got)
    return best


def local_rates(quick: bool) -> dict:
    """{"fp32": [(n, FLOP/s)], "fp64": [...], "mem": bytes/s, "units": {...}, "cache":
    bytes} in this process."""
    budget = 0.05 if quick else 0.5
    sizes = QUICK_SIZES if quick else SIZES
    from .unit_bench import measure_units

    cache = core_cache_bytes()
    return {"fp32": gemm_rates(sizes, np.float32, budget),
            "fp64": gemm_rates(sizes, np.float64, budget),
            "mem": memory_rate(1 << (20 if quick else 24), budget),
            "units": measure_units(quick, cache), "cache": cache}


def _local_rates_one_thread(quick: bool, timeout: float) -> dict:
    """``local_rates`` in a child process started with one BLAS thread: a training rank's
    share on a node it fills (``mpipar.threads``); BLAS reads its thread count at import."""
    import json

    code = ("import json; from mpipar.plan.measure import local_rates; "
            f"print(json.dumps(local_rates({quick})))")
    got = json.loads(_run([sys.executable, "-c", code], timeout, "the rate measurement"))
    return {k: [tuple(x) for x in v] if isinstance(v, list) else v for k, v in got.items()}


def measure(ranks: int = 2, inter_node: bool = False, quick: bool = False,
            timeout: float = 120.0, say=print) -> dict:
    """Everything the spec holds, as {section: {key: value}} (values in the file's units)."""
    if ranks < 2:
        raise PlanError(f"--ranks {ranks}: links need two ranks at least; pass --ranks 2")
    sizes = QUICK_SIZES if quick else SIZES
    say(f"matrix products, n = {', '.join(map(str, sizes))}, one BLAS thread ...")
    rates = _local_rates_one_thread(quick, timeout)
    r32, r64, mem, units = rates["fp32"], rates["fp64"], rates["mem"], rates["units"]
    cv = units.pop("step_cv")
    peak32, half = fit_gemm(r32)
    peak64, _ = fit_gemm(r64)
    say("  fp32 " + ", ".join(f"n={n} {r / 1e9:.2f}" for n, r in r32) + " GFLOP/s; fitted "
        f"R {peak32 / 1e9:.2f} GFLOP/s, half_dim {half:.1f}")
    say("  fp64 " + ", ".join(f"n={n} {r / 1e9:.2f}" for n, r in r64) + " GFLOP/s")
    say("model units (us; floor / reference shape, plan/unit_bench.py): " + ", ".join(
        f"{k} {v * 1e6:.0f}" for k, v in units.items() if k.startswith("ref_")))
    say(f"element-wise c = a + b: {mem / 1e9:.2f} GB/s")
    say(f"a step's compute varies by {100 * cv:.1f} % (std / mean, the reference GPT chain)")
    say(f"OPT region per tensor / per 1000 values (us): cold {units['opt_tensor'] * 1e6:.1f} / "
        f"{units['opt_value'] * 1e9:.2f}" + (
            f"; warm (state within half the core's {rates['cache'] / 2**20:.3g} MiB cache) "
            f"{units['opt_tensor_warm'] * 1e6:.1f} / {units['opt_value_warm'] * 1e9:.2f}"
            if "opt_tensor_warm" in units else "; no core cache size read: cold only"))
    say(f"p2p and all-reduce over {ranks} ranks (commbench) ...")
    intra = links(ranks, False, quick, timeout)
    inter = links(ranks, True, quick, timeout) if inter_node else None
    say("  " + _link_line(intra))
    if inter:
        say("  across nodes: " + _link_line(inter))
    say("executor costs of a tiny traced pp = 2 MLP run ...")
    ex, runtime = executor_costs(quick, timeout)
    say("  " + ", ".join(f"{k[:-3]} {v * 1e6:.0f} us" for k, v in ex.items())
        + f"; runtime memory {runtime / 2**20:.2f} MiB a rank")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    cores = len(os.sched_getaffinity(0)) or os.cpu_count() or 1
    ex["sched_slice_us"] = sched_slice(cores)  # plan.sharing: a spinning rank's slice
    say(f"the reference GPT chain in 1, then {2 * cores} processes at once (plan/oversub.py) ...")
    slowdown = shared_slowdown(cores, quick, timeout, dict(os.environ, **THREAD_ENV))
    say(f"  {2 * cores} processes on {cores} cores: {slowdown:.3f} x slower than their share")
    steady = steadiness.measured(STEADY_QUICK_S if quick else STEADY_S, timeout)
    for line in steadiness.lines(steady):
        say(line)
    return {
        "name": "measured-" + os.uname().nodename,
        "gpus_per_node": ranks,
        "cores_per_rank": max(cores / ranks, 0.0),
        "cores_per_node": cores,
        "workspace_gb": rss / 1e9,
        "runtime_mb": runtime / 2**20,
        "cache_mb": rates["cache"] / 2**20,
        "step_cv": cv,
        "shared_slowdown": slowdown,
        "peak_tflops": {"fp32": peak32 / 1e12, "fp64": peak64 / 1e12},
        "hbm": {"capacity_gb": _physical_memory() / 1e9, "bandwidth_gbs": mem / 1e9,
                "efficiency": 1.0},
        "intra_node": _link_section(intra["p2p"]),
        # one link a node, shared by its ranks (a CPU cluster's; --inter-node measures it
        # with one rank per node)
        "inter_node": dict(_link_section((inter or intra)["p2p"]), nics_per_node=1),
        "collective": _link_section(intra["allreduce"]),
        "gemm": {"sms": 1, "tile_rows": 1, "tile_cols": 1, "max_efficiency": 1.0,
                 "half_dim": half},
        "executor": {k: max(v * 1e6, 1e-3) for k, v in ex.items()},  # > 0: the schema
        "units": {f"{k}_us": max(v * 1e6, 1e-3) for k, v in units.items()},
        "steadiness": steadiness.spec_section(steady),
        "_inter_measured": inter is not None,
        "_rates": {"fp32": r32, "fp64": r64},
    }


def _link_line(got: dict) -> str:
    (pl, pb), (al, ab) = got["p2p"], got["allreduce"]
    return (f"p2p latency {pl * 1e6:.1f} us, {pb / 1e9:.2f} GB/s; all-reduce latency "
            f"{al * 1e6:.1f} us, bus {ab / 1e9:.2f} GB/s")


def _link_section(lat_bw) -> dict:
    lat, bw = lat_bw
    return {"bandwidth_gbs": bw / 1e9, "latency_us": max(lat * 1e6, 1e-3), "efficiency": 1.0}


def to_toml(spec: dict) -> str:
    """The spec as TOML, with a header saying how each section was measured."""
    r = spec["_rates"]
    lines = [
        "# Measured by `mpipar plan measure` on this machine (mpipar/plan/measure.py).",
        "# fp32 n x n products (GFLOP/s): "
        + ", ".join(f"{n}: {x / 1e9:.2f}" for n, x in r["fp32"]),
        "# peak_tflops = the fitted asymptote R of r(n) = R n / (n + half_dim); "
        "max_efficiency = 1.",
        f'name = "{spec["name"]}"',
        f"gpus_per_node = {spec['gpus_per_node']}          # ranks per node measured",
        f"cores_per_rank = {spec['cores_per_rank']:.3g}",
        f"cores_per_node = {spec['cores_per_node']}         # more ranks than this share cores",
        f"workspace_gb = {spec['workspace_gb']:.4g}   # resident size of Python + NumPy",
        f"runtime_mb = {spec['runtime_mb']:.4g}   # MPI, BLAS, allocator: touched during steps",
        f"cache_mb = {spec['cache_mb']:.4g}   # a core's own cache: OPT warm when state fits",
        f"step_cv = {spec['step_cv']:.4g}   # a step's compute: std / mean (replicas' wait)",
        f"shared_slowdown = {spec['shared_slowdown']:.4g}   # 2 x cores processes: slower than "
        "their share",
    ]
    for sec in ("peak_tflops", "hbm", "intra_node", "inter_node", "collective", "gemm",
                "executor", "units", "steadiness"):
        lines.append("")
        if sec == "steadiness":
            lines.append("# how steady this machine's speed is (mpipar/plan/steadiness.py): "
                         "read by no planner term;")
            lines.append("# within_<L>: the share of L-second runs within 10 % of the median")
        if sec == "inter_node" and not spec["_inter_measured"]:
            lines.append("# NOT measured across nodes: a copy of [intra_node] "
                         "(run with --inter-node on the cluster)")
        lines.append(f"[{sec}]")
        for k, v in spec[sec].items():
            lines.append(f"{k} = {v}" if isinstance(v, int) else f"{k} = {v:.6g}")
    return "\n".join(lines) + "\n"
