"""The spec measured beside the runs: what drifts, re-timed between rounds of rows.

Five ``mpipar plan measure`` minutes apart on a quiet machine gave the reference GPT block's
forward between 1,089 and 1,421 us and the 2-rank p2p bandwidth between 2.9 and 17.3 GB/s
(4 MiB messages on shared memory, scheduling-dependent). A plan from any one of them carries
that drift as its error. So ``experiments/plan_here.py`` takes a short ``sample`` before each
round of rows and after the last (each ~5-10 s alone), and plans every row from the median of
the samples (``median_spec``), from the sample nearest in time to each run (``nearest``), and
from every sample (the band: least and most planned step).

A sample re-times what moved, each the way ``mpipar plan measure`` times it (one BLAS thread,
in a child process): the fp32 GEMM curve (``peak_tflops.fp32``, ``gemm.half_dim``), the
element-wise rate (``hbm.bandwidth_gbs``), every unit chain at the tiny and the reference shape
and the GPT units at the other shapes (``[units] floor_*``, ``ref_*``, ``shape*``:
``unit_bench.unit_times``), and p2p and all-reduce latency and
bandwidth at the message sizes the rows send (``row_bytes``: the boundary activation of each
row, not 4 MiB). Everything else (executor costs, OPT region, runtime memory, cores, cache,
``step_cv``) stays the base spec's. A sample is stored as the TOML of just those keys, plus
``measured_at`` (seconds since the epoch): ``--replan`` puts them over the base spec again.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tomllib

from .cluster import Cluster, load_cluster
from .errors import PlanError

GEMM_SIZES = (32, 64, 128, 256, 512)
QUICK_GEMM_SIZES = (16, 32, 64)


def local_sample(quick: bool) -> dict:
    """The in-process part of a sample (module doc), as {section: {key: value}} in the spec's
    units; run it with one BLAS thread (``sample`` does, in a child)."""
    from .measure import fit_gemm, gemm_rates, memory_rate
    from .unit_bench import unit_times

    budget = 0.05 if quick else 0.2
    rates = gemm_rates(QUICK_GEMM_SIZES if quick else GEMM_SIZES, np.float32, budget)
    peak, half = fit_gemm(rates)
    units = unit_times(0.05 if quick else 0.4)  # plan measure's budget: the same estimate
    return {"peak_tflops": {"fp32": peak / 1e12}, "gemm": {"half_dim": half},
            "hbm": {"bandwidth_gbs": memory_rate(1 << (20 if quick else 24), budget) / 1e9},
            "units": {f"{k}_us": max(v * 1e6, 1e-3) for k, v in units.items()}}


def row_bytes(config: dict, grid: dict) -> int:
    """Bytes of the activation one micro-batch of this run sends between stages (float32
    unless the config says otherwise): the p2p size that run uses (and, in a GPT, its tp
    all-reduces')."""
    from mpipar.models.counts import boundary_values

    from .here import DTYPE_KEYS, _boundary, _get

    s = DTYPE_KEYS.get(str(_get(config, "dtype", "float32")), ("fp32", 4))[1]
    return int(s * _boundary(config, grid, boundary_values))


def reduce_bytes(config: dict, grid: dict) -> list[int]:
    """Bytes of the gradient all-reduces of a dp > 1 run (each pipeline rank's parameters cut
    into ``bucket_mb`` buckets, ``memory_model``'s count): [] with dp = 1."""
    from mpipar.analysis.memory_model import predict_run

    from .here import _get

    rows = predict_run(config, grid) if int(grid.get("dp", 1)) > 1 else None
    bucket = int(float(_get(config, "bucket_mb", 4.0)) * 2**20)
    return sorted({min(int(r["params"]), bucket) for r in rows or []})


def sample(p2p_sizes: list[int], reduce_sizes: list[int], quick: bool = False,
           timeout: float = 120.0) -> dict:
    """One sample (module doc): {"measured_at": s, section: {key: value}}; ``p2p_sizes``: the
    rows' boundary activations in bytes, ``reduce_sizes``: their all-reduces' (the
    boundary's too: a GPT's tp all-reduces move that); 8 bytes is added for the latencies."""
    from .measure import _lat_bw, _link_section, _run, commbench_tables

    t0 = time.time()
    code = ("import json; from mpipar.plan.resample import local_sample; "
            f"print(json.dumps(local_sample({quick})))")
    # _run starts the child with measure.THREAD_ENV: one BLAS thread, a rank's share
    got = json.loads(_run([sys.executable, "-c", code], timeout, "the spec sample"))
    p2p_set = {8, *(int(x) for x in p2p_sizes if x > 8)} if p2p_sizes else {8, 65536}
    ar_set = p2p_set | {int(x) for x in reduce_sizes if x > 8}
    msgs = ",".join(str(n) for n in sorted(ar_set))
    p2p, ar = commbench_tables(2, False, quick, timeout, "mpc", msgs)
    got["intra_node"] = _link_section(_lat_bw(p2p[np.isin(p2p["bytes"], list(p2p_set))], 1.0,
                                              largest=False))
    got["collective"] = _link_section(_lat_bw(ar, 1.0, largest=False))  # 2 (n-1)/n, n = 2
    got["measured_at"] = (t0 + time.time()) / 2
    return got


def line(s: dict) -> str:
    """One line of what a sample measured."""
    u = s.get("units", {})
    return (f"ref block F {u.get('ref_block_f_us', float('nan')):.0f} us, fp32 "
            f"{s['peak_tflops']['fp32'] * 1e3:.2f} GFLOP/s, p2p "
            f"{s['intra_node']['latency_us']:.1f} us {s['intra_node']['bandwidth_gbs']:.2f} GB/s, "
            f"all-reduce {s['collective']['latency_us']:.1f} us")


def note(s: dict) -> dict:
    """What results keep of a sample: when, the reference block's forward, GEMM, p2p."""
    return {"measured_at": s["measured_at"],
            "ref_block_f_us": s.get("units", {}).get("ref_block_f_us"),
            "fp32_gflops": 1e3 * s["peak_tflops"]["fp32"],
            "p2p_gbs": s["intra_node"]["bandwidth_gbs"],
            "p2p_us": s["intra_node"]["latency_us"]}


def spread_line(samples: list[dict]) -> str:
    """One line: the least and most of what the samples measured."""
    notes = [note(s) for s in samples]
    return f"{len(samples)} spec samples: " + "; ".join(
        f"{what} {min(n[k] for n in notes):.4g}-{max(n[k] for n in notes):.4g}"
        for what, k in (("ref block F (us)", "ref_block_f_us"), ("fp32 GFLOP/s", "fp32_gflops"),
                        ("p2p GB/s", "p2p_gbs"), ("p2p latency (us)", "p2p_us"))
        if all(n[k] is not None for n in notes))


def to_toml(data: dict) -> str:
    """A spec dict (top-level scalars, then one level of tables) as TOML."""
    def val(v):
        return json.dumps(v) if isinstance(v, str) else repr(v)

    lines = [f"{k} = {val(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for sec, body in data.items():
        if isinstance(body, dict):
            lines += ["", f"[{sec}]"] + [f"{k} = {val(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def overlay(base: dict, samples: list[dict]) -> dict:
    """``base`` with each key the samples measured set to the median over them."""
    out = copy.deepcopy(base)
    for sec in {k for s in samples for k, v in s.items() if isinstance(v, dict)}:
        keys = {k for s in samples for k in s.get(sec, {})}
        out.setdefault(sec, {})
        for k in keys:
            out[sec][k] = float(np.median([s[sec][k] for s in samples if k in s.get(sec, {})]))
    return out


def _cluster(data: dict) -> Cluster:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.toml"
        path.write_text(to_toml(data))
        return load_cluster(str(path))


@dataclass
class SpecSet:
    """The base spec (``median``) alone, or with samples: ``median`` the base with the median
    of every sampled key, ``samples`` [(measured_at, the base with that sample)]."""
    median: Cluster
    samples: list = field(default_factory=list)

    def nearest(self, when: float) -> Cluster:
        """The sample measured nearest ``when`` (seconds since the epoch); the median without
        samples."""
        if not self.samples:
            return self.median
        return min(self.samples, key=lambda s: abs(s[0] - when))[1]


def read_base(spec: str) -> dict:
    """The base spec's TOML as a dict (a bundled name or a file; ``load_cluster`` checks it)."""
    load_cluster(spec)
    path = Path(spec)
    if not path.is_file():
        from importlib import resources

        return tomllib.loads((resources.files("mpipar.plan") / "clusters"
                              / f"{spec}.toml").read_text())
    return tomllib.loads(path.read_text())


def spec_set(base: dict, samples: list[dict]) -> SpecSet:
    """The ``SpecSet`` of a base spec dict and samples (module doc)."""
    if not samples:
        return SpecSet(_cluster(base))
    strip = [{k: v for k, v in s.items() if k != "measured_at"} for s in samples]
    return SpecSet(_cluster(overlay(base, strip)),
                   [(float(s["measured_at"]), _cluster(overlay(base, [one])))
                    for s, one in zip(samples, strip, strict=True)])


def save(sample_: dict, folder: Path, k: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"sample-{k:02d}.toml"
    path.write_text(to_toml(sample_))
    return path


def load_samples(folder: Path) -> list[dict]:
    """The samples stored under ``folder`` (``save``), in order; [] when there are none."""
    out = []
    for path in sorted(folder.glob("sample-*.toml")):
        try:
            got = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise PlanError(f"{path}: not valid TOML ({exc}); delete it or re-run") from exc
        if "measured_at" not in got:
            raise PlanError(f"{path}: no measured_at; not a spec sample (delete it)")
        out.append(got)
    return out
