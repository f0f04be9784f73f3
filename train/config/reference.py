"""The configuration reference: the table of every key of evolution.json with its default, its prototype alias and its
doc, generated from the schema (`python -m train.config --markdown`; scripts/update_config_doc.py puts it into
docs/config.md, tests/unit/test_docs.py checks that it is current)."""
from __future__ import annotations

import dataclasses
import json

from train.config.fields import field_types
from train.config.legacy import LEGACY_KEYS
from train.config.schema import RunConfig


def reference_markdown() -> str:
    """The configuration reference table (docs/config.md)."""
    rows = ["| key | default | legacy name | meaning |", "|---|---|---|---|"]
    legacy: dict[str, str] = {}
    for k, v in LEGACY_KEYS.items():
        legacy[v] = f"{legacy[v]}, {k}" if v in legacy else k

    def walk(cls: type, prefix: str) -> None:
        hints = field_types(cls)
        inst = cls()
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")
                continue
            key = prefix + f.name
            rows.append(f"| `{key}` | `{json.dumps(getattr(inst, f.name))}` | {legacy.get(key, '')} | "
                        f"{f.metadata.get('doc', '')} |")

    walk(RunConfig, "")
    return "\n".join(rows)
