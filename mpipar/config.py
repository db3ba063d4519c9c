"""Validated run settings: TOML file, then command-line overrides, then checks.

Every error names the field and says what to change, and is raised before any MPI or training
work starts (the contract "bad input fails early", docs/architecture.md). Sections: ``model``,
``train``, ``parallel``, ``data``, ``run``; each field's rule is declared once, in
``config_checks.RULES``. ``--set section.key=value`` overrides any field; the short flags of
``mpipar train`` (``--steps``, ``--dp``, ...) are shorthands for common ones.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

# what each field may hold and the checks of a Config as a whole live in config_checks.py;
# callers import them here, with the types and load_config
from .config_checks import RULES, ConfigError, check_fields, validate  # noqa: F401
from .layout import DEFAULT_ORDER


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
    grad_clip: float = 1.0  # 0 disables clipping, and the gradient norm is then not computed
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
    tp_mode: str = "1d"  # 1d (Megatron) | 2d (Optimus) | 2.5d (Tesseract) | 3d
    tp_depth: int = 1  # 2.5d only: tp = tp_depth * q^2
    order: str = DEFAULT_ORDER  # rank order, fastest-varying axis first
    schedule: str = "1f1b"  # naive | gpipe | 1f1b | interleaved | zb-h1 | pipedream | zb-h2 |
    # zb-v | looped-bfs | v-half | v-min | dualpipev | pipedream-2bw (generators.SCHEDULES)
    microbatches: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved)
    schedule_file: str = ""  # a user-written schedule (mpipar schedule --help shows the format)
    partition: str = "uniform"  # uniform | params | explicit
    boundaries: list = field(default_factory=list)  # explicit stage starts (unit indices)
    layout: str = ""  # GPT stages in Megatron's form, e.g. "Et*3|t*3L" (overrides partition)
    recompute: bool | str = False  # False | True (full) | "selective" (attention core only)
    sequence_parallel: bool = False
    zero1: bool = False  # shard optimizer state over dp
    bucket_mb: float = 4.0  # data-parallel all-reduce bucket size, MiB
    overlap_grad_sync: bool = True
    # pipedream / pipedream-2bw without a flush between steps: the pipeline drains only before an
    # evaluation, a checkpoint and at the end (training/trainer.py)
    continuous: bool = False
    vertical_sync: bool = False  # pipedream: every stage uses the first stage's weight version


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
    # "auto" for resume: "latest" when the run directory has a checkpoint, else from scratch
    watchdog_s: float = 300.0  # end the job when a rank makes no progress this long; 0: off


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


def _refuse(where, value, rule, fallback: str):
    if rule is not None:
        return ConfigError(f"{where} = {value!r}: must be {rule.describe()}")
    return ConfigError(f"{where} {fallback}, got {value!r}")


def _coerce(section: str, key: str, value, proto):
    """Turn an override string (or TOML value) into the type of the default; what cannot be
    turned is refused here, what can is range-checked by ``validate``."""
    where = f"{section}.{key}"
    if where == "parallel.recompute":
        return _recompute_mode(value)
    rule = RULES.get(section, {}).get(key)
    if isinstance(proto, bool):
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise _refuse(where, value, rule, "must be true or false")
    if isinstance(proto, (int, float)):
        try:
            if isinstance(value, (bool, list, dict)):
                raise ValueError
            number = float(value) if isinstance(proto, float) else _to_int(value)
        except (TypeError, ValueError, OverflowError):
            what = "must be an integer" if isinstance(proto, int) else "must be a number"
            raise _refuse(where, value, rule, what) from None
        return number
    if isinstance(proto, list):
        if isinstance(value, list):
            return value
        s = str(value).strip()
        try:
            parsed = json.loads(s if s.startswith("[") else f"[{s}]")
        except json.JSONDecodeError:
            raise _refuse(where, value, rule, "must be a list such as [1, 2, 3]") from None
        return parsed
    if not isinstance(value, str):
        raise _refuse(where, value, rule, "must be a string")
    return value


def _to_int(value) -> int:
    """``"3"``, ``3``, ``3.0`` -> 3; ``1.5``, ``"1.5"``, NaN, inf -> ValueError/OverflowError."""
    if isinstance(value, str):
        value = value.strip()
        try:
            return int(value)
        except ValueError:
            value = float(value)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    return int(value)


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
        if p.is_dir():
            raise ConfigError(f"config file {p} is a folder: pass a TOML file to --config "
                              f"(see experiments/configs/)")
        if not p.is_file():
            raise ConfigError(f"config file {p} not found: pass an existing file to --config "
                              f"(see experiments/configs/)")
        try:
            data = tomllib.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            byte = exc.object[exc.start]
            raise ConfigError(f"config file {p} is not UTF-8 text (byte 0x{byte:02x} at offset "
                              f"{exc.start}): a binary or damaged file? pass a TOML config "
                              f"(see experiments/configs/)") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}; fix that line "
                              f"(see experiments/configs/ for examples)") from None
        except OSError as exc:
            raise ConfigError(f"config file {p} cannot be read: {exc.strerror or exc}") from None
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


MODEL_KINDS = RULES["model"]["kind"].options

