"""Every check that needs no MPI work, on every rank, before anything starts (docs/architecture.md,
"Bad input fails early").

``config.validate`` checks the settings alone; here they meet the world (its size), the model
(the shapes tp and the pipeline cut) and the schedule, which is built and checked once and
handed to the trainer.
"""

from __future__ import annotations

from ..config import Config, ConfigError, validate
from ..models import check_gpt_shapes, check_mlp_shapes, unit_count
from ..trace import check_writable


def make_schedule(cfg: Config):
    """The run's schedule (generated, or read from ``parallel.schedule_file``), checked."""
    from ..parallel.pipeline.actions import Schedule
    from ..parallel.pipeline.check import check_schedule
    from ..parallel.pipeline.generators import build_schedule

    p = cfg.parallel
    if p.schedule_file.endswith(".csv"):  # torch.distributed.pipelining's schedule CSV
        from ..parallel.pipeline.torch_csv import load_torch_csv

        s = load_torch_csv(p.schedule_file)
    elif p.schedule_file:
        s = Schedule.load(p.schedule_file)
    if p.schedule_file:
        if (s.pp, s.microbatches) != (p.pp, p.microbatches):
            raise ConfigError(f"schedule file {p.schedule_file} is for pp={s.pp}, microbatches="
                              f"{s.microbatches}; the run has pp={p.pp}, microbatches="
                              f"{p.microbatches}")
    elif p.continuous:  # a few steps of the cross-step schedule (the trainer builds each run's)
        steps = min(cfg.train.steps, 2 + -(-p.pp // p.microbatches))
        s = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages, steps=steps,
                           vertical_sync=p.vertical_sync)
    else:
        s = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages,
                           vertical_sync=p.vertical_sync)
    check_schedule(s)
    return s


def check_model(cfg: Config) -> None:
    """The model's shapes against tp, sequence parallelism, seq_len and the pipeline cut."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    try:
        if m.kind == "gpt" and p.tp_mode != "1d" and p.tp > 1:  # 2D/2.5D/3D: by q, not tp
            from ..layout import tp_grid_shape
            from ..parallel.tensor_nd import check_gpt_shapes_nd

            check_gpt_shapes_nd(m, p.tp_mode, tp_grid_shape(p.tp_mode, p.tp, p.tp_depth))
            check_gpt_shapes(m, 1, False, t.seq_len)
        elif m.kind == "gpt":
            check_gpt_shapes(m, p.tp, p.sequence_parallel, t.seq_len)
        else:
            check_mlp_shapes(m, p.tp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if p.layout:
        _check_layout(cfg)
    n_units = unit_count(m)
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


def preflight(cfg: Config, world_size: int):
    """Validate ``cfg`` against the world and the model; return the run's checked schedule.

    Every rank calls it and fails alike, with a ``ConfigError`` saying what to change.
    """
    validate(cfg, world_size)
    check_model(cfg)
    _check_device(cfg)
    try:
        schedule = make_schedule(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_run_dir(cfg)
    return schedule
