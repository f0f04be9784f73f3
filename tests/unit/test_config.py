"""train/config: evolution.json (+ legacy keys, overrides, clear errors), machines.json, the reference table."""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest

from tests.helpers import REPO, tiny_config
from train.config import LEGACY_KEYS, ConfigError, RunConfig, build_config, load_config, reference_markdown
from train.launch.machines import Machine, load_machines


def _write(path: Path, obj) -> Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=1))
    return path


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, enumerated independently of train.config's helpers."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name == "source":
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaf_keys(hints[f.name], prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


# -- evolution.json --------------------------------------------------------------------------------------------------
def test_repo_evolution_json_loads():
    cfg = load_config(REPO / "evolution.json")
    raw = json.loads((REPO / "evolution.json").read_text())
    # no project name and no worker count in the shipped file: each strategy has its own default run folder, and
    # the launcher runs one worker per machine (the simulators: outer.num_workers' default, 2)
    assert "PROJECT_NAME" not in raw and "num_workers" not in raw["outer"]
    assert cfg.project_name == "diloco-shakespeare" and cfg.outer.num_workers == 2
    assert cfg.outer.lr == raw["outer"]["lr"] and cfg.outer.momentum == raw["outer"]["momentum"]
    assert cfg.outer.nesterov is True
    assert cfg.data.seq_length == raw["data"]["seq_length"]
    assert cfg.inner.precision == "auto"  # bf16-mixed where a GPU is present, fp32 on CPU (train/core/inner.py)
    # relative BASE_DIR resolves next to the file, i.e. in the repo
    assert cfg.run_dir == REPO / raw["BASE_DIR"] / "diloco-shakespeare"
    assert load_config(REPO / "evolution.json", strategy="edt").run_dir == REPO / raw["BASE_DIR"] / "edt-shakespeare"
    # the relative model / data / tokenizer paths resolve to files that ship with the repo
    assert Path(cfg.resolve_path(cfg.model.name)).is_file()
    assert Path(cfg.resolve_path(cfg.data.dataset)).is_dir()
    assert Path(cfg.resolve_path(cfg.model.tokenizer)).is_dir()


def test_defaults_load_with_the_swept_outer_setting():
    cfg = load_config(None)
    assert isinstance(cfg, RunConfig) and cfg.source == "<defaults>"
    # parameter averaging won the README's quality sweep at the embedded scale (the paper's 0.7/0.9 is opt-in)
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == (1.0, 0.0, True)
    assert (cfg.inner.lr, cfg.inner.beta1, cfg.inner.beta2, cfg.inner.weight_decay) == (4e-4, 0.9, 0.95, 0.1)
    assert cfg.inner.grad_accum == 1
    assert cfg.total_inner_steps == cfg.outer.rounds * cfg.outer.local_steps
    assert build_config({}).to_dict() == cfg.to_dict()
    assert "source" not in cfg.to_dict()
    # lists are per instance, not shared between configs
    a, b = build_config({}), build_config({})
    a.edt.initial_population.append("x")
    assert b.edt.initial_population == []


def test_legacy_flat_keys_map_to_fields(tmp_path):
    legacy = {
        "PROJECT_NAME": "proto", "BASE_DIR": "/tmp/shared", "INITIAL_POPULATION": ["m1", "m1"],
        "MAX_GENERATIONS": 7, "EVAL_BATCH_SIZE": 5, "MUTATION_PROBABILITY": 0.25, "MUTATION_STRENGTH": 0.05,
        "ELITISM": 2, "OUTER_LR": 0.4, "OUTER_MOMENTUM": 0.8, "OUTER_NESTEROV": False, "NUM_MACHINES": 3,
        "POPULATION_SIZE": 4,
    }
    assert set(legacy) | {"population_size"} == set(LEGACY_KEYS)  # the test covers every legacy key
    cfg = load_config(_write(tmp_path / "evolution.json", legacy))
    assert cfg.edt.population_size == 4 and cfg.edt.mode == "pretrain"  # one model listed: pretraining
    assert load_config(_write(tmp_path / "lower.json", {"population_size": 8})).edt.population_size == 8
    assert cfg.project_name == "proto"
    assert cfg.base_dir == "/tmp/shared" and cfg.run_dir == Path("/tmp/shared/proto")
    assert cfg.edt.initial_population == ["m1", "m1"]
    assert cfg.edt.max_generations == 7
    assert cfg.eval.batch_size == 5
    assert cfg.edt.mutation_probability == 0.25
    assert cfg.edt.mutation_strength == 0.05
    assert cfg.edt.elitism == 2
    assert cfg.outer.lr == 0.4
    assert cfg.outer.momentum == 0.8
    assert cfg.outer.nesterov is False
    assert cfg.outer.num_workers == 3


# a value each aliased key's own check refuses (out of range or not allowed), whichever name it is given under
REFUSED = {"project_name": "a/b", "base_dir": "", "edt.initial_population": [""], "edt.max_generations": 0,
           "eval.batch_size": 0, "edt.mutation_probability": 1.5, "edt.mutation_strength": -0.1, "edt.elitism": -1,
           "outer.lr": 0, "outer.momentum": 1.5, "outer.nesterov": "yes", "outer.num_workers": 0,
           "edt.population_size": -1}


def _nested(key: str, value) -> dict:
    """"edt.elitism", 3 -> {"edt": {"elitism": 3}}: the structured spelling."""
    *sections, leaf = key.split(".")
    raw = {leaf: value}
    for s in reversed(sections):
        raw = {s: raw}
    return raw


def _wrong_type(key: str):
    """A value of the wrong JSON type for the field `key`: a number for a string field, else a string."""
    cls, *path, leaf = [RunConfig, *key.split(".")]
    for part in path:
        cls = typing.get_type_hints(cls)[part]
    typ = typing.get_type_hints(cls)[leaf]
    return 5 if typ is str or str in typing.get_args(typ) else "x"


@pytest.mark.parametrize("alias", list(LEGACY_KEYS))
def test_every_alias_goes_through_the_checks_of_its_key(tmp_path, alias):
    """Issue #25: an alias is only another spelling: its value is refused exactly when, and as, the structured key's
    is, and the error names the alias as written before the key (in the file and as an override)."""
    key = LEGACY_KEYS[alias]
    assert set(REFUSED) == set(LEGACY_KEYS.values())  # a new alias needs a refused value here
    for value in (_wrong_type(key), REFUSED[key]):
        path = str(_write(tmp_path / "evolution.json", {}))
        want = _err(tmp_path, _nested(key, value))
        assert want.startswith(f"{path}: {key}"), want
        assert _err(tmp_path, {alias: value}) == want.replace(f"{path}: ", f"{path}: {alias}: ", 1)
        assert _err(tmp_path, {}, [f"{alias}={json.dumps(value)}"]) == \
            want.replace(f"{path}: ", f"{path}: {alias}: ", 1)
        # given under its structured name the override's error stays the key's own
        assert _err(tmp_path, {alias: 1}, [f"{key}={json.dumps(value)}"]) == want


@pytest.mark.parametrize("raw", [
    {"OUTER_LR": 0.5, "outer": {"lr": 0.6}},
    {"outer": {"lr": 0.6}, "OUTER_LR": 0.5},
])
def test_legacy_and_structured_name_for_the_same_field_is_refused(raw):
    # whichever comes first in the file, giving a field twice must not silently pick one of the values
    with pytest.raises(ConfigError, match=r"outer\.lr is given twice.*OUTER_LR"):
        build_config(raw)


def _err(tmp_path: Path, obj, overrides=None) -> str:
    path = _write(tmp_path / "evolution.json", obj)
    with pytest.raises(ConfigError) as ei:
        load_config(path, overrides)
    msg = str(ei.value)
    assert msg.startswith(str(path) + ": "), msg  # every message names the file
    return msg


@pytest.mark.parametrize("obj, expected", [
    # unknown keys, with a suggestion
    ({"outer": {"lr_": 1.0}}, "unknown key 'outer.lr_'; did you mean 'outer.lr'?"),
    ({"OUTER_LRR": 1.0}, "unknown key 'OUTER_LRR'; did you mean 'OUTER_LR'?"),
    ({"seq_length": 64}, "unknown key 'seq_length'; did you mean 'data.seq_length'?"),
    ({"inner": {"warmup_step": 3}}, "unknown key 'inner.warmup_step'; did you mean 'inner.warmup_steps'?"),
    # wrong types
    ({"outer": {"lr": "0.7"}}, 'outer.lr = "0.7": must be a number'),
    ({"outer": {"num_workers": True}}, "outer.num_workers = true: must be an integer"),
    ({"inner": {"warmup_steps": 2.5}}, "inner.warmup_steps = 2.5: must be an integer"),
    ({"outer": {"nesterov": "yes"}}, 'outer.nesterov = "yes": must be true or false'),
    ({"project_name": 5}, "project_name = 5: must be a string"),
    ({"edt": {"initial_population": "m1"}}, 'edt.initial_population = "m1": must be a list'),
    # out of range
    ({"outer": {"lr": -0.1}}, "outer.lr = -0.1: must be > 0"),
    ({"outer": {"momentum": 1.5}}, "outer.momentum = 1.5: must be <= 1"),
    ({"outer": {"num_workers": 2, "min_workers": 3}}, "outer.min_workers = 3: must be <= 2"),
    ({"inner": {"per_device_batch_size": 8, "total_batch_size": 20}},
     "inner.total_batch_size = 20: must be a multiple of inner.per_device_batch_size (8)"),
    ({"data": {"eval_fraction": 0}}, "data.eval_fraction = 0.0: must be > 0"),
    ({"outer": {"delta_dtype": "int8"}}, 'outer.delta_dtype = "int8": must be one of float32, bfloat16, float16'),
    ({"project_name": "a/b"}, 'project_name = "a/b": must be a plain folder name'),
    # bad precision
    ({"inner": {"precision": "fp8"}}, 'inner.precision = "fp8": must be one of fp32, bf16-mixed, fp16-mixed'),
    # not an object
    ([1, 2], "the top level must be a JSON object"),
])
def test_broken_config_files_give_clear_messages(tmp_path, obj, expected):
    assert expected in _err(tmp_path, obj)


def test_invalid_json_names_line_and_column(tmp_path):
    text = '{\n  "outer": {\n    "lr": 0.7,\n  }\n}\n'  # trailing comma on line 3 -> error at line 4
    msg = _err(tmp_path, text)
    assert re.search(r"not valid JSON: line 4 column 3", msg), msg


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope" / "evolution.json"
    with pytest.raises(ConfigError, match=re.escape(str(missing)) + ": no such config file"):
        load_config(missing)


def test_precision_aliases_are_normalised():
    for alias, want in (("bf16", "bf16-mixed"), ("16-mixed", "fp16-mixed"), ("32", "fp32"), ("float16", "fp16-mixed")):
        assert build_config({"inner": {"precision": alias}}).inner.precision == want


def test_overrides(tmp_path):
    cfg = build_config({"outer": {"lr": 0.7}}, ["outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false",
                                                "data.dataset=/some/where", "OUTER_MOMENTUM=0.5",
                                                'project_name="2024"', "model.revision=main"])
    assert cfg.outer.lr == 1.0
    assert cfg.outer.momentum == 0.5  # later overrides win; legacy names work as override keys
    assert cfg.outer.nesterov is False
    assert cfg.data.dataset == "/some/where"  # not JSON -> taken as a string
    assert cfg.project_name == "2024"
    assert cfg.model.revision == "main"
    # an override is validated like the file
    with pytest.raises(ConfigError, match=r"outer\.min_workers = 3: must be <= 2"):
        build_config({}, ["outer.min_workers=3"])


@pytest.mark.parametrize("override, expected", [
    ("outer.lr", "override 'outer.lr': expected KEY=VALUE"),
    ("outer.lr=abc", 'outer.lr = "abc": must be a number'),
    ("outer.lrr=1", "unknown key 'outer.lrr'; did you mean 'outer.lr'?"),
    ("outer.num_workers=true", "outer.num_workers = true: must be an integer"),
    ("inner.precision=fp8", 'inner.precision = "fp8": must be one of'),
    ("outer.overlap=eagerly", 'outer.overlap = "eagerly": must be one of'),
    ("outer.overlap_steps=-1", "outer.overlap_steps = -1: must be >= 0"),
    ("outer.local_steps_schedule=[[0, 10], [5]]", "outer.local_steps_schedule = [[0, 10], [5]]: must be a list of "
                                                   "[from_round, H] pairs"),
    ("outer.local_steps_schedule=[[0, 0]]", "(from_round >= 0, H >= 1)"),
    ("outer.local_steps_schedule=[[4, 10], [2, 30]]", "from_round must increase"),
])
def test_bad_overrides_fail_clearly(tmp_path, override, expected):
    path = _write(tmp_path / "evolution.json", {})
    with pytest.raises(ConfigError) as ei:
        load_config(path, [override])
    assert str(ei.value).startswith(str(path) + ": ")
    assert expected in str(ei.value)


def test_relative_base_dir_resolves_next_to_the_config_file(tmp_path, monkeypatch):
    sub = tmp_path / "exp" / "a"
    sub.mkdir(parents=True)
    path = _write(sub / "evolution.json", {"PROJECT_NAME": "p", "BASE_DIR": "shared/runs"})
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    assert cfg.run_dir == sub.resolve() / "shared" / "runs" / "p"
    assert cfg.config_dir == sub.resolve()
    # an absolute base_dir is taken as is
    assert load_config(path, [f"base_dir={tmp_path}/abs"]).run_dir == tmp_path / "abs" / "p"
    # relative paths of model/data resolve next to the config first, then the repo
    (sub / "mycorpus").mkdir()
    cfg = load_config(path, ["data.dataset=mycorpus", "model.name=configs/micro-llama.json"])
    assert cfg.resolve_path(cfg.data.dataset) == str(sub.resolve() / "mycorpus")
    assert cfg.resolve_path(cfg.model.name) == str(REPO / "configs" / "micro-llama.json")


def test_tiny_test_config_is_valid(tmp_path):
    cfg = build_config(tiny_config(tmp_path))
    assert cfg.run_dir == tmp_path / "t"
    assert cfg.inner.device == "cpu" and cfg.inner.threads == 1


def test_elitism_larger_than_the_population_is_refused(tmp_path):
    msg = _err(tmp_path, {"edt": {"elitism": 5, "population_size": 4}})
    assert "edt.elitism = 5: must be <= the population, 4 (edt.population_size)" in msg
    msg = _err(tmp_path, {"outer": {"num_workers": 2}, "edt": {"elitism": 3}})
    assert "edt.elitism = 3: must be <= the population, 2 (edt.population_size = 0: outer.num_workers)" in msg
    assert "ELITISM" not in msg and len(msg.splitlines()) == 1
    assert _err(tmp_path, {"ELITISM": 3, "POPULATION_SIZE": 2}).count("edt.elitism = 3") == 1  # prototype names
    assert build_config({"edt": {"elitism": 4, "population_size": 4}}).edt.elitism == 4  # all elites: allowed


def test_each_strategy_has_its_own_default_project():
    diloco, edt = build_config({}), build_config({}, strategy="edt")
    assert (diloco.project_name, edt.project_name) == ("diloco-shakespeare", "edt-shakespeare")
    assert diloco.run_dir != edt.run_dir
    # the strategy's choice is handed to the run's other processes as an override
    assert edt.default_overrides() == ["project_name=edt-shakespeare"]
    assert build_config({}, edt.default_overrides()).project_name == "edt-shakespeare"
    # a project the user names is kept, whatever the strategy
    for raw, ovs in (({"PROJECT_NAME": "mine"}, []), ({}, ["project_name=mine"]), ({"project_name": "mine"}, [])):
        cfg = build_config(raw, ovs, strategy="edt")
        assert cfg.project_name == "mine" and cfg.default_overrides() == []
    assert build_config({"project_name": None}, strategy="edt").default_overrides() == ["project_name=edt-shakespeare"]
    with pytest.raises(ValueError, match="strategy 'x'"):
        build_config({}, strategy="x")


def test_user_keys_and_defaults():
    cfg = build_config({"outer": {"lr": 0.5}}, ["seed=3"], defaults={"outer.num_workers": 5, "outer.lr": 0.1})
    assert cfg.user_keys == {"outer.lr", "seed"}
    assert (cfg.outer.num_workers, cfg.outer.lr) == (5, 0.5)  # a default never beats the user's value
    assert build_config({"NUM_MACHINES": 3}, defaults={"outer.num_workers": 5}).outer.num_workers == 3


def test_prototype_keys_without_a_meaning_here_are_accepted_with_a_note(tmp_path, caplog):
    path = _write(tmp_path / "evolution.json", {"PROJECT_NAME": "p", "LOCAL_PACKAGE": "./train"})
    with caplog.at_level("INFO", logger="config"):
        cfg = load_config(path)
    assert cfg.project_name == "p" and "LOCAL_PACKAGE" not in json.dumps(cfg.to_dict())
    notes = [r.getMessage() for r in caplog.records if r.name == "config"]
    assert notes == [f"{path}: LOCAL_PACKAGE = \"./train\" is ignored: the prototype copied this folder to every "
                     "machine before a run; here every machine runs the installed package of its checkout "
                     "(machines.json `workdir`, `pip install -e .`), so there is nothing to copy"]


def test_empty_base_dir_says_what_to_give():
    with pytest.raises(ConfigError, match=r'base_dir = "": must be a folder path: .* or "\." for the config'):
        build_config({"BASE_DIR": ""})


# -- machines.json ---------------------------------------------------------------------------------------------------
def test_repo_machines_json_loads():
    ms = load_machines(REPO / "machines.json")
    assert [m.host for m in ms] == json.loads((REPO / "machines.json").read_text())


def test_prototype_plain_host_list(tmp_path):
    ms = load_machines(_write(tmp_path / "machines.json", ["gpu1", "gpu2.lab.org", "10.0.0.7"]))
    assert [m.host for m in ms] == ["gpu1", "gpu2.lab.org", "10.0.0.7"]
    assert all(m.port == 22 and m.user is None and m.python == "python3" for m in ms)
    assert [m.label for m in ms] == ["gpu1", "gpu2.lab.org", "10.0.0.7"]


def test_object_entries(tmp_path):
    (tmp_path / "k").write_text("key")
    ms = load_machines(_write(tmp_path / "machines.json", [
        {"host": "gpu1", "port": 2222, "user": "alice", "identity_file": str(tmp_path / "k"),
         "python": "/venv/bin/python",
         "workdir": "/share/edt", "env": {"CUDA_VISIBLE_DEVICES": "0,1", "_X": "y"}, "setup": "source a",
         "gpus": 2},
        "gpu1",  # same host, other port: a distinct machine
        {"host": "gpu1", "name": "gpu1-again"},
    ]))
    a, b, c = ms
    assert (a.host, a.port, a.user, a.identity_file, a.python, a.workdir, a.setup, a.gpus) == \
        ("gpu1", 2222, "alice", str(tmp_path / "k"), "/venv/bin/python", "/share/edt", "source a", 2)
    assert a.env == {"CUDA_VISIBLE_DEVICES": "0,1", "_X": "y"}
    assert [m.label for m in ms] == ["gpu1:2222", "gpu1", "gpu1-again"]
    assert b.env == {} and b.env is not c.env
    # {"machines": [...]} is accepted too
    assert [m.host for m in load_machines(_write(tmp_path / "m2.json", {"machines": ["x"]}))] == ["x"]


@pytest.mark.parametrize("obj, expected", [
    ([{"hots": "gpu1"}], "entry 0: unknown key 'hots'; did you mean 'host'?"),
    (["ok", {"host": "gpu2", "prot": 22}], "entry 1: unknown key 'prot'; did you mean 'port'?"),
    (["my host"], 'entry 0: host = "my host": must be a host name or address'),
    (["-oProxyCommand=touch /tmp/x"], "entry 0: host = \"-oProxyCommand=touch /tmp/x\": must be a host name"),
    ([""], 'entry 0: host = "": must be a host name'),
    ([{"host": "a", "port": 0}], "entry 0: port = 0: must be 1..65535"),
    ([{"host": "a", "port": 65536}], "entry 0: port = 65536: must be 1..65535"),
    ([{"host": "a", "port": "22"}], 'entry 0: port = "22": must be an integer'),
    ([{"host": "a", "gpus": 0}], "entry 0: gpus = 0: must be >= 1"),
    ([{"host": "a", "env": {"1BAD": "x"}}], "entry 0: env['1BAD']: names must be"),
    ([{"host": "a", "env": {"OK": 1}}], "entry 0: env['OK']: names must be"),
    ([{"host": "a", "env": {"AWS_SECRET_ACCESS_KEY": "s"}}], "env['AWS_SECRET_ACCESS_KEY']: no secrets in"),
    (["gpu1", "gpu2", "gpu1"], "duplicate machine 'gpu1'"),
    ([{"host": "gpu1", "port": 22}, "gpu1"], "duplicate machine 'gpu1'"),
    ([5], "entry 0 = 5: must be a host string or an object"),
    ([], "must be a non-empty JSON list"),
    ({"hosts": ["a"]}, "must be a non-empty JSON list"),
    ('["a",', "not valid JSON: line 1 column 6"),
])
def test_bad_machines_give_clear_errors(tmp_path, obj, expected):
    path = _write(tmp_path / "machines.json", obj)
    with pytest.raises(ConfigError) as ei:
        load_machines(path)
    msg = str(ei.value)
    assert msg.startswith(str(path) + ": "), msg
    assert expected in msg, msg


def test_missing_identity_file_fails_at_load(tmp_path):
    (tmp_path / "id_ok").write_text("key")
    path = _write(tmp_path / "machines.json", [{"host": "gpu1", "identity_file": str(tmp_path / "id_ok")},
                                               {"host": "gpu2", "identity_file": "~/.ssh/no_such_key_here"}])
    with pytest.raises(ConfigError) as ei:
        load_machines(path)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: entry 1 (host gpu2): identity_file = \"~/.ssh/no_such_key_here\": "
                          "no such file"), msg
    assert "point it at your private key" in msg and len(msg.splitlines()) == 1


