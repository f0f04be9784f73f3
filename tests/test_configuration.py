"""evolution.json / machines.json: loading, legacy keys, overrides and the error messages users see."""
from __future__ import annotations

import json

import pytest

from conftest import REPO
from train.config import (ConfigError, LEGACY_KEYS, build_config, load_config, load_machines,
                          reference_markdown, _all_keys, RunConfig)


def test_repo_config_and_defaults_load():
    cfg = load_config(REPO / "evolution.json")
    assert cfg.outer.lr == 1.0 and cfg.outer.momentum == 0.0 and cfg.outer.nesterov  # best of our sweep (README)
    assert cfg.inner.lr == 4e-4 and (cfg.inner.beta1, cfg.inner.beta2, cfg.inner.weight_decay) == (0.9, 0.95, 0.1)
    assert cfg.run_dir == REPO / "runs" / "diloco-shakespeare"
    assert load_config(None).project_name == "diloco-shakespeare"


def test_prototype_flat_keys_map_to_fields(tmp_path):
    raw = {"PROJECT_NAME": "proto", "BASE_DIR": "/shared/x", "INITIAL_POPULATION": ["a/b"], "MAX_GENERATIONS": 7,
           "EVAL_BATCH_SIZE": 5, "MUTATION_PROBABILITY": 0.3, "MUTATION_STRENGTH": 0.2, "ELITISM": 2,
           "OUTER_LR": 1.0, "OUTER_MOMENTUM": 0.5, "OUTER_NESTEROV": False, "NUM_MACHINES": 4}
    cfg = build_config(raw)
    assert (cfg.project_name, cfg.base_dir) == ("proto", "/shared/x")
    assert cfg.edt.initial_population == ["a/b"] and cfg.edt.max_generations == 7 and cfg.edt.elitism == 2
    assert cfg.eval.batch_size == 5 and cfg.edt.mutation_probability == 0.3 and cfg.edt.mutation_strength == 0.2
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov, cfg.outer.num_workers) == (1.0, 0.5, False, 4)
    assert set(LEGACY_KEYS.values()) <= set(_all_keys(RunConfig))


def _err(tmp_path, text: str, name="evolution.json") -> str:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(str(p)), msg  # always names the file
    return msg


@pytest.mark.parametrize("text, expected", [
    ('{"outer": {"lr_": 0.7}}', "unknown key 'outer.lr_'; did you mean 'outer.lr'?"),
    ('{"OUTER_LRR": 0.7}', "did you mean 'OUTER_LR'?"),
    ('{"inner": {"learning_rate": 1}}', "unknown key 'inner.learning_rate'"),
    ('{"outer": {"lr": "fast"}}', 'outer.lr = "fast": must be a number'),
    ('{"outer": {"rounds": true}}', "outer.rounds = true: must be an integer"),
    ('{"outer": {"rounds": 2.5}}', "outer.rounds = 2.5: must be an integer"),
    ('{"outer": {"lr": -1}}', "outer.lr = -1.0: must be > 0.0"),
    ('{"outer": {"num_workers": 2, "min_workers": 3}}', "outer.min_workers = 3: must be <= 2"),
    ('{"inner": {"per_device_batch_size": 3, "total_batch_size": 8}}',
     "inner.total_batch_size = 8: must be a multiple of inner.per_device_batch_size (3)"),
    ('{"inner": {"precision": "fp8"}}', 'inner.precision = "fp8": must be one of fp32, bf16-mixed, fp16-mixed'),
    ('{"outer": {"delta_dtype": "int8"}}', "must be one of float32, bfloat16, float16"),
    ('{"project_name": "a/b"}', "project_name = \"a/b\": must be a plain folder name"),
    ('{"outer": {"lr": 0.7,}}', "not valid JSON: line 1 column"),
    ('[1, 2]', "the top level must be a JSON object"),
    ('{"PROJECT_NAME": "x", "project_name": "y"}', "project_name is given twice"),
])
def test_broken_configs_give_clear_messages(tmp_path, text, expected):
    assert expected in _err(tmp_path, text)


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.json")


def test_overrides_parse_json_and_fail_clearly():
    cfg = build_config({}, ["outer.lr=1.0", "OUTER_MOMENTUM=0", "inner.precision=bf16", "model.name=foo/bar"])
    assert cfg.outer.lr == 1.0 and cfg.outer.momentum == 0.0 and cfg.inner.precision == "bf16-mixed"
    assert cfg.model.name == "foo/bar"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        build_config({}, ["outer.lr"])
    with pytest.raises(ConfigError, match="did you mean 'outer.rounds'"):
        build_config({}, ["outer.round=3"])


def test_relative_base_dir_resolves_next_to_the_config(tmp_path):
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "evolution.json"
    p.write_text(json.dumps({"BASE_DIR": "myruns", "PROJECT_NAME": "p"}))
    assert load_config(p).run_dir == tmp_path / "sub" / "myruns" / "p"


def test_reference_lists_every_key():
    ref = reference_markdown()
    for key in _all_keys(RunConfig):
        assert f"`{key}`" in ref


# -- machines.json ---------------------------------------------------------------------------------------------------
def test_prototype_host_list_loads(tmp_path):
    p = tmp_path / "machines.json"
    p.write_text('["gpu1", "10.0.0.2"]')
    ms = load_machines(p)
    assert [m.host for m in ms] == ["gpu1", "10.0.0.2"] and ms[0].port == 22 and ms[0].python == "python3"


def test_machine_objects_load(tmp_path):
    p = tmp_path / "machines.json"
    p.write_text(json.dumps([{"host": "a", "port": 2222, "user": "me", "gpus": 2, "env": {"NCCL_X": "1"},
                              "name": "box-a"}, "b"]))
    a, b = load_machines(p)
    assert (a.port, a.user, a.gpus, a.env, a.label) == (2222, "me", 2, {"NCCL_X": "1"}, "box-a")
    assert b.label == "b"


@pytest.mark.parametrize("entries, expected", [
    ([{"hots": "a"}], "unknown key 'hots'; did you mean 'host'?"),
    (["bad host"], "must be a host name or address"),
    (["-oProxyCommand=x"], "not starting with '-'"),
    ([{"host": "a", "port": 0}], "port = 0: must be 1..65535"),
    ([{"host": "a", "port": "22"}], "port = \"22\": must be an integer"),
    (["a", "a"], "duplicate machine 'a'"),
    ([], "must be a non-empty JSON list"),
    ([{"host": "a", "env": {"1X": "y"}}], "env['1X']"),
    ([3], "must be a host string or an object"),
])
def test_bad_machines_give_clear_messages(tmp_path, entries, expected):
    p = tmp_path / "machines.json"
    p.write_text(json.dumps(entries))
    with pytest.raises(ConfigError) as e:
        load_machines(p)
    assert expected in str(e.value) and str(p) in str(e.value)
