"""The one build step pyproject.toml cannot say: a wheel carries the embedded default (the repo's evolution.json,
configs/, data/corpus/ and data/tokenizer/) inside the package, as train/_shipped/, laid out as in the checkout, so
that `python -m diloco_sim` runs from any folder after `pip install .`. The checkout keeps them where they are
(no second copy in git); an editable install reads them from the checkout. train/config/schema.py (shipped_root)
finds them either way; MANIFEST.in puts them in the sdist."""
from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# what the embedded default needs, relative to the repo: (folder or file, glob inside a folder)
SHIPPED = [("evolution.json", None), ("configs", "*.json"), ("data/corpus", "*.txt"),
           ("data/tokenizer", "*.json"), ("data/CORPUS.md", None)]
PACKAGE_DIR = "train/_shipped"


def shipped_files() -> list[str]:
    out = []
    for rel, pattern in SHIPPED:
        src = ROOT / rel
        if pattern is None:
            if not src.is_file():
                raise SystemExit(f"setup.py: {src} is missing: the wheel ships it (the embedded default); build "
                                 f"from a complete checkout")
            out.append(rel)
            continue
        found = sorted(p.relative_to(ROOT).as_posix() for p in src.glob(pattern) if p.is_file())
        if not found:
            raise SystemExit(f"setup.py: no {pattern} in {src}: the wheel ships them (the embedded default); "
                             f"build from a complete checkout")
        out += found
    return out


class BuildWithDefaults(build_py):
    """build_py, plus the embedded default copied into <build_lib>/train/_shipped/ (not for editable installs,
    which read the checkout's)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for rel in shipped_files():
            dst = Path(self.build_lib) / PACKAGE_DIR / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / rel, dst)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = [] if getattr(self, "editable_mode", False) else \
            [str(Path(self.build_lib) / PACKAGE_DIR / rel) for rel in shipped_files()]
        return [*super().get_outputs(include_bytecode), *extra]


setup(cmdclass={"build_py": BuildWithDefaults})