def test_missing_machines_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_machines(tmp_path / "machines.json")


# -- reference docs --------------------------------------------------------------------------------------------------
def test_reference_markdown_lists_every_key_with_its_default_and_doc():
    md = reference_markdown()
    rows = {}
    for line in md.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    keys = _leaf_keys(RunConfig)
    assert len(keys) > 40
    assert sorted(rows) == sorted(keys)
    defaults = RunConfig().to_dict()
    for key in keys:
        key_, default, legacy_name, meaning = rows[key]
        value = defaults
        for part in key.split("."):
            value = value[part]
        assert default == f"`{json.dumps(value)}`", key
        assert meaning, f"{key} has no doc"
    for legacy_name, key in LEGACY_KEYS.items():
        assert legacy_name in rows[key][2].split(", ")
    # machines.json fields are documented too (the README's machines table comes from their docs)
    assert all(f.metadata.get("doc") for f in dataclasses.fields(Machine))


def test_h_schedule_gives_each_round_its_h_and_the_cosine_their_sum():
    cfg = build_config({"outer": {"rounds": 6, "local_steps": 7, "local_steps_schedule": [[2, 10], [4, 30]]}})
    assert [cfg.outer.local_steps_at(r) for r in range(6)] == [7, 7, 10, 10, 30, 30]
    assert cfg.total_inner_steps == 7 + 7 + 10 + 10 + 30 + 30
    assert build_config({"outer": {"rounds": 3, "local_steps": 7}}).total_inner_steps == 21
    assert build_config({"outer": {"rounds": 6, "local_steps_schedule": [[2, 10]]},
                         "inner": {"total_steps": 99}}).total_inner_steps == 99  # given: used as is


def test_choices_are_literal_types_and_a_bad_one_is_one_line():
    """Every field with a fixed set of values is typed `Literal[...]` (the schema says what is allowed); the loader
    refuses anything else with the choices."""
    from train.config import field_types
    from train.config.fields import literal_choices

    seen = 0

    def walk(cls):
        nonlocal seen
        hints = field_types(cls)
        inst = cls()
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t)
            elif typing.get_origin(t) is typing.Literal:
                seen += 1
                assert getattr(inst, f.name) in literal_choices(t), f.name
    walk(RunConfig)
    assert seen >= 13
    with pytest.raises(ConfigError, match=r"outer\.compression = \"int3\": must be one of none, int8, int4"):
        build_config({"outer": {"compression": "int3"}})
