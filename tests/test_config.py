"""The config alone: pure (no model, no MPI), one validator per section, and the grid rules it
shares with mpipar.mpi.grid (the same rule, the same message)."""

import subprocess
import sys

import pytest

from mpipar.backend import Backend
from mpipar.config import ConfigError, ModelConfig, load_config, validate
from mpipar.layout import GridError, check_grid, parse_order
from mpipar.models import build_model, unit_count


def test_config_is_a_leaf():
    code = ("import sys, mpipar.config\n"
            "bad = [m for m in sys.modules if m.startswith(('mpipar.', 'numpy', 'mpi4py'))\n"
            "       and m not in ('mpipar.config', 'mpipar.config_checks', 'mpipar.layout',\n"
            "                     'mpipar.fieldrules')]\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("over, words", [
    ({"model.kind": "cnn"}, "model.kind = 'cnn'"),
    ({"model.vocab_size": "1"}, r"model.vocab_size = 1: must be an integer in \[2, inf\)"),
    ({"model.kind": "mlp", "model.sizes": "[4]"}, r"model.sizes = \[4\]: must be a list of at"),
    ({"model.kind": "mlp", "model.activation": "tanh"}, "model.activation"),
    ({"model.kind": "mlp", "model.task": "ranking"}, "model.task"),
    ({"train.dtype": "float16"}, "train.dtype"),
    ({"train.device": "tpu"}, "train.device"),
    ({"train.optimizer": "lamb"}, "train.optimizer"),
    ({"train.steps": "0"}, "train.steps = 0: must be an integer"),
    ({"parallel.pp": "0"}, r"--pp must be an integer >= 1, got 0 \(config: parallel.pp\)"),
    ({"parallel.microbatches": "0"}, "parallel.microbatches = 0: must be"),
    ({"parallel.schedule_file": "/no/such.txt"}, "not found"),
    ({"parallel.zero1": "true", "parallel.schedule": "pipedream"}, "ZeRO-1"),
])
def test_each_section_names_the_field(over, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, over)


def test_grid_rules_are_the_grids():
    """Rank order and world size: the config raises the grid's own message."""
    with pytest.raises(GridError) as grid_err:
        parse_order("tp-pp")
    with pytest.raises(ConfigError) as cfg_err:
        load_config(None, {"parallel.order": "tp-pp"})
    assert str(cfg_err.value) == str(grid_err.value)
    cfg = load_config(None, {"parallel.dp": "2", "parallel.pp": "2", "parallel.microbatches": "2"})
    validate(cfg, 4)
    with pytest.raises(GridError) as grid_err:
        check_grid(2, 2, 1, 3)
    with pytest.raises(ConfigError, match="mpiexec -n 4") as cfg_err:
        validate(cfg, 3)
    assert str(cfg_err.value) == str(grid_err.value)


@pytest.mark.parametrize("mcfg", [
    ModelConfig(kind="gpt", n_layer=3, n_embd=8, n_head=2, block_size=8),
    ModelConfig(kind="gpt", n_layer=1, n_embd=8, n_head=2, block_size=8, tie_embeddings=True),
    ModelConfig(kind="mlp", sizes=[4, 6, 6, 3]),
    ModelConfig(kind="mlp", sizes=[4, 3]),
])
def test_unit_count_is_what_build_model_makes(mcfg):
    model = build_model(mcfg, Backend("cpu", "float64"))
    assert unit_count(mcfg) == len(model.units)


# ----- every field of every section: declared, and each bad value refused naming the key ------

def _all_fields():
    import dataclasses

    from mpipar.config import Config

    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(sec.default_factory()):
            yield sec.name, f.name


def test_every_field_has_a_declaration():
    from mpipar.config import RULES

    missing = [f"{s}.{k}" for s, k in _all_fields() if k not in RULES.get(s, {})]
    assert not missing, f"add a rule to mpipar.config.RULES for: {missing}"
    extra = [f"{s}.{k}" for s, rules in RULES.items() for k in rules
             if (s, k) not in set(_all_fields())]
    assert not extra, f"rules for fields that do not exist: {extra}"


def _as_cli_text(value) -> str:
    import json

    return json.dumps(value) if isinstance(value, list) else str(value)


