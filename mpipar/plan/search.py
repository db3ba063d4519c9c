"""Enumerate every (dp, pp, tp, schedule, v, micro-batch, recompute, SP, ZeRO-1), cost, rank."""

from __future__ import annotations

from .cluster import Cluster, peak_flops
from .costs import RECOMPUTE
from .errors import PlanError
from .evaluate import Config, evaluate
from .model import GPTShape

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "naive")
MAX_V = 16  # more model chunks per rank only multiply the p2p traffic
FIX_KEYS = ("dp", "pp", "tp", "schedule", "microbatch_size", "recompute", "v", "sp", "zero1",
            "dp_overlap", "placement")
PLACEMENTS = ("tp-pp-dp", "tp-dp-pp")  # the second is Megatron-LM's rank order
BOOL_KEYS = ("sp", "zero1", "dp_overlap")
_BOOL = {"1": True, "true": True, "on": True, "yes": True,
         "0": False, "false": False, "off": False, "no": False}


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def parse_fix(text: str | None) -> dict:
    """``dp=8,pp=4,schedule=interleaved,sp=0`` -> {"dp": 8, "pp": 4, ...} (mbs is an alias)."""
    fixed: dict = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key = "microbatch_size" if key.strip() == "mbs" else key.strip()
        value = value.strip()
        if not sep or key not in FIX_KEYS:
            raise PlanError(
                f"--fix item {item!r}: expected KEY=VALUE with KEY in {', '.join(FIX_KEYS)}"
            )
        if key in BOOL_KEYS:
            if value.lower() not in _BOOL:
                raise PlanError(f"--fix {key}={value!r}: use 0/1, on/off or true/false")
            fixed[key] = _BOOL[value.lower()]
        elif key == "schedule":
            if value not in SCHEDULES:
                raise PlanError(f"--fix schedule={value!r}: choose one of {', '.join(SCHEDULES)}")
            fixed[key] = value
        elif key == "placement":
            if value not in PLACEMENTS:
                raise PlanError(f"--fix placement={value!r}: choose one of {', '.join(PLACEMENTS)}")
            fixed[key] = value
        elif key == "recompute":
            if value not in RECOMPUTE:
                raise PlanError(f"--fix recompute={value!r}: choose one of {', '.join(RECOMPUTE)}")
            fixed[key] = value
        else:
            if not value.isdigit() or int(value) < 1:
                raise PlanError(f"--fix {key}={value!r}: must be a positive integer")
            fixed[key] = int(value)
    return fixed


def _layouts(m: GPTShape, c: Cluster, gpus: int, batch: int, fixed: dict):
    """(dp, pp, tp) that divide properly; tp stays inside a node."""
    for tp in divisors(c.gpus_per_node):
        if m.heads % tp or m.hidden % tp or gpus % tp:
            continue
        for pp in divisors(m.layers):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            if batch % dp:
                continue
            cand = {"dp": dp, "pp": pp, "tp": tp}
            if all(fixed.get(k, v) == v for k, v in cand.items()):
                yield dp, pp, tp


