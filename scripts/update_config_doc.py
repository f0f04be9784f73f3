"""Regenerate the configuration reference in docs/config.md from train/config (tests/unit/test_docs.py checks it)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
TARGET = REPO / "docs" / "config.md"  # the page that holds the generated table, between START and END


def render(page: str) -> str:
    from train.config import reference_markdown

    block = f"{START}\n{reference_markdown()}\n{END}"
    return re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, page, flags=re.S)


def main() -> int:
    TARGET.write_text(render(TARGET.read_text()))
    print(f"updated {TARGET}")
    return 0


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "update_config_doc", cli=True)