def _bad_cases():
    from mpipar.config import RULES
    from mpipar.fieldrules import Text

    for section, key in _all_fields():
        rule = RULES[section][key]
        for value in rule.bad_values():
            yield f"{section}.{key}", value, "typed"
            # on the command line everything is text: a string is a valid Text value
            if not isinstance(rule, Text):
                yield f"{section}.{key}", value, "text"


BAD = list(_bad_cases())


def test_bad_values_cover_every_kind_of_mistake():
    """The generator tries zero, negatives, NaN, inf, wrong types and fractions for integers."""
    import math

    from mpipar.config import RULES

    n = RULES["train"]["eval_batches"].bad_values()
    assert 0 in n and -1 in n and 1.5 in n and "abc" in n and True in n
    assert any(isinstance(v, float) and math.isnan(v) for v in n)
    assert float("inf") in n
    clip = RULES["train"]["grad_clip"].bad_values()  # 0 disables clipping: not a bad value
    assert 0 not in clip and -1 in clip and float("inf") in clip
    assert len(BAD) > 300


@pytest.mark.parametrize("key, value, form", BAD, ids=[f"{k}={v!r}/{f}" for k, v, f in BAD])
def test_every_bad_value_is_refused_naming_the_key(key, value, form):
    over = {key: _as_cli_text(value) if form == "text" else value}
    if key.startswith("model.") and key != "model.kind":
        over["model.kind"] = "mlp" if key in ("model.sizes", "model.activation",
                                              "model.task") else "gpt"
    with pytest.raises(ConfigError) as err:
        load_config(None, over)
    msg = str(err.value)
    assert key in msg and "\n" not in msg, msg


@pytest.mark.parametrize("section, key", list(_all_fields()))
def test_declared_good_values_pass_the_field_check(section, key):
    from mpipar.config import RULES, Config, check_fields

    for value in RULES[section][key].good_values():
        cfg = Config()
        setattr(getattr(cfg, section), key, value)
        check_fields(cfg)
    validate(Config())  # and the defaults pass everything


def test_a_python_value_set_on_the_dataclass_is_checked_too():
    from mpipar.config import Config

    cfg = Config()
    cfg.train.lr = float("nan")
    with pytest.raises(ConfigError, match=r"train.lr = nan: must be a finite number in \(0, 10\]"):
        validate(cfg)


@pytest.mark.parametrize("over, words", [
    ({"train.eval_batches": "0"}, r"train.eval_batches = 0: must be an integer in \[1, inf\)"),
    ({"train.min_lr": "-1e-3"}, r"train.min_lr = -0.001: must be a finite number in \[0, 10\]"),
    ({"model.n_layer": "0"}, "model.n_layer = 0"),
    ({"model.n_head": "0"}, "model.n_head = 0"),
    ({"model.kind": "mlp", "model.sizes": "[32,1.5,10]"}, r"model.sizes = \[32, 1.5, 10\]"),
    ({"train.grad_clip": "nan"}, r"train.grad_clip = nan: .* or 0 to disable"),
    ({"parallel.bucket_mb": "-1"}, "parallel.bucket_mb = -1.0"),
    ({"run.flush_interval": "-5"}, "run.flush_interval = -5"),
    ({"train.steps": "2.5"}, "train.steps = '2.5'"),
    ({"train.steps": float("inf")}, "train.steps = inf"),
    ({"train.steps": True}, "train.steps = True"),
    ({"run.name": 5}, "run.name = 5"),
])
def test_issue_cases(over, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, over)


@pytest.mark.parametrize("over, words", [
    ({"train.min_lr": "0.1", "train.lr": "0.01"}, "min_lr = 0.1 is above train.lr = 0.01"),
    ({"model.n_embd": "30", "model.n_head": "4"}, "not divisible by model.n_head"),
    ({"train.seq_len": "256"}, "longer than the context"),
    ({"parallel.boundaries": "[0, 1]"}, "only with parallel.partition = explicit"),
    ({"parallel.partition": "explicit"}, r"pp \* virtual_stages = 1 chunks"),
    ({"parallel.partition": "explicit", "parallel.pp": "2", "parallel.boundaries": "[0,0]"},
     "increasing from 0"),
])
def test_cross_field_rules(over, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, over)
    load_config(None, {"parallel.partition": "explicit", "parallel.pp": "2",
                       "parallel.boundaries": "[0, 1]"})


