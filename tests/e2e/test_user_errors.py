"""Every user error is one line and exit 2, never a traceback, and nothing of a run is written (issues #11, #25)."""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from train.config import load_config
from train.core.errors import ConfigError, EnvironmentProblem, NotFound, UserError, run_main

REPO = Path(__file__).resolve().parents[2]


def run_script(*args: str, cwd: Path = REPO, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if " ERROR " in ln or ln.startswith("error:")]
    assert len(errors) == 1, p.stderr[-2000:]
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.mark.parametrize("script", ["diloco_sim.py", "edt_sim.py", "diloco.py", "edt.py"])
def test_base_dir_under_a_file_is_one_line(tmp_path, script):
    f = tmp_path / "afile"
    f.write_text("x")
    p = run_script(script, "--fake-data", "--base-dir", str(f / "sub"), "--no-progress")
    assert_one_line_error(p, "base_dir", str(f), "is a file")
    assert f.read_text() == "x"


def test_cuda_without_cuda_fails_before_any_process(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    p = run_script("diloco_sim.py", "--fake-data", "--device", "cuda", "--base-dir", str(tmp_path / "runs"))
    assert_one_line_error(p, "inner.device = 'cuda'", "auto or cpu")
    assert not (tmp_path / "runs").exists()  # failed before the run folder was made


def test_seq_length_beyond_the_model_is_refused_before_the_run_identity(tmp_path):
    p = run_script("diloco.py", "--fake-data", "--base-dir", str(tmp_path), "--no-progress",
                   "--set", "data.seq_length=4096")
    assert_one_line_error(p, "data.seq_length = 4096", "max_position_embeddings = 512")
    assert not (tmp_path / "diloco-shakespeare" / "run.json").exists()


def test_preflight_names_the_missing_package_and_the_fitness_plugin(tmp_path):
    from train.launch.cli import preflight

    cfg = load_config(REPO / "evolution.json", [f"base_dir={tmp_path}", 'logging.metrics="wandb"'])
    import importlib.util
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(EnvironmentProblem, match="pip install wandb"):
            preflight(cfg)
    cfg = load_config(REPO / "evolution.json", [f"base_dir={tmp_path}", 'edt.fitness="nosuch_mod_xyz:score"'])
    with pytest.raises(ConfigError, match="edt.fitness = 'nosuch_mod_xyz:score': cannot import it"):
        preflight(cfg, "edt")


def test_hub_model_unreachable_is_a_user_error(tmp_path):
    from train.core.model import build_model

    cfg = load_config(REPO / "evolution.json", [f"base_dir={tmp_path}", 'model.name="nobody-xyz/no-such-model"',
                                                'model.tokenizer=""'])
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with pytest.raises(UserError, match="could not load model 'nobody-xyz/no-such-model'.*--local-dir") as ei:
            build_model(cfg)
    finally:
        os.environ.pop("HF_HUB_OFFLINE", None)
    assert "\n" not in str(ei.value)


def test_hub_dataset_unreachable_is_a_user_error(tmp_path):
    from train.core.data import iter_texts as iter_texts

    cfg = load_config(REPO / "evolution.json", [f"base_dir={tmp_path}", 'data.dataset="nobody-xyz/no-such-data"'])
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with pytest.raises(UserError, match="could not open dataset 'nobody-xyz/no-such-data'"):
            next(iter(iter_texts(cfg)))
    finally:
        os.environ.pop("HF_DATASETS_OFFLINE", None)
        os.environ.pop("HF_HUB_OFFLINE", None)


def test_missing_local_files_are_not_found_user_errors(tmp_path):
    from train.core.model import model_source

    cfg = load_config(REPO / "evolution.json", [f"base_dir={tmp_path}", f'model.name="{tmp_path}/nope.json"'])
    with pytest.raises(NotFound, match="no such file or directory"):
        model_source(cfg)


def test_run_main_contract(capsys, monkeypatch):
    def user():
        raise ConfigError("evolution.json: outer.lr = -1: must be > 0\nsecond line")

    with pytest.raises(SystemExit) as ei:
        run_main(user, "t")
    assert ei.value.code == 2

    def os_err():
        raise NotADirectoryError(20, "Not a directory", "/x/y")

    with pytest.raises(SystemExit) as ei:
        run_main(os_err, "t")
    assert ei.value.code == 2

    def bug():
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        run_main(bug, "t")

    monkeypatch.setenv("RANK", "1")  # a torchrun rank > 0: quiet about the error rank 0 prints, lost peers in a line

    def lost_peer():
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")

    with pytest.raises(SystemExit) as ei:
        run_main(lost_peer, "t")
    assert ei.value.code == 1


@pytest.mark.parametrize("ending", ["exit", "error", "bug"])
def test_background_log_writer_writes_every_line_before_the_process_ends(tmp_path, ending):
    """Workers log through a queue and a writer thread (their stderr is a log file on the shared disk): every line
    logged before the end is written, and before a traceback."""
    script = tmp_path / "w.py"
    script.write_text(f"""
import logging, sys
sys.path.insert(0, {str(REPO)!r})
from train.core.errors import ConfigError, run_main

def main():
    log = logging.getLogger("w")
    for i in range(2000):
        log.info("line %d", i)
    if {ending!r} == "error":
        raise ConfigError("evolution.json: outer.lr: bad")
    if {ending!r} == "bug":
        raise KeyError("bug")

run_main(main, "w", background_log=True)
""")
    p = run_script(str(script))
    lines = p.stderr.splitlines()
    logged = [ln for ln in lines if " w INFO line " in ln]
    assert [int(ln.rsplit(" ", 1)[1]) for ln in logged] == list(range(2000)), p.stderr[-500:]
    if ending == "exit":
        assert p.returncode == 0
    elif ending == "error":
        assert p.returncode == 2 and lines[-1].endswith("evolution.json: outer.lr: bad")
    else:
        assert p.returncode == 1 and lines.index(logged[-1]) < lines.index("Traceback (most recent call last):")


# -- every entry point (issue #25) ------------------------------------------------------------------------------------
# Each program a user runs, with a bad input that it refuses before any heavy work: (argv after `python`, text the
# one line must hold). BAD is a config with a bad value; {tmp} a temp folder. None: no input to get wrong (it runs
# through run_main all the same). Not here: bench/ (benchmarks keep argparse's errors) and examples/
# (a user's own loop, where DiLoCoOptimizer raises ValueError like a torch optimizer).
BAD = "{tmp}/bad.json"
ENTRY_POINTS = {
    "diloco_sim.py": (["diloco_sim.py", "--config", BAD], "outer.lr = -1"),
    "edt_sim.py": (["edt_sim.py", "--config", BAD], "outer.lr = -1"),
    "diloco.py": (["diloco.py", "--config", BAD], "outer.lr = -1"),
    "edt.py": (["edt.py", "--config", BAD], "outer.lr = -1"),
    "launch_to_machines.py": (["launch_to_machines.py", "status", "--machines", "{tmp}/machines.json", "--config",
                               BAD], "error: {tmp}/bad.json: outer.lr = -1"),
    "train/diloco/worker.py": (["-m", "train.diloco.worker", "--config", BAD, "--worker", "0"], "outer.lr = -1"),
    "train/edt/worker.py": (["-m", "train.edt.worker", "--config", BAD, "--worker", "0"], "outer.lr = -1"),
    "train/launch/train_fsdp.py": (["train/launch/train_fsdp.py", "--set", "outer.lr=-1"], "outer.lr = -1"),
    "train/launch/remote.py": (["-m", "train.launch.remote", "status", "--config", BAD, "--machine", "m1"],
                               'EDT-JSON {"error": "{tmp}/bad.json: outer.lr = -1'),
    "train/launch/supervise.py": (["-m", "train.launch.supervise", "--name", "worker 0", "--", "{tmp}/no-python"],
                                  "worker 0: cannot run '{tmp}/no-python' (No such file or directory)"),
    "train/config/__main__.py": (["-m", "train.config", BAD], "error: {tmp}/bad.json: outer.lr = -1"),
    "scripts/build_tokenizer.py": (["scripts/build_tokenizer.py", "--corpus", "{tmp}", "--out", "{tmp}/tok"],
                                   "error: --corpus {tmp}: no *.txt files"),
    "scripts/make_specialists.py": (["scripts/make_specialists.py", "--model-config", "{tmp}/nope.json", "--out",
                                     "{tmp}/models"], "error: model config {tmp}/nope.json: no such file"),
    "train/merge/__main__.py": (["-m", "train.merge", "{tmp}/nope.yml", "{tmp}/out"],
                                "error: {tmp}/nope.yml: no such file"),
    "train/status/__main__.py": (["-m", "train.status", "{tmp}"], "error: {tmp}: not a run folder (no run.json)"),
    "scripts/update_config_doc.py": None,
    "scripts/mergekit_reference.py": None,  # regenerates tests/data/mergekit: a developer's tool, no input
}


def test_the_table_names_every_entry_point():
    """A new program with a `__main__` joins ENTRY_POINTS (and so runs through run_main with a bad input below)."""
    found = set()
    for f in REPO.rglob("*.py"):
        rel = f.relative_to(REPO).as_posix()
        # (runs/: the default BASE_DIR, where a bench may also keep a virtual environment of its own)
        if rel.split("/")[0] in ("bench", "examples", "tests", "build", "runs") or "/." in f"/{rel}":
            continue
        if re.search(r'^if __name__ == "__main__":', f.read_text(), re.M):
            found.add(rel)
            assert "run_main(" in f.read_text(), f"{rel}: its __main__ goes through train.core.errors.run_main"
    assert found == set(ENTRY_POINTS)


@pytest.mark.parametrize("name", [k for k, v in ENTRY_POINTS.items() if v is not None])
def test_every_entry_point_says_a_bad_input_in_one_line(tmp_path, name):
    (tmp_path / "bad.json").write_text(json.dumps({"outer": {"lr": -1}}))
    (tmp_path / "machines.json").write_text(json.dumps(["gpu1"]))
    argv, needle = ENTRY_POINTS[name]
    p = run_script(*[a.replace("{tmp}", str(tmp_path)) for a in argv], timeout=120)
    out = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr and len(out) == 1, out
    assert needle.replace("{tmp}", str(tmp_path)) in out[0], out[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad.json", "machines.json"]  # nothing written


def test_error_classes_keep_the_builtins_callers_catch():
    from train.core.errors import MergeError, ModelError, ProtocolError, TimedOut
    from train.launch.ssh import SSHError

    assert MergeError is ModelError and issubclass(ModelError, ValueError) and issubclass(ConfigError, ValueError)
    assert issubclass(TimedOut, UserError) and issubclass(TimedOut, TimeoutError)
    assert issubclass(ProtocolError, RuntimeError) and issubclass(SSHError, UserError)


def test_run_main_cli_prints_argparse_style_lines(capsys):
    def user():
        raise NotFound("machines.json: no such file\n(a JSON list of hosts)")

    with pytest.raises(SystemExit) as ei:
        run_main(user, "t", cli=True)
    assert ei.value.code == 2
    assert capsys.readouterr().err == "error: machines.json: no such file (a JSON list of hosts)\n"

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as ei:
        run_main(interrupted, "t", cli=True)
    assert ei.value.code == 130 and "every child process was stopped" not in capsys.readouterr().err


class DatasetGenerationError(Exception):  # what `datasets` wraps a failed cache write into
    __module__ = "datasets.builder"


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_disk_error_building_the_token_cache_is_one_line(tmp_path, monkeypatch, wrapped, code):
    """A full disk is waited out (outer.disk_full_wait_s, here 0.2 s), then one DiskFull line that names the token
    cache's folder and says to free space and rerun; any other disk error (read-only) is one line at once. Also when
    `datasets` wrapped the OSError into its own error (raise ... from e)."""
    from train.core import data, sharedfs

    calls = []

    def failing(*a, **k):
        calls.append(1)
        e = OSError(code, os.strerror(code))  # a write() fails without a file name
        if not wrapped:
            raise e
        raise DatasetGenerationError("An error occurred while generating the dataset") from e

    monkeypatch.setattr(data, "build_token_cache", failing)
    monkeypatch.setattr(sharedfs, "DISK_FULL_POLL_S", 0.05)
    monkeypatch.setattr(sharedfs, "_full_since", None)  # this process's disk-full episode: restored after the test
    cfg = load_config(REPO / "evolution.json", [f"base_dir={tmp_path}", "data.fake_data=true",
                                                "outer.disk_full_wait_s=0.2"])
    sharedfs.configure_from(cfg.outer)
    try:
        if code == errno.ENOSPC:
            with pytest.raises(sharedfs.DiskFull) as ei:
                data.prepare_data(cfg, None, 256, progress=False)
            msg = str(ei.value)
            assert "BASE_DIR stayed full" in msg and "outer.disk_full_wait_s = 0.2" in msg, msg
            assert str(cfg.run_dir / "data") in msg and "run the same command again" in msg, msg
            assert len(calls) >= 2  # tried again while it waited
        else:
            with pytest.raises(EnvironmentProblem, match=r"cannot build the token cache there: Read-only file system"
                                                         r"\. Check that base_dir is on a writable disk with space"):
                data.prepare_data(cfg, None, 256, progress=False)
            assert len(calls) == 1
    finally:
        sharedfs.configure(sharedfs.RETRY_S, sharedfs.DISK_FULL_WAIT_S)
