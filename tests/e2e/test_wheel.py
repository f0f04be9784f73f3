"""The wheel, as a user who runs `pip install .` gets it: built from a copy of the checkout (no build isolation,
setup.py's build step ships the embedded default as train/_shipped/), installed with --no-deps into a fresh
virtual environment that sees the system's packages (torch, transformers, ...) but neither the dev install's
editable finder nor the checkout; every module of the package imports there, and the README's default run
(`python -m diloco_sim`, 1 round) runs from an empty folder and commits."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # builds a wheel, a venv, installs, runs

# what a wheel is built from (the checkout's sources and the embedded default, not its runs, caches or tests)
SKIP = shutil.ignore_patterns(".git", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".hypothesis", "tests", "docs", "bench", "examples", "scripts", ".ci", "requirements")

ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1"}

# run inside the venv: every module of the package and the entry points import from site-packages, none from the
# checkout, and no editable finder is loaded
IMPORT_ALL = """
import importlib, json, pkgutil, sys
import train
names = ["train"] + [m.name for m in pkgutil.walk_packages(train.__path__, "train.")]
names += ["_edt_bootstrap", "diloco", "edt", "diloco_sim", "edt_sim", "launch_to_machines"]
failed = {}
for n in names:
    try:
        importlib.import_module(n)
    except Exception as e:  # report every module that fails, not only the first
        failed[n] = f"{type(e).__name__}: {e}"
print(json.dumps({"names": names, "failed": failed,
                  "files": {n: getattr(sys.modules[n], "__file__", None) for n in names if n in sys.modules},
                  "editable": [m for m in sys.modules if "__editable__" in m],
                  "finders": [repr(f) for f in sys.meta_path], "path": sys.path}))
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    return {**env, **ENV, **extra}


def _run(cmd, cwd, timeout=300, env=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def _fresh_venv(where: Path) -> Path:
    """A venv without the system's site-packages as a *site dir* (whose .pth files would load the dev install's
    editable finder) but with them on sys.path through a plain .pth line: torch and friends import, the finder
    does not run. Python of the venv."""
    venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(where)
    py = where / "bin" / "python"
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    system = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "_system_packages.pth").write_text("".join(f"{p}\n" for p in system))
    return py


def test_wheel_installs_into_a_fresh_venv_and_runs_the_default_from_an_empty_folder(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=SKIP)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(src)], cwd=tmp_path)
    wheel = next(dist.glob("edt-*.whl"))

    py = _fresh_venv(tmp_path / "venv")
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], cwd=tmp_path)
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    shipped = site / "train" / "_shipped"
    for rel in ("evolution.json", "configs/tiny-llama.json", "data/tokenizer/tokenizer.json",
                "data/corpus/hamlet_gut.txt"):
        assert (shipped / rel).is_file(), f"the wheel lacks the embedded default's {rel}"

    empty = tmp_path / "empty"
    empty.mkdir()
    out = json.loads(_run([py, "-c", IMPORT_ALL], cwd=empty).stdout.strip().splitlines()[-1])
    assert out["failed"] == {}
    assert {"train.status", "train.config", "train.launch.remote", "train.diloco.coordinator"} <= set(out["names"])
    for name, f in out["files"].items():
        assert f and Path(f).resolve().is_relative_to(site.resolve()), f"{name} imported from {f}, not the venv"
    assert out["editable"] == [] and not any("editable" in f for f in out["finders"]), out["finders"]
    assert not any(p and Path(p).resolve() == REPO.resolve() for p in out["path"]), out["path"]

    # the README's default, 1 short round, from an empty folder: the package's evolution.json, configs, corpus and
    # tokenizer; the run goes to this folder's runs/
    run = _run([py, "-m", "diloco_sim", "--rounds", "1", "--local-steps", "2", "--workers", "1",
                "--set", "data.max_tokens=20000", "--set", "eval.batches=1", "--set", "logging.plot=false",
                "--no-progress", "--device", "cpu", "--threads", "1"], cwd=empty, timeout=300)
    log = run.stdout + run.stderr
    assert "installed package's default" in log, log[-2000:]
    root = empty / "runs" / "diloco-shakespeare"
    assert (root / "rounds" / "r000001" / "COMMITTED").is_file(), log[-3000:]
    assert (root / "final" / "MANIFEST.json").is_file(), log[-3000:]
    assert json.loads((root / "config.json").read_text())["outer"]["rounds"] == 1
    assert not (shipped / "runs").exists(), "a run wrote into site-packages"