def test_a_toml_value_of_the_wrong_type(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[train]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=r"train.lr = 'fast': must be a finite number"):
        load_config(p)
    p.write_text("[train]\nsteps = nan\n")
    with pytest.raises(ConfigError, match=r"train.steps = nan: must be an integer"):
        load_config(p)


def test_no_bad_value_reaches_the_training_loop_through_the_cli(monkeypatch, capfd):
    """Every bad value of every field, through ``mpipar train --set``: exit 2, one line, and the
    training loop (replaced here by a trap) is never called."""
    import mpipar.training
    from mpipar.cli import main

    def trap(cfg):
        raise AssertionError(f"a bad config reached training: {cfg}")

    monkeypatch.setattr(mpipar.training, "run", trap)
    for key, value, form in BAD:
        if form != "text":
            continue
        argv = ["train", "--set", f"{key}={_as_cli_text(value)}"]
        if key.startswith("model.") and key != "model.kind":
            argv += ["--set", "model.kind=mlp"] if key in ("model.sizes", "model.activation",
                                                           "model.task") else []
        assert main(argv) == 2, argv
        err = capfd.readouterr().err  # failfast writes the one line straight to fd 2
        assert err.count("\n") == 1 and key in err, (argv, err)


@pytest.mark.parametrize("setting", ["train.eval_batches=0", "model.n_layer=0",
                                     "train.grad_clip=nan"])
def test_cli_exits_2_with_one_line(setting):
    res = subprocess.run([sys.executable, "-m", "mpipar.cli", "train", "--set", setting],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and setting.split("=")[0] in lines[0], res.stderr


# ----- settings that were silently accepted or failed deep inside -----------------------------

SCHEDULE_2x2 = ("schedule kind=1f1b pp=2 virtual=1 microbatches=2 asynchronous=false "
                "placement=loop\n"
                "rank 0: F0.0 SEND_F0.0 F1.0 SEND_F1.0 RECV_B0.0 BW0.0 RECV_B1.0 BW1.0\n"
                "rank 1: RECV_F0.1 F0.1 BW0.1 RECV_F1.1 SEND_B0.1 F1.1 BW1.1 SEND_B1.1\n")


def _preflight(over, world=2):
    from mpipar.training import preflight

    return preflight(load_config(None, over), world)


def test_a_schedule_file_contradicted_by_schedule_or_virtual_stages_is_refused(tmp_path):
    f = tmp_path / "a_1f1b.txt"
    f.write_text(SCHEDULE_2x2)
    base = {"parallel.pp": "2", "parallel.microbatches": "2", "parallel.schedule_file": str(f),
            "model.n_layer": "4"}
    assert _preflight(base).schedule.pp == 2  # the file alone is fine
    with pytest.raises(ConfigError, match="parallel.schedule = interleaved and parallel."
                                          "schedule_file .* contradict"):
        load_config(None, {**base, "parallel.schedule": "interleaved"})
    with pytest.raises(ConfigError, match="virtual_stages = 2 but the schedule file .* has 1 "
                                          "chunk.* the file wins"):
        _preflight({**base, "parallel.virtual_stages": "2"})
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(None, {**base, "parallel.schedule_file": str(tmp_path)})


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/../../b"])
def test_a_run_name_escaping_the_run_root_is_refused(name):
    with pytest.raises(ConfigError, match="outside runs/"):
        load_config(None, {"run.name": name})
    assert load_config(None, {"run.name": "sweep/a"}).out_dir.as_posix() == "runs/sweep/a"


def test_a_one_class_mlp_is_refused_before_start():
    with pytest.raises(ConfigError, match=r"model.sizes = \[32, 64, 1\]: a classifier's last"):
        load_config(None, {"model.kind": "mlp", "model.sizes": "[32, 64, 1]"})


def test_explicit_boundaries_past_the_model_are_refused_before_start():
    with pytest.raises(ConfigError, match=r"boundaries = \[0, 9\]: the model has 6 units"):
        _preflight({"parallel.pp": "2", "parallel.microbatches": "2", "model.n_layer": "4",
                    "parallel.partition": "explicit", "parallel.boundaries": "[0, 9]"})


def test_a_folder_given_as_config_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is a folder: pass a TOML file"):
        load_config(tmp_path)
