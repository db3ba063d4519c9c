"""Every check that needs no MPI work, on every rank, before anything starts (docs/architecture.md,
"Bad input fails early").

``config.validate`` checks the settings alone; here they meet the world (its size), the model
(the shapes tp and the pipeline cut) and the schedule; the run is resolved once
(``resolved.resolve``: schedule lowered and checked, micro-batches, mode, stage cut) and
handed to the trainer.
"""

from __future__ import annotations

from ..config import Config, ConfigError, validate
from ..models import check_gpt_shapes, check_mlp_shapes, unit_count
from ..parallel.tp_split import TPSplit
from ..trace import check_writable
from .resolved import ResolvedRun, resolve


def check_model(cfg: Config) -> None:
    """The model's shapes against the tp cut, sequence parallelism, seq_len and the pipeline."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    try:
        if m.kind == "gpt":
            split = TPSplit.of(p.tp_mode, p.tp, p.tp_depth, p.sequence_parallel)
            check_gpt_shapes(m, seq_len=t.seq_len, split=split)
        else:
            check_mlp_shapes(m, p.tp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if p.layout and p.layout != "auto":  # auto: any model, cut from its description
        _check_layout(cfg)
    n_units = unit_count(m)
    if p.partition == "explicit" and p.boundaries and max(p.boundaries) >= n_units:
        raise ConfigError(f"parallel.boundaries = {list(p.boundaries)}: the model has "
                          f"{n_units} units (0 to {n_units - 1}) to cut between: keep every "
                          f"boundary below {n_units}")
    stages = p.pp * p.virtual_stages
    if stages > n_units:
        raise ConfigError(f"pp * virtual_stages = {p.pp} * {p.virtual_stages} = {stages} "
                          f"pipeline chunks but the model has only {n_units} units to cut "
                          f"between: lower pp / virtual_stages or add layers")


def _check_layout(cfg: Config) -> None:
    from ..parallel.pipeline.stage_layout import LayoutError, layout_bounds

    m, p = cfg.model, cfg.parallel
    if m.kind != "gpt":
        raise ConfigError(f"parallel.layout = {p.layout!r} describes GPT stages (E, t, L); the "
                          f"model is {m.kind}: drop the layout or use parallel.partition")
    try:
        layout_bounds(p.layout, m.n_layer, p.pp * p.virtual_stages)
    except LayoutError as exc:
        raise ConfigError(f"parallel.layout: {exc}") from None


def _check_device(cfg: Config) -> None:
    if cfg.train.device == "cuda":
        from ..backend import cupy_available

        ok, why = cupy_available()
        if not ok:
            raise ConfigError(f"train.device = cuda but {why}: install the gpu extra "
                              f"(pip install -e '.[gpu]') on a GPU node, or use --device cpu")


def _check_run_dir(cfg: Config) -> None:
    if not cfg.run.trace:
        return
    try:
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the run directory {cfg.out_dir}: {exc}; pass "
                          f"--out DIR with a writable location") from None
    try:
        check_writable(cfg.out_dir / "trace.h5")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def preflight(cfg: Config, world_size: int) -> ResolvedRun:
    """Validate ``cfg`` against the world and the model; return the resolved run.

    Every rank calls it and fails alike, with a ``ConfigError`` saying what to change.
    """
    validate(cfg, world_size)
    check_model(cfg)
    _check_device(cfg)
    try:
        run = resolve(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    p = cfg.parallel
    if p.schedule_file and p.virtual_stages not in (1, run.schedule.virtual_stages):
        raise ConfigError(f"parallel.virtual_stages = {p.virtual_stages} but the schedule file "
                          f"{p.schedule_file} has {run.schedule.virtual_stages} chunk(s) per "
                          f"rank: the file wins; drop --virtual-stages")
    _check_run_dir(cfg)
    return run
