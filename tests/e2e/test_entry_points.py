"""The entry points as a user meets them, in real subprocesses: from a notebook folder with its own `train.py`
(which must not shadow the package, nor run when `import diloco` does: _edt_bootstrap.py), and the launcher's
top-level --help (both backends, one example each)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO

USER_TRAIN = "from pathlib import Path\nPath('user_train_ran').write_text('yes')\nprint('USER TRAIN RAN')\n"


def _py(code_or_args, cwd, timeout=120) -> subprocess.CompletedProcess:
    """`python ...` in `cwd` with the checkout on PYTHONPATH (as a user who points PYTHONPATH at a clone), after
    the notebook folder ('' first on sys.path)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_import_diloco_and_edt_beside_a_users_train_py(tmp_path):
    (tmp_path / "train.py").write_text(USER_TRAIN)
    p = _py("import diloco, edt, train\n"
            "print('diloco', diloco.__file__); print('train', train.__file__)\n"
            "print('api', diloco.outer_step.__module__, edt.load_population.__module__)", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "USER TRAIN RAN" not in p.stdout and not (tmp_path / "user_train_ran").exists()
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    assert lines["diloco"] == str(REPO / "diloco.py")
    assert lines["train"] == str(REPO / "train" / "__init__.py")
    assert lines["api"] == "train.exchange.outer train.edt.lineage"


def test_a_users_train_already_imported_is_replaced_with_a_warning_naming_it(tmp_path):
    (tmp_path / "train.py").write_text(USER_TRAIN)
    p = _py("import train as mine\nimport diloco\nimport train\nprint('mine', mine.__file__)\n"
            "print('train', train.__file__)", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if line.startswith(("mine ", "train ")))
    assert lines == {"mine": str(tmp_path / "train.py"), "train": str(REPO / "train" / "__init__.py")}
    warning = [line for line in p.stderr.splitlines() if "UserWarning" in line]
    assert len(warning) == 1 and str(tmp_path / "train.py") in warning[0] and "Rename yours" in warning[0]


def test_launcher_help_names_both_backends_with_an_example_each_even_beside_a_users_train_py(tmp_path):
    (tmp_path / "train.py").write_text(USER_TRAIN)
    p = _py(["-m", "launch_to_machines", "--help"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (tmp_path / "user_train_ran").exists()
    out = p.stdout
    assert "backends (--backend" in out
    ssh = next(line for line in out.splitlines() if line.strip().startswith("ssh "))
    slurm = next(line for line in out.splitlines() if line.strip().startswith("slurm "))
    assert "machines.json" in ssh and "SSH" in ssh and "Slurm" in slurm
    examples = [line.strip() for line in out.splitlines() if line.strip().startswith("python launch_to_machines.py")]
    assert any("--backend slurm" in e for e in examples) and any("--backend" not in e for e in examples)
    # the subcommands' own help still works from here
    p = _py([str(REPO / "launch_to_machines.py"), "launch", "--help"], tmp_path)
    assert p.returncode == 0 and "--backend {ssh,slurm}" in p.stdout, p.stderr[-2000:]
