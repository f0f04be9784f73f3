"""`python -m train.config --markdown` prints the reference table of docs/config.md; `python -m train.config
evolution.json [KEY=VALUE ...]` prints the effective configuration."""
from __future__ import annotations

import json
import sys

from train.config import load_config, reference_markdown
from train.core.errors import run_main


def main() -> int:
    if "--markdown" in sys.argv:
        print(reference_markdown())
    else:
        cfg = load_config(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2:])
        print(json.dumps(cfg.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    run_main(main, "config", cli=True)
