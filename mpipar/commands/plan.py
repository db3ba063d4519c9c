"""``mpipar plan``: predict a GPT training step at cluster scale, print the best configurations;
``mpipar plan measure --out here.toml``: measure this machine into a cluster spec."""

from __future__ import annotations

import json
import sys
import time

HELP = "predict step time, TFLOP/s, MFU and memory of every dp x pp x tp layout on a cluster"

COLUMNS = (  # (key, header, width, format); text columns are left-aligned
    ("dp", "dp", 5, "d"), ("pp", "pp", 3, "d"), ("tp", "tp", 2, "d"),
    ("schedule", "schedule", 11, "s"), ("v", "v", 2, "d"), ("microbatch_size", "mbs", 3, "d"),
    ("microbatches", "m", 4, "d"), ("recompute", "recompute", 9, "s"), ("sp", "sp", 2, "d"),
    ("zero1", "z1", 2, "d"), ("step_time_s", "step_s", 8, ".3f"),
    ("tflops_per_gpu", "TFLOP/s", 7, ".1f"), ("mfu", "MFU", 5, ".3f"),
    ("memory_gib", "mem_GiB", 7, ".1f"), ("fits", "fits", 4, "d"), ("bubble", "bubble", 6, ".3f"),
)


def add_arguments(p) -> None:
    p.add_argument("action", nargs="?", choices=("measure",),
                   help="measure: write a cluster spec of this machine (--out FILE; GEMM rate, "
                   "element-wise rate, p2p and all-reduce, executor costs) instead of planning")
    p.add_argument("--out", help="measure: the spec file to write (TOML)")
    p.add_argument("--ranks", type=int, default=2, help="measure: ranks per node (default 2)")
    p.add_argument("--inter-node", action="store_true",
                   help="measure: also time links across the emulated cluster's nodes "
                   "(mpipar cluster mpiexec --ppn 1); otherwise [inter_node] copies [intra_node]")
    p.add_argument("--quick", action="store_true",
                   help="measure: tiny sizes, seconds (for tests); the spec is rough")
    p.add_argument("--model", help="preset name (gpt-1.7b ... gpt-1t, gpt3-175b) or a TOML file")
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        p.add_argument(f"--{name}", type=int, help=f"GPT {name} (overrides --model's)")
    p.add_argument("--cluster", default="dgx-a100-80gb",
                   help="bundled spec (dgx-a100-80gb, dgx-h100, h200) or a TOML file")
    p.add_argument("--gpus", type=int, help="GPUs in all (required to plan)")
    p.add_argument("--global-batch", type=int, help="sequences per step (required to plan)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default, mixed precision), fp16, fp32")
    p.add_argument("--fix", help="fix some of dp,pp,tp,schedule,microbatch_size,recompute,v,sp,"
                   "zero1,dp_overlap,placement (e.g. dp=8,pp=4,tp=8; placement=tp-dp-pp is "
                   "Megatron-LM's rank order); the rest is searched")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("--format", choices=("text", "json"), default="text")


def _shape(args):
    from mpipar.plan import GPTShape, PlanError, load_model

    base = load_model(args.model) if args.model else None
    fields = {}
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        value = getattr(args, name)
        if value is None and base is not None:
            value = getattr(base, name)
        if value is None and name == "vocab":
            value = 51200
        if value is None:
            raise PlanError(f"give --{name} (or --model PRESET|FILE.toml)")
        fields[name] = value
    return GPTShape(**fields, name=base.name if base else "custom")


def _text(rows, model, cluster, args, seconds) -> str:
    from mpipar.plan.model import n_params

    head = (f"# {model.name}: {n_params(model) / 1e9:.1f}B params (l={model.layers} "
            f"h={model.hidden} a={model.heads} s={model.seq} V={model.vocab}) on {args.gpus} x "
            f"{cluster.name}, batch {args.global_batch}, {args.dtype}; searched in {seconds:.1f} s"
            "\n# TFLOP/s counts the FLOPs run (recomputation included: Megatron SC'21's count); "
            "MFU counts model FLOPs only")
    align = {k: "<" if f == "s" else ">" for k, _, _, f in COLUMNS}
    lines = [head, " ".join(f"{h:{align[k]}{w}}" for k, h, w, _ in COLUMNS)]
    for r in rows:
        lines.append(" ".join(f"{(int(r[k]) if isinstance(r[k], bool) else r[k]):{align[k]}{w}{f}}"
                              for k, _, w, f in COLUMNS))
    return "\n".join(lines)


def _measure(args) -> int:
    from pathlib import Path

    from mpipar.plan import PlanError, load_cluster
    from mpipar.plan.measure import measure, to_toml

    try:
        if not args.out:
            raise PlanError("give --out FILE.toml: where to write the measured spec")
        if not Path(args.out).resolve().parent.is_dir():
            raise PlanError(f"--out {args.out}: its directory does not exist")
        t0 = time.perf_counter()
        spec = measure(args.ranks, args.inter_node, args.quick)
        Path(args.out).write_text(to_toml(spec))
        load_cluster(args.out)  # what it wrote must read back
    except PlanError as exc:
        print(f"mpipar plan measure: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


def run(args) -> int:
    from mpipar.plan import PlanError, load_cluster, parse_fix, plan

    if args.action == "measure":
        return _measure(args)
    try:
        for flag in ("gpus", "global_batch"):
            if getattr(args, flag) is None:
                raise PlanError(f"give --{flag.replace('_', '-')} (or use `mpipar plan measure`)")
        if args.top < 1:
            raise PlanError(f"--top must be at least 1, got {args.top}")
        model = _shape(args)
        cluster = load_cluster(args.cluster)
        fixed = parse_fix(args.fix)
        t0 = time.perf_counter()
        rows = plan(model, cluster, args.gpus, args.global_batch, args.dtype, fixed, args.top)
        seconds = time.perf_counter() - t0
    except PlanError as exc:
        print(f"mpipar plan: error: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(rows, indent=1))
    else:
        print(_text(rows, model, cluster, args, seconds))
    return 0