def _schedules(m: GPTShape, pp: int, micro: int, fixed: dict):
    """(schedule, v) pairs the executor can run for this pp and number of micro-batches."""
    if pp == 1:  # every schedule is plain gradient accumulation: list it once
        out = [(fixed.get("schedule", "1f1b"), 1)]
    else:
        out = [("gpipe", 1), ("1f1b", 1)]
        # ZB-H1 with m < p has no closed form and no gain over 1F1B (Qi et al. assume m >= p):
        # searched only for m >= p; simulated when fixed.
        if micro >= pp or fixed.get("schedule") == "zb-h1":
            out.append(("zb-h1", 1))
        if micro == 1:
            out.append(("naive", 1))
        if micro % pp == 0:
            out += [("interleaved", v) for v in divisors(m.layers // pp) if 2 <= v <= MAX_V]
        if fixed.get("schedule") == "interleaved" and "v" in fixed:
            if (m.layers // pp) % fixed["v"] or micro % pp or fixed["v"] < 2:
                return []
            out.append(("interleaved", fixed["v"]))
    if fixed.get("schedule") == "naive" and micro != 1:
        return []
    return sorted({(s, v) for s, v in out
                   if fixed.get("schedule", s) == s and fixed.get("v", v) == v})


def configs(m: GPTShape, c: Cluster, gpus: int, batch: int, fixed: dict):
    for dp, pp, tp in _layouts(m, c, gpus, batch, fixed):
        for mbs in divisors(batch // dp):
            if fixed.get("microbatch_size", mbs) != mbs:
                continue
            micro = batch // dp // mbs
            for schedule, v in _schedules(m, pp, micro, fixed):
                for rc in RECOMPUTE:
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for z in ((False, True) if dp > 1 else (False,)):
                            cfg = Config(dp, pp, tp, schedule, v, mbs, rc, sp, z,
                                         fixed.get("dp_overlap", True),
                                         placement=fixed.get("placement", "tp-pp-dp"))
                            if all(fixed.get(k, getattr(cfg, k)) == getattr(cfg, k)
                                   for k in fixed):
                                yield cfg


def check_sizes(m: GPTShape, c: Cluster, gpus: int, batch: int) -> None:
    m.check()
    if gpus < 1 or batch < 1:
        raise PlanError(f"--gpus and --global-batch must be positive (got {gpus}, {batch})")
    tps = [t for t in divisors(c.gpus_per_node) if m.heads % t == 0 and m.hidden % t == 0]
    if not any(gpus % t == 0 for t in tps):
        raise PlanError(f"no tensor-parallel size in {tps} divides --gpus {gpus}")
    if not any(batch % (gpus // (t * p)) == 0 for t in tps for p in divisors(m.layers)
               if gpus % (t * p) == 0):
        raise PlanError(
            f"--gpus {gpus} cannot be split as dp*pp*tp with pp dividing layers={m.layers}, tp "
            f"in {tps} (a node has {c.gpus_per_node} GPUs; heads={m.heads}) and dp dividing "
            f"--global-batch {batch}; change --gpus or --global-batch"
        )


def plan(m: GPTShape, c: Cluster, gpus: int, batch: int, dtype: str = "bf16",
         fixed: dict | None = None, top: int | None = 10) -> list[dict]:
    """The best ``top`` fitting configurations, fastest first (all of them if top is None)."""
    fixed = fixed or {}
    check_sizes(m, c, gpus, batch)
    peak = peak_flops(c, dtype)
    rows = [evaluate(m, c, peak, dtype, batch, cfg) for cfg in configs(m, c, gpus, batch, fixed)]
    if not rows:
        raise PlanError(
            f"no configuration matches --fix {fixed} for {gpus} GPUs and batch {batch}: check "
            "that dp*pp*tp = gpus, pp divides the layers, tp divides heads and hidden and fits a "
            "node, micro-batch size divides batch/dp, interleaved needs micro-batches % pp == 0"
        )
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        best = min(rows, key=lambda r: r["memory_gib"])
        raise PlanError(
            f"no configuration fits in {c.hbm_capacity / 2**30:.1f} GiB per GPU: the smallest "
            f"needs {best['memory_gib']:.1f} GiB ({describe(best)}); use more GPUs, a smaller "
            "model, or allow recompute/sp/zero1 in --fix"
        )
    fitting.sort(key=lambda r: (r["step_time_s"], r["memory_gib"]))
    return fitting if top is None else fitting[:top]


def describe(row: dict) -> str:
    v = f" v={row['v']}" if row["schedule"] == "interleaved" else ""
    return (f"dp={row['dp']} pp={row['pp']} tp={row['tp']} {row['schedule']}{v} "
            f"mbs={row['microbatch_size']} recompute={row['recompute']} sp={int(row['sp'])} "
            f"zero1={int(row['zero1'])}")
