"""Regenerate the configuration reference in README.md from train/config.py (tests/test_docs.py checks it)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render(readme: str) -> str:
    from train.config import reference_markdown

    block = f"{START}\n{reference_markdown()}\n{END}"
    return re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, readme, flags=re.S)


if __name__ == "__main__":
    path = REPO / "README.md"
    path.write_text(render(path.read_text()))
    print(f"updated {path}")
