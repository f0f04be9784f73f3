"""Typed, documented, validated configuration of a run: `evolution.json` (machines.json: train/launch/machines.py).

The public face of the configuration: import everything from here. Where each part lives:

    schema.py       RunConfig and its small sections (model, data, eval, logging): keyword-only dataclasses,
                    every field with a default and a one-line doc, every section with `validate`
    training.py     the sections of the training loops: inner, outer
    evolution.py    the sections of evolution: edt, evomerge
    fields.py       the building blocks: doc(), FieldError / bad_value, range, choice and span checks
    legacy.py       the research prototypes' evolution.json: flat upper-case aliases (LEGACY_KEYS), ignored
                    keys, what their values meant, the EvoMerge prototype's automatic edt.mode
    loader.py       the loader: build_config, load_config, overrides, type coercion, config_path
    reference.py    the reference table of docs/config.md
    strategies.py   the strategy table (which modules run a strategy's coordinator and workers)
    __main__.py     `python -m train.config`

`python -m train.config --markdown` prints the reference table; `python -m train.config evolution.json
[KEY=VALUE ...]` prints the effective configuration. Nothing here touches the disk at import time.
"""
from __future__ import annotations

from train.config.evolution import BASE_METHODS, MERGE_METHODS, EDTConfig, EvoMergeConfig
from train.config.fields import FieldError, bad_value, check_choice, check_range, check_span, doc, field_types
from train.config.legacy import IGNORED_KEYS, LEGACY_KEYS, PROTOTYPE_SENTINELS
from train.config.loader import (DEFAULT_CONFIG, build_config, coerce_value, config_path, load_config,
                                      parse_override, read_json_file)
from train.config.reference import reference_markdown
from train.config.schema import REPO_ROOT, DataConfig, EvalConfig, LoggingConfig, ModelConfig, RunConfig
from train.config.training import PRECISION_ALIASES, PRECISIONS, InnerConfig, OuterConfig
from train.core.errors import ConfigError  # raised by all of the above; importers keep train.config.ConfigError

__all__ = [
    "REPO_ROOT", "DEFAULT_CONFIG", "ConfigError", "FieldError",
    # the schema
    "RunConfig", "ModelConfig", "DataConfig", "InnerConfig", "OuterConfig", "EvalConfig", "EDTConfig",
    "EvoMergeConfig", "LoggingConfig", "PRECISIONS", "PRECISION_ALIASES", "MERGE_METHODS", "BASE_METHODS",
    "doc", "bad_value", "check_range", "check_choice", "check_span", "field_types",
    # the prototypes' keys
    "LEGACY_KEYS", "IGNORED_KEYS", "PROTOTYPE_SENTINELS",
    # loading
    "build_config", "load_config", "parse_override", "coerce_value", "config_path", "read_json_file",
    # the reference
    "reference_markdown",
]

