"""`launch_to_machines.py ... --backend slurm` against a real Slurm (tests/helpers/slurm.py: munged, slurmctld and
three slurmd on loopback, started by the test): a micro DiLoCo run whose worker step is cancelled (`scancel JOB.STEP`)
finishes; a micro EDT run that Slurm requeues (a node failure's path) resumes from its state and finishes; `stop`
makes every process leave cleanly; bad input (no sbatch, an unknown partition, a --time shorter than a round) is one
line and submits nothing. The dry-run script and its quoting need no Slurm."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, tiny_config
from tests.helpers.proc import wait_until
from tests.helpers.slurm import skip_reason, start_slurm
from train.config import ConfigError
from train.core.store import read_json
from train.exchange.store import DiLoCoPaths
from train.launch.slurm import SlurmLauncher, SlurmOptions, parse_time

pytestmark = pytest.mark.xdist_group("slurm")  # one xdist worker: the module's shared fixture

ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
SMALL_DATA = {"fake_data": True, "fake_tokens": 20_000}  # no tokenizing at the start: the launcher is under test
HOSTILE = "a b'c\"d$(touch pwned1)`touch pwned2`;touch pwned3"


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(REPO / "launch_to_machines.py"), *args], capture_output=True,
                         text=True, timeout=timeout, env={**(env or os.environ), **ENV})
    print(f"$ launch_to_machines.py {' '.join(args)} -> {out.returncode}\n{out.stdout}{out.stderr}")
    return out


def write_config(tmp: Path, *, derive_workers: bool = False, **sections) -> Path:
    """tiny_config; with derive_workers, without outer.num_workers (the launcher derives it, as from machines.json)."""
    raw = tiny_config(tmp / "runs", **sections)
    if derive_workers:
        raw["outer"].pop("num_workers")
    f = tmp / "evolution.json"
    f.write_text(json.dumps(raw, indent=1))
    return f


# -- no Slurm needed: the script, its quoting, the checks before anything is submitted ------------------------------
def test_dry_run_prints_the_batch_script_and_submits_nothing(tmp_path):
    cfg = write_config(tmp_path, derive_workers=True, project_name="p " + HOSTILE,
                       inner={"nproc_per_node": 2, "total_batch_size": 16})
    out = cli("launch", "--backend", "slurm", "--dry-run", "--config", str(cfg), "--nodes", "2", "--gpus-per-node",
              "4", "--partition", "gpu", "--time", "1-00:00", "--account", "lab", "--requeue",
              "--sbatch-arg=--qos=high", "--set", f"data.text_field={HOSTILE}",
              env={**os.environ, "PATH": "/nonexistent"})
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert not (tmp_path / "runs").exists()  # nothing written, nothing submitted (no sbatch on that PATH anyway)
    directives = [shlex.split(ln)[1] for ln in script.splitlines() if ln.startswith("#SBATCH ")]
    run_dir = tmp_path / "runs" / ("p " + HOSTILE)
    assert directives == ["--job-name=edt-p " + HOSTILE, "--nodes=2", "--ntasks-per-node=2",
                          f"--output={run_dir}/logs/slurm-%j.out", "--open-mode=append", "--requeue",
                          "--partition=gpu", "--account=lab", "--time=1-00:00", "--gpus-per-node=4", "--qos=high"]
    # 4 GPUs per node / 2 processes per worker = 2 workers per node: worker i on node i mod 2, a torchrun group
    steps = [shlex.split(ln) for ln in script.splitlines() if ln.startswith("step ")]
    assert [s[1:4] for s in steps] == [["coordinator", "${NODES[0]}", "--overlap"],
                                       ["worker-000", "${NODES[0 % ${#NODES[@]}]}", "--exact"],
                                       ["worker-001", "${NODES[1 % ${#NODES[@]}]}", "--exact"],
                                       ["worker-002", "${NODES[2 % ${#NODES[@]}]}", "--exact"],
                                       ["worker-003", "${NODES[3 % ${#NODES[@]}]}", "--exact"]]
    # two workers a node: each step its own CPUs (the job's per task) and its torchrun group's GPUs
    assert all(s[4:6] == ["--cpus-per-task=${SLURM_CPUS_PER_TASK:-1}", "--gpus=2"] for s in steps[1:])
    worker = steps[2][6:-1]
    assert worker[1:3] == ["-m", "train.launch.supervise"] and worker[worker.index("--") + 2:][:6] == [
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
    assert worker[worker.index("--set") :].count(f"data.text_field={HOSTILE}") == 1  # the exact value, as data
    assert f"project_name=p {HOSTILE}" not in worker  # from the file: not an override
    assert "outer.num_workers=4" in worker
    r = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr  # valid bash


def test_the_script_in_the_docs_is_what_the_dry_run_prints():
    """docs/slurm.md pastes the dry-run script for the shipped evolution.json, from a checkout at /mnt/shared/edt."""
    doc = (REPO / "docs" / "slurm.md").read_text()
    command = doc.split("from a checkout at `/mnt/shared/edt`:")[1].split("```bash\n")[1].split("\n```")[0]
    pasted = doc.split("<!-- dry-run script:")[1].split("```bash\n")[1].split("\n```")[0]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "launch_to_machines.py"] and "--dry-run" in argv
    out = cli(*argv[2:], "--config", str(REPO / "evolution.json"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n").replace(str(REPO), "/mnt/shared/edt") == pasted


def test_the_script_runs_no_hostile_value(tmp_path):
    """Every value in the script is quoted: bash runs it with stand-ins for scontrol / srun / the interpreter, and
    nothing hostile executes; srun gets each argument verbatim."""
    cfg = write_config(tmp_path, project_name="p " + HOSTILE)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text("#!/bin/sh\necho n1\n")
    (bin_ / "srun").write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\0' \"$a\"; done >> \"$ARGS_OUT\"\n")
    (bin_ / "py").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    ln = SlurmLauncher(str(cfg), [f"data.text_field={HOSTILE}"], SlurmOptions(python=str(bin_ / "py"),
                                                                              workdir=str(tmp_path)))
    work = tmp_path / "job"
    work.mkdir()
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "7",
           "ARGS_OUT": str(tmp_path / "srun.args")}
    r = subprocess.run(["bash", "-c", ln.script()], cwd=work, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    args = (tmp_path / "srun.args").read_bytes().split(b"\0")
    assert f"data.text_field={HOSTILE}".encode() in args and b"--worker" in args
    assert not list(tmp_path.rglob("pwned*")) and not list(REPO.glob("pwned*"))


def test_checks_before_submitting(tmp_path):
    cfg = write_config(tmp_path, outer={"local_steps": 5, "startup_grace_s": 100, "dead_after_s": 10})
    assert [parse_time(t) for t in ("90", "5:30", "1:00:00", "2-3", "1-00:30", "0-0:0:45", "UNLIMITED")] == [
        5400, 330, 3600, 183600, 88200, 45, None]
    with pytest.raises(ConfigError, match="--time 1h: not a Slurm time limit"):
        parse_time("1h")
    short = SlurmLauncher(str(cfg), [], SlurmOptions(time="1"))
    with pytest.raises(ConfigError, match=r"--time 1 \(60 s\) is shorter than one round's estimate \(110 s; no round "
                                          r"measured yet: the start-up window of a worker, outer.startup_grace_s 100"):
        short.launch()
    # with rounds measured, the estimate is this run's own: the median gap between its metrics records
    paths = DiLoCoPaths(short.cfg.run_dir)
    paths.metrics.parent.mkdir(parents=True)
    paths.metrics.write_text("".join(json.dumps({"round": r, "time": 1000.0 + 90 * r}) + "\n" for r in range(4)))
    with pytest.raises(ConfigError, match=r"\(90 s; the median of this run's last 3 measured rounds"):
        short.launch()
    assert SlurmLauncher(str(cfg), [], SlurmOptions(time="2")).launch(dry_run=True) == 0
    with pytest.raises(ConfigError, match="--sbatch-arg 'qos=high': one sbatch option on one line"):
        SlurmLauncher(str(cfg), [], SlurmOptions(sbatch_args=["qos=high"])).launch(dry_run=True)
    with pytest.raises(ConfigError, match="a line break cannot go into the batch script's #SBATCH lines: remove it "
                                          "from project_name / base_dir"):
        SlurmLauncher(str(cfg), ["project_name=a\ntouch pwned"], SlurmOptions()).launch(dry_run=True)
    with pytest.raises(ConfigError, match="remove it from --partition"):
        SlurmLauncher(str(cfg), [], SlurmOptions(partition="gpu\ntouch pwned")).launch(dry_run=True)
    with pytest.raises(ConfigError, match="--gpus-per-node 3 does not split into workers of 2 processes"):
        SlurmLauncher(str(cfg), ["inner.nproc_per_node=2", "inner.total_batch_size=16"],
                      SlurmOptions(gpus_per_node=3))
    # through the launcher's error path: one line, exit 2, nothing written
    out = cli("launch", "--backend", "slurm", "--config", str(cfg), "--time", "1:00",
              env={**os.environ, "PATH": "/nonexistent"})
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("error: --time 1:00 (60 s)")
    out = cli("launch", "--backend", "slurm", "--config", str(cfg), env={**os.environ, "PATH": "/nonexistent"})
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        "error: --backend slurm: no `sbatch` on PATH: run the launcher on a Slurm login node (or `module load "
        "slurm`), or use the SSH backend with machines.json")
    assert "Traceback" not in out.stderr and not (tmp_path / "runs" / "t" / "launch").exists()


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


# -- a real Slurm --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("slurm")
    try:
        s = start_slurm(folder)
    except RuntimeError as e:  # the daemons cannot run here (a container without what they need): say why
        pytest.skip(f"Slurm did not start ({str(e).splitlines()[0]}); its logs are in {folder}")
    yield s
    s.stop()


class Run:
    def __init__(self, slurm, tmp: Path, **sections):
        self.slurm, self.config = slurm, write_config(tmp, **sections)
        self.paths = DiLoCoPaths(tmp / "runs" / "t")

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return cli(args[0], "--backend", "slurm", "--config", str(self.config), *args[1:], env=self.slurm.env,
                   timeout=timeout)

    def job(self) -> str:
        return read_json(self.paths.root / "launch" / "slurm.json")["job_id"]

    def status(self) -> dict:
        out = self.cli("status", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def steps(self) -> dict[str, str]:
        out = self.slurm.run("squeue", "-h", "-s", "-j", self.job(), "-o", "%j %i").stdout
        return {k: v for k, v in (ln.split() for ln in out.splitlines()) if k != "batch"}

    def log(self, role: str) -> str:
        f = self.paths.logs / (f"{role}.out" if role.startswith("slurm-") else f"{role}.log")
        return f.read_text(errors="replace") if f.is_file() else ""


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_unknown_partition_submits_nothing(slurm, tmp_path):
    r = Run(slurm, tmp_path)
    out = r.cli("launch", "--partition", "gpu")
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        "error: --partition gpu: no such partition on this cluster (sinfo lists: debug): pick one of them, or leave "
        "--partition out for the default")
    assert not (r.paths.root / "launch").exists() and not slurm.run("squeue", "-h").stdout.strip()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.long  # a variant: test_stop_makes_every_process_leave runs a real DiLoCo job in the default tier
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_diloco_run_finishes_after_a_cancelled_step(slurm, tmp_path):
    # min_workers = 2: no round commits without worker 1, so the run can end only through its restarted step; each
    # worker is a 2-process torchrun group (gloo) inside its step, the layout of a multi-GPU worker
    r = Run(slurm, tmp_path, data=SMALL_DATA, outer={"rounds": 20, "local_steps": 4, "min_workers": 2},
            inner={"nproc_per_node": 2, "per_device_batch_size": 4})
    try:
        out = r.cli("launch", "--nodes", "2", "--time", "10", "--partition", "debug")
        assert out.returncode == 0 and "submitted job" in out.stdout, out.stderr
        again = r.cli("launch", "--nodes", "2")
        assert again.returncode == 0 and "left as is" in again.stdout  # one job per run
        wait_until(lambda: (r.paths.latest_committed() or 0) >= 1, 60, "round 1 committed under Slurm")
        steps = r.steps()
        assert set(steps) == {"coordinator", "worker-000", "worker-001"}
        st = r.status()
        assert st["job"]["state"] == "RUNNING" and {p["role"]: p["step"] for p in st["processes"]} == steps
        pids = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
        assert any(b"torch.distributed.run" in _cmdline(p) and b"--worker\x001" in _cmdline(p) for p in pids)
        slurm.run("scancel", steps["worker-001"])  # the step (supervisor and worker): the script starts it again
        wait_until(lambda: "the step of worker-001 ended with status" in r.log("worker-001"), 30, "step restarted")
        wait_until(lambda: (r.paths.final / "MANIFEST.json").is_file(), 60, "the run completes")
        assert r.paths.latest_committed() == 20 and r.log("worker-001").count("training windows") == 2
        commits = [ln for ln in r.log("coordinator").splitlines() if " committed: " in ln]
        assert len(commits) == 20 and all("2 deltas" in ln for ln in commits)
        assert "round 20 of 20, final model written" in r.cli("status").stdout
        logs = r.cli("logs", "-n", "2").stdout
        assert all(f"[{p}] " in logs for p in ("slurm", "coordinator", "worker-000", "worker-001")), logs
        follow = r.cli("logs", "-f", "--for", "1", "--host", "worker-001", "-n", "1")
        assert follow.returncode == 0 and "[worker-001] " in follow.stdout and "[worker-000]" not in follow.stdout
    finally:
        slurm.cancel_all()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_stop_makes_every_process_leave(slurm, tmp_path):
    r = Run(slurm, tmp_path, data=SMALL_DATA, outer={"rounds": 1000})
    try:
        assert r.cli("launch", "--nodes", "2").returncode == 0
        wait_until(lambda: all(r.paths.progress(w).is_file() for w in (0, 1)), 60, "both workers up")
        stop = r.cli("stop", "--grace", "30")
        assert stop.returncode == 0 and "stopped (SIGTERM: every process left)" in stop.stdout, stop.stdout
        assert "left cleanly: worker-000, worker-001" in stop.stdout
        assert "coordinator status 143" in r.log("slurm-" + r.job())  # stopped on request: the job still COMPLETED
        assert slurm.run("squeue", "-h", "-t", "all", "-j", r.job(), "-o", "%T").stdout.strip() == "COMPLETED"
        assert f"stop: job {r.job()} is not running (COMPLETED): nothing to stop" in r.cli("stop").stdout
        assert not r.steps() and "stopped_by" in read_json(r.paths.root / "launch" / "slurm.json")
    finally:
        slurm.cancel_all()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
# the long tier (python -m pytest -m long; CI runs it): Slurm restarts: the cancelled-step DiLoCo test is the default
# tier's
@pytest.mark.long
def test_edt_run_resumes_after_a_requeue_and_finishes(slurm, tmp_path):
    r = Run(slurm, tmp_path, data=SMALL_DATA, edt={"max_generations": 10})
    try:
        out = r.cli("launch", "--strategy", "edt", "--nodes", "1", "--requeue")  # two workers share the node
        assert out.returncode == 0, out.stderr
        assert "#SBATCH --requeue" in (r.paths.root / "launch" / "slurm-job.sh").read_text()
        wait_until(lambda: (r.paths.root / "generations" / "g000001" / "COMMITTED").is_file(), 90, "generation 1")
        slurm.run("scontrol", "requeue", r.job())  # what Slurm does to a --requeue job when a node fails
        wait_until(lambda: "start 1," in r.log("slurm-" + r.job()), 30, "the requeued job starts again")
        wait_until(lambda: (r.paths.final / "MANIFEST.json").is_file(), 90, "the EDT run completes")
        assert "resuming at generation 1 of 10" in r.log("coordinator")  # from its state on BASE_DIR
        st = r.status()
        assert st["run"]["final"] and st["run"]["committed_generation"] == 9 and st["job"]["id"] == r.job()
        assert "latest committed generation 9 of 10, final model written" in r.cli("status").stdout
    finally:
        slurm.cancel_all()
