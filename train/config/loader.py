"""One loader: evolution.json + KEY=VALUE overrides -> a validated RunConfig (train/config/schema.py).

Loading rejects unknown keys (suggesting the closest one), wrong types and out-of-range values with
`ConfigError: <file>: <field> = <value>: <what is allowed>`. A prototype alias (train/config/legacy.py) is mapped
to its dotted key on the way in and then coerced and validated exactly as that key; an error about it names the key
as the user wrote it first (`evolution.json: POPULATION_SIZE: edt.population_size = -1: must be >= 0`). Nothing here
touches the disk at import time.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any

from train.config import legacy
from train.config.fields import FieldError, bad_value, field_types
from train.config.legacy import LEGACY_KEYS
from train.config.schema import RunConfig, is_packaged_default, shipped_root
from train.core.errors import ConfigError
from train.config.strategies import STRATEGIES  # what load_config's `strategy` may be (it names the default project)

DEFAULT_CONFIG = "evolution.json"
log = logging.getLogger("config")


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out += _all_keys(t, prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


_SECTIONS = {name for name, t in field_types(RunConfig).items() if dataclasses.is_dataclass(t)}


def _suggest(key: str, known: list[str]) -> str:
    pool = known + list(LEGACY_KEYS)
    leaf = {k.rsplit(".", 1)[-1]: k for k in known}
    close = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
    if not close:
        close = [leaf[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaf), n=1, cutoff=0.75)]
    return f"; did you mean {close[0]!r}?" if close else ""


def coerce_value(name: str, value: Any, typ: Any) -> Any:
    """Check `value` against the annotation `typ` (int accepted for float; bool never for numbers)."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce_value(name, value, inner[0])
    if origin is typing.Literal:
        if value in typing.get_args(typ) and isinstance(value, str):
            return value
        raise bad_value(name, value, f"must be one of {', '.join(typing.get_args(typ))}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise bad_value(name, value, "must be true or false")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad_value(name, value, "must be an integer")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad_value(name, value, "must be a number")
    if typ is str:
        if isinstance(value, str):
            return value
        raise bad_value(name, value, "must be a string")
    if typ is list or origin is list:
        if isinstance(value, list):
            return value
        raise bad_value(name, value, "must be a list")
    if typ is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise bad_value(name, value, "must be an object")
    return value


def _flatten(raw: dict, written: dict[str, str], prefix: str = "",
             out: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"outer": {"lr": 1}} -> {"outer.lr": 1}; prototype aliases are mapped on the way and recorded in `written`
    (dotted key -> the alias)."""
    out = {} if out is None else out  # one dict for all levels: a key given twice is caught in any order
    for k, v in raw.items():
        if not isinstance(k, str):
            raise ConfigError(f"key {k!r} must be a string")
        key = legacy.modern_key(k) if not prefix else prefix + k
        if isinstance(v, dict) and key in _SECTIONS:
            _flatten(v, written, key + ".", out)
        else:
            if key in out:
                raise ConfigError(f"{key} is given twice (once under a legacy name such as "
                                  f"{legacy.aliases_of(key)})")
            out[key] = v
            if key != k and not prefix:
                written[key] = k
    return out


def _split_override(text: str) -> tuple[str, Any]:
    """`OUTER_LR=1.0` -> ("OUTER_LR", 1.0): the key as written. The value is JSON when it parses as JSON, else a
    string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. outer.lr=1.0")
    key, _, val = text.partition("=")
    try:
        parsed = json.loads(val)
    except json.JSONDecodeError:
        parsed = val
    return key.strip(), parsed


def parse_override(text: str) -> tuple[str, Any]:
    """`outer.lr=1.0` -> ("outer.lr", 1.0); a prototype alias gives its dotted key. The value is JSON when it parses
    as JSON, else a string."""
    name, value = _split_override(text)
    return legacy.modern_key(name), value


def _as_written(err: FieldError, written: dict[str, str]) -> ConfigError:
    """The error about a field given under a prototype alias names the alias first; others are left as they are."""
    for key, alias in written.items():
        if err.key == key or err.key.startswith((key + ".", key + "[")):
            return ConfigError(f"{alias}: {err}")
    return err


def _assign(cfg: RunConfig, flat: dict[str, Any]) -> None:
    """Set every dotted key of `flat` on `cfg`, each value coerced to its field's type."""
    hints_cache: dict[type, dict] = {}
    for key, value in flat.items():
        obj = cfg
        parts = key.split(".")
        for part in parts[:-1]:
            obj = getattr(obj, part)
        hints = hints_cache.setdefault(type(obj), field_types(type(obj)))
        setattr(obj, parts[-1], coerce_value(key, value, hints[parts[-1]]))


def build_config(raw: dict, overrides: list[str] | None = None, source: str = "<defaults>",
                 strategy: str = "diloco", defaults: dict[str, Any] | None = None) -> RunConfig:
    """Build and validate a RunConfig from a JSON object plus KEY=VALUE overrides.

    `strategy` (diloco or edt) names the default project (project_name null: "<strategy>-shakespeare").
    `defaults`: dotted key -> value used where neither the file nor an override gives the key (e.g. the launcher's
    one worker per machine); they do not count as the user's (`cfg.user_keys`). Notes about accepted prototype
    keys are logged once per call (logger "config")."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r}: must be one of {', '.join(STRATEGIES)}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    notes: list[str] = []
    written: dict[str, str] = {}  # dotted key -> the prototype alias it was given under (the last giving wins)
    try:
        flat = _flatten(raw, written)
        for ov in overrides or []:
            name, value = _split_override(ov)
            key = legacy.modern_key(name)
            flat[key] = value
            written.pop(key, None)
            if key != name:
                written[key] = name
        legacy.drop_ignored(flat, notes)
        legacy.note_changed_meanings(flat, written, notes)
        merged = legacy.prototype_evomerge(raw, flat, notes)
        known = _all_keys(RunConfig)
        for key in flat:
            if key not in known:
                raise ConfigError(f"unknown key {key!r}{_suggest(key, known)} (see docs/config.md)")
        user = frozenset(k for k, v in flat.items() if not (k == "project_name" and v is None))
        for key, value in (defaults or {}).items():
            if key not in known:
                raise ValueError(f"defaults: unknown key {key!r}")
            flat.setdefault(key, value)
        cfg = RunConfig(source=source)
        try:
            _assign(cfg, flat)
            legacy.check_sentinels(cfg, written)
        except FieldError as e:
            raise _as_written(e, written) from None
        cfg.user_keys = user
        if cfg.project_name is None:
            cfg.project_name = f"{strategy}-shakespeare"
        legacy.check_prototype_evomerge(cfg, merged)
        try:
            cfg.validate()
        except FieldError as e:
            raise _as_written(e, written) from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    for note in notes:
        log.info("%s: %s", source, note)
    return cfg


def config_path(given: str) -> str:
    """The config file as an absolute path, so that it means the same file in every process of the run whatever
    folder each starts in (the simulators start workers in the repo; the launcher on other hosts). A relative
    `--config` is relative to the folder the command was run in; relative paths *inside* the config are relative
    to the config file's folder (then to the repo, for the shipped data and configs: RunConfig.resolve_path).
    The default `evolution.json` falls back to the repo's (or, installed from a wheel, the package's copy of it)
    when the current folder has none; neither there is a ConfigError saying what to do."""
    p = os.path.abspath(os.path.expanduser(given))
    if given != DEFAULT_CONFIG or os.path.exists(p):
        return p
    root = shipped_root()
    shipped = root / DEFAULT_CONFIG
    if not shipped.is_file():
        raise ConfigError(f"{DEFAULT_CONFIG}: not in {os.getcwd()} nor in {root}: this install lacks the embedded "
                          f"default; pass --config PATH (a copy of the repo's evolution.json), or reinstall with "
                          f"`pip install .` from a checkout")
    if is_packaged_default(root):
        log.info("no %s in %s: using the installed package's default %s (runs go to this folder's runs/)",
                 given, os.getcwd(), shipped)
    else:
        log.info("no %s in %s: using the repo's %s", given, os.getcwd(), shipped)
    return str(shipped)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                strategy: str = "diloco", defaults: dict[str, Any] | None = None) -> RunConfig:
    """Load `evolution.json` (or defaults when `path` is None) and apply overrides (see build_config)."""
    if path is None:
        return build_config({}, overrides, strategy=strategy, defaults=defaults)
    p = Path(path)
    raw = read_json_file(p, "no such config file (copy evolution.json from the repo and edit it)")
    return build_config(raw, overrides, source=str(p), strategy=strategy, defaults=defaults)


def read_json_file(p: Path, missing: str) -> Any:
    """A JSON file's contents; ConfigError naming the file when it is missing (`missing` says what to do) or
    not valid JSON (line and column)."""
    if not p.is_file():
        raise ConfigError(f"{p}: {missing}")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
