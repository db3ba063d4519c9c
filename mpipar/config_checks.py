"""What each field of a ``Config`` may hold (``RULES``) and the checks of a ``Config`` as a
whole: every field against its rule, then the settings' consistency with each other (model,
train, parallel). Pure, like ``config.py`` (no model, no MPI, no NumPy): the model-shape and world
checks are ``mpipar.training.preflight``'s. ``config.py`` (the types and ``load_config``) imports
this module and re-exports ``RULES``, ``ConfigError``, ``validate`` and ``check_fields``; this
module never imports it back, so a section arrives here as the object it is (``cfg.model``,
``cfg.train``, ``cfg.parallel``).
"""

from __future__ import annotations

from pathlib import Path

from .fieldrules import Choice, Flag, Int, IntList, Real, Recompute, RuleError, Text, check
from .layout import (
    TP_MODES,
    GridError,
    check_axes,
    check_grid,
    parse_order,
    tp_batch_shards,
    tp_grid_shape,
)


class ConfigError(ValueError):
    """A setting is missing, unknown or inconsistent; the message says which and what to do."""


# What each field may hold: one declaration per field, checked by one generic validator
# (``mpipar.fieldrules``). A new field of ``config.py`` needs its line here; tests/test_config.py
# fails otherwise and tries bad values against every declaration. Cross-field rules are in
# ``_validate_*``.
RULES = {
    "model": {
        "kind": Choice(("gpt", "mlp")), "vocab_size": Int(2), "block_size": Int(1),
        "n_layer": Int(1), "n_embd": Int(1), "n_head": Int(1), "tie_embeddings": Flag(),
        "init_std": Real(0, 10, lo_open=True), "sizes": IntList(1, min_len=2),
        "activation": Choice(("relu", "gelu")), "task": Choice(("classification", "regression")),
    },
    "train": {
        "steps": Int(1), "batch_size": Int(1), "seq_len": Int(1),
        "optimizer": Choice(("adamw", "sgd")), "lr": Real(0, 10, lo_open=True),
        "min_lr": Real(0, 10), "warmup_steps": Int(0), "weight_decay": Real(0, 10),
        "beta1": Real(0, 1, hi_open=True), "beta2": Real(0, 1, hi_open=True),
        "eps": Real(0, 1, lo_open=True), "momentum": Real(0, 1, hi_open=True),
        "grad_clip": Real(0, lo_open=True, off=0), "eval_interval": Int(1, off=0),
        "eval_batches": Int(1), "dtype": Choice(("float32", "float64")),
        "device": Choice(("cpu", "cuda")), "seed": Int(0, 2**32 - 1),
    },
    "parallel": {
        "dp": Int(1), "pp": Int(1), "tp": Int(1), "order": Text(nonempty=True),
        "schedule": Text(nonempty=True), "microbatches": Int(1), "virtual_stages": Int(1),
        "schedule_file": Text(), "partition": Choice(("uniform", "params", "cost", "explicit")),
        "boundaries": IntList(0), "recompute": Recompute(), "sequence_parallel": Flag(),
        "zero1": Flag(), "bucket_mb": Real(0, 2**20, lo_open=True), "overlap_grad_sync": Flag(),
        "tp_mode": Choice(TP_MODES), "tp_depth": Int(1), "layout": Text(),
        "continuous": Flag(), "vertical_sync": Flag(),
    },
    "data": {"path": Text(), "max_bytes": Int(1024)},
    "run": {
        "name": Text(nonempty=True), "out": Text(), "trace": Flag(), "log_interval": Int(1),
        "progress": Flag(), "checkpoint_interval": Int(1, off=0), "checkpoint_final": Flag(),
        "resume": Text(), "flush_interval": Int(1, off=0),
        "watchdog_s": Real(0, 86400, lo_open=True, off=0),
    },
}


def validate(cfg, world_size: int | None = None) -> None:
    """Every check of types, ranges and the settings' consistency with each other; no model and
    no MPI (the model-shape checks are ``mpipar.training.preflight``'s). ``world_size``: also
    check the grid fits it."""
    p = cfg.parallel
    _grid_rule(check_axes, p.dp, p.pp, p.tp)  # first, so the axes get the grid's own message
    check_fields(cfg)
    _validate_model(cfg.model, cfg.parallel, cfg.train)
    _validate_train(cfg.train)
    _validate_name(cfg.run.name)
    _validate_parallel(cfg.parallel, cfg.train, world_size)


def check_fields(cfg) -> None:
    """Each field against its declaration in ``RULES`` (type and range), in declaration order."""
    for section, rules in RULES.items():
        sec = getattr(cfg, section)
        for key, rule in rules.items():
            try:
                check(f"{section}.{key}", getattr(sec, key), rule)
            except RuleError as exc:
                raise ConfigError(str(exc)) from None


def _grid_rule(check, *args) -> None:
    """Run a rule of ``mpipar.layout`` (shared with the MPI grid) as a config check."""
    try:
        check(*args)
    except GridError as exc:
        raise ConfigError(str(exc)) from None


def _validate_name(name: str) -> None:
    """run.name is a folder under runs/ (the default run directory): it must stay inside."""
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise ConfigError(f"run.name = {name!r} would put the run directory outside runs/: "
                          f"use a plain name (pass --out DIR to choose any directory)")


