"""Validated run settings: TOML file, then command-line overrides, then checks.

Every error names the field and says what to change, and is raised before any MPI or training
work starts (contract 8 of DESIGN.md). Sections: ``model``, ``train``, ``parallel``, ``data``,
``run``. ``--set section.key=value`` overrides any field; the short flags of ``mpipar train``
(``--steps``, ``--dp``, ...) are shorthands for common ones.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from .layout import DEFAULT_ORDER, GridError, check_axes, check_grid, parse_order


class ConfigError(ValueError):
    """A setting is missing, unknown or inconsistent; the message says which and what to do."""


@dataclass
class ModelConfig:
    kind: str = "gpt"  # gpt | mlp
    vocab_size: int = 256
    block_size: int = 128  # context length (learned positions)
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    tie_embeddings: bool = False
    init_std: float = 0.02
    # MLP only
    sizes: list = field(default_factory=lambda: [32, 64, 64, 10])
    activation: str = "relu"  # relu | gelu
    task: str = "classification"  # classification | regression


@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 16  # global batch, in sequences (or samples for the MLP)
    seq_len: int = 64
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    grad_clip: float = 1.0  # 0 disables
    eval_interval: int = 50  # 0 disables
    eval_batches: int = 4
    dtype: str = "float32"  # float32 | float64
    device: str = "cpu"  # cpu | cuda
    seed: int = 0


@dataclass
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    order: str = DEFAULT_ORDER  # rank order, fastest-varying axis first
    schedule: str = "1f1b"  # naive | gpipe | 1f1b | interleaved | zb-h1 | pipedream
    microbatches: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved)
    schedule_file: str = ""  # a user-written schedule (mpipar schedule --help shows the format)
    partition: str = "uniform"  # uniform | params | explicit
    boundaries: list = field(default_factory=list)  # explicit stage starts (unit indices)
    recompute: bool | str = False  # False | True (full) | "selective" (attention core only)
    sequence_parallel: bool = False
    zero1: bool = False  # shard optimizer state over dp
    bucket_mb: float = 4.0  # data-parallel all-reduce bucket size, MiB
    overlap_grad_sync: bool = True


@dataclass
class DataConfig:
    path: str = ""  # HDF5 token file; empty: the standard-library corpus, prepared on first use
    max_bytes: int = 16 * 2**20  # size of the default corpus when it is prepared


@dataclass
class RunConfig:
    name: str = "run"
    out: str = ""  # run directory; default runs/<name>
    trace: bool = True
    log_interval: int = 10
    progress: bool = True
    checkpoint_interval: int = 0  # steps; 0: only at the end when checkpoint_final
    checkpoint_final: bool = False
    resume: str = ""  # a checkpoint file, or "latest" for the run directory's newest
    flush_interval: int = 50  # steps between flushes of the timing dump


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def out_dir(self) -> Path:
        return Path(self.run.out or f"runs/{self.run.name}")

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.dp * p.pp * p.tp


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_classes():
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}


def _coerce(section: str, key: str, value, proto):
    """Turn an override string (or TOML value) into the type of the default."""
    where = f"{section}.{key}"
    if where == "parallel.recompute":
        return _recompute_mode(value)
    if isinstance(proto, bool):
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if isinstance(proto, int):
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
    if isinstance(proto, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if isinstance(proto, list):
        if isinstance(value, list):
            return value
        s = str(value).strip()
        try:
            parsed = json.loads(s if s.startswith("[") else f"[{s}]")
        except json.JSONDecodeError:
            raise ConfigError(f"{where} must be a list such as [1, 2, 3], got {value!r}") from None
        return parsed
    return str(value)


RECOMPUTE = {"true": True, "full": True, "1": True, "yes": True, "on": True,
             "false": False, "none": False, "0": False, "no": False, "off": False,
             "selective": "selective"}


def _recompute_mode(value):
    """parallel.recompute: False (none), True (full: whole chunks) or "selective" (only the
    attention core, as Megatron's selective recomputation)."""
    if isinstance(value, bool):
        return value
    mode = RECOMPUTE.get(str(value).strip().lower())
    if mode is None:
        raise ConfigError(f"parallel.recompute must be none, full or selective (or true/false), "
                          f"got {value!r}")
    return mode


def _apply(cfg: Config, section: str, key: str, value, origin: str) -> None:
    classes = _section_classes()
    if section not in classes:
        raise ConfigError(f"unknown config section [{section}] in {origin}; valid sections: "
                          f"{', '.join(classes)}")
    sec = getattr(cfg, section)
    names = [f.name for f in dataclasses.fields(sec)]
    if key not in names:
        raise ConfigError(f"unknown config key {section}.{key} in {origin}; valid keys of "
                          f"[{section}]: {', '.join(names)}")
    setattr(sec, key, _coerce(section, key, value, getattr(sec, key)))


def load_config(path=None, overrides: dict | None = None) -> Config:
    """Defaults, then the TOML file, then ``overrides`` ({"train.lr": "1e-3"}), then validation."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found: pass an existing file to --config "
                              f"(see experiments/configs/)")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{p}: top-level key {section!r} must be a [section] table; "
                                  f"valid sections: {', '.join(SECTIONS)}")
            for key, value in values.items():
                _apply(cfg, section, key, value, str(p))
        if not cfg.run.name or cfg.run.name == "run":
            cfg.run.name = p.stem
    for dotted, value in (overrides or {}).items():
        if "." not in dotted:
            raise ConfigError(f"override {dotted!r} must look like section.key=value, "
                              f"e.g. train.lr=1e-3")
        section, key = dotted.split(".", 1)
        _apply(cfg, section, key, value, "the command line")
    validate(cfg)
    return cfg


MODEL_KINDS = ("gpt", "mlp")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Every check of types, ranges and the settings' consistency with each other; no model and
    no MPI (the model-shape checks are ``mpipar.training.preflight``'s). ``world_size``: also
    check the grid fits it."""
    _validate_model(cfg.model, cfg.parallel)
    _validate_train(cfg.train)
    _validate_parallel(cfg.parallel, cfg.train, world_size)


def _grid_rule(check, *args) -> None:
    """Run a rule of ``mpipar.layout`` (shared with the MPI grid) as a config check."""
    try:
        check(*args)
    except GridError as exc:
        raise ConfigError(str(exc)) from None


def _validate_model(m: ModelConfig, p: ParallelConfig) -> None:
    if m.kind not in MODEL_KINDS:
        raise ConfigError(f"model.kind = {m.kind!r}: use 'gpt' or 'mlp'")
    if m.kind == "gpt":
        if m.vocab_size < 2:
            raise ConfigError("model.vocab_size must be at least 2")
        if m.tie_embeddings and p.pp > 1:
            raise ConfigError("model.tie_embeddings needs the embedding and the LM head on one "
                              "pipeline stage: set tie_embeddings = false or pp = 1")
        return
    if len(m.sizes) < 2:
        raise ConfigError("model.sizes must list at least an input and an output size")
    if m.activation not in ("relu", "gelu"):
        raise ConfigError(f"model.activation = {m.activation!r}: use relu or gelu")
    if m.task not in ("classification", "regression"):
        raise ConfigError(f"model.task = {m.task!r}: use classification or regression")


def _validate_train(t: TrainConfig) -> None:
    if t.dtype not in ("float32", "float64"):
        raise ConfigError(f"train.dtype = {t.dtype!r}: use float32 or float64")
    if t.device not in ("cpu", "cuda"):
        raise ConfigError(f"train.device = {t.device!r}: use cpu or cuda")
    if t.optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"train.optimizer = {t.optimizer!r}: use adamw or sgd")
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name} must be at least 1, got {getattr(t, name)}")


def _validate_parallel(p: ParallelConfig, t: TrainConfig, world_size: int | None) -> None:
    _grid_rule(check_axes, p.dp, p.pp, p.tp)
    for name in ("microbatches", "virtual_stages"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be at least 1, got {getattr(p, name)}")
    _grid_rule(parse_order, p.order)
    if t.batch_size % (p.dp * p.microbatches):
        raise ConfigError(
            f"train.batch_size = {t.batch_size} must divide into dp = {p.dp} replicas times "
            f"microbatches = {p.microbatches}: use a batch size that is a multiple of "
            f"{p.dp * p.microbatches}")
    if p.schedule_file and not Path(p.schedule_file).is_file():
        raise ConfigError(f"parallel.schedule_file {p.schedule_file} not found")
    if p.zero1 and p.schedule == "pipedream":
        raise ConfigError("ZeRO-1 with asynchronous PipeDream is not supported: drop zero1")
    if world_size is not None:
        _grid_rule(check_grid, p.dp, p.pp, p.tp, world_size)