def _validate_model(m, p, t) -> None:
    if m.kind == "mlp" and m.task == "classification" and m.sizes[-1] < 2:
        raise ConfigError(f"model.sizes = {list(m.sizes)}: a classifier's last size is its "
                          f"number of classes, at least 2 (or set model.task = regression)")
    if m.kind != "gpt":
        if p.tp_mode != "1d" and p.tp > 1:
            raise ConfigError(f"parallel.tp_mode = {p.tp_mode} builds the GPT only (model.kind "
                              f"is mlp): use tp_mode 1d")
        return
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd = {m.n_embd} is not divisible by model.n_head = "
                          f"{m.n_head}: pick n_head dividing n_embd")
    if t.seq_len > m.block_size:
        raise ConfigError(f"train.seq_len = {t.seq_len} is longer than the context "
                          f"model.block_size = {m.block_size}: lower seq_len or raise block_size")
    if m.tie_embeddings and p.tp_mode != "1d" and p.tp > 1:
        raise ConfigError(f"model.tie_embeddings is for tp_mode 1d (tp_mode is "
                          f"{p.tp_mode}): set tie_embeddings = false")
    if m.tie_embeddings and p.pp > 1:
        raise ConfigError("model.tie_embeddings needs the embedding and the LM head on one "
                          "pipeline stage: set tie_embeddings = false or pp = 1")


def _validate_train(t) -> None:
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr!r} is above train.lr = {t.lr!r}: the "
                          f"schedule decays from lr down to min_lr; use min_lr <= lr")
    # warmup_steps > steps is allowed: the trainer caps the warm-up at steps - 1 (short runs)


def _validate_parallel(p, t, world_size: int | None) -> None:
    _grid_rule(parse_order, p.order)
    if t.batch_size % (p.dp * p.microbatches):
        raise ConfigError(
            f"train.batch_size = {t.batch_size} must divide into dp = {p.dp} replicas times "
            f"microbatches = {p.microbatches}: use a batch size that is a multiple of "
            f"{p.dp * p.microbatches}")
    if p.schedule_file and not Path(p.schedule_file).is_file():
        what = "is a folder" if Path(p.schedule_file).is_dir() else "not found"
        raise ConfigError(f"parallel.schedule_file {p.schedule_file} {what}: pass a schedule "
                          f"file (mpipar schedule --help shows the format)")
    if p.schedule_file and p.schedule != "1f1b":
        raise ConfigError(f"parallel.schedule = {p.schedule} and parallel.schedule_file = "
                          f"{p.schedule_file} contradict: the file is the schedule; drop "
                          f"--schedule (or the file)")
    if p.zero1 and p.schedule in ("pipedream", "pipedream-2bw"):
        raise ConfigError(f"ZeRO-1 with {p.schedule} is not supported: drop zero1")
    _validate_continuous(p)
    _validate_boundaries(p)
    _validate_tp_mode(p, t)
    if world_size is not None:
        _grid_rule(check_grid, p.dp, p.pp, p.tp, world_size)


def _validate_continuous(p) -> None:
    """``continuous`` and ``vertical_sync``: PipeDream's settings, generated schedules only."""
    for flag, kinds in (("continuous", ("pipedream", "pipedream-2bw")),
                        ("vertical_sync", ("pipedream",))):
        if getattr(p, flag) and (p.schedule not in kinds or p.schedule_file):
            raise ConfigError(f"parallel.{flag} = true is for the generated "
                              f"{' and '.join(kinds)} schedules (schedule is {p.schedule!r}"
                              f"{', with a schedule_file' if p.schedule_file else ''}): drop it")


def _validate_tp_mode(p, t) -> None:
    """2d / 2.5d / 3d: the grid shape, the batch split over it, and what they do not support."""
    _grid_rule(tp_grid_shape, p.tp_mode, p.tp, p.tp_depth)
    shards = tp_batch_shards(p.tp_mode, tp_grid_shape(p.tp_mode, p.tp, p.tp_depth))
    mb_size = t.batch_size // (p.dp * p.microbatches)
    if mb_size % shards:
        raise ConfigError(f"tp_mode {p.tp_mode} with tp = {p.tp} splits each micro-batch's "
                          f"{mb_size} sequences over {shards} ranks: make train.batch_size / "
                          f"(dp * microbatches) a multiple of {shards}")
    if p.tp_mode != "1d" and p.tp > 1:
        for name in ("sequence_parallel", "zero1"):
            if getattr(p, name):
                raise ConfigError(f"parallel.{name} = true is for tp_mode 1d (tp_mode is "
                                  f"{p.tp_mode}): drop it")


def _validate_boundaries(p) -> None:
    """``parallel.boundaries``: the first unit of each pipeline chunk, only with explicit."""
    b, n = list(p.boundaries), p.pp * p.virtual_stages
    if p.partition != "explicit":
        if b:
            raise ConfigError(f"parallel.boundaries = {b} is used only with parallel.partition "
                              f"= explicit (it is {p.partition!r}): drop it or set explicit")
        return
    if len(b) != n or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
        raise ConfigError(f"parallel.boundaries = {b}: with partition = explicit give the first "
                          f"unit of each of the pp * virtual_stages = {n} chunks, increasing "
                          f"from 0 (e.g. {list(range(n))})")
