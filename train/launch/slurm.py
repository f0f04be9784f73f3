"""The Slurm backend of launch_to_machines.py (`--backend slurm`): one batch job for the run.

    python launch_to_machines.py launch --backend slurm --nodes 2 --partition gpu --gpus-per-node 4 --time 4:00:00

The job's script (`--dry-run` prints it; it is also kept as BASE_DIR/<project>/launch/slurm-job.sh) starts one
`srun` step per process: the coordinator on the first node (--overlap: it shares the workers' CPUs) and each worker
(worker i on node i mod --nodes; a worker of N processes is a torchrun group inside its step, with N of the node's
GPUs), every one of them under the supervisor the SSH backend uses (train/launch/procs.py: restarts of a process
that dies); the batch step itself only waits for them. A step that ends badly
from outside (`scancel JOB.STEP`, a lost node) is started again by the script, up to outer.max_restarts times; a
requeued job (`--requeue`, a node failure) runs the script again and the run resumes from its state on BASE_DIR.
Every value put into the script is quoted with shlex.quote (sbatch reads `#SBATCH` lines with the same quoting);
the script names no value unquoted. The record of the submission is BASE_DIR/<project>/launch/slurm.json.
status / logs / stop: train/launch/slurm_ops.py. Docs: docs/slurm.md.
"""
from __future__ import annotations

import argparse
import logging
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from train.config import REPO_ROOT, ConfigError, load_config
from train.core.errors import EnvironmentProblem, UserError
from train.core.store import RunPaths, atomic_write_bytes, atomic_write_json, read_json, read_jsonl
from train.exchange.store import DiLoCoPaths
from train.config.strategies import strategy as get_strategy
from train.launch.procs import supervised_argv, worker_argv

log = logging.getLogger("launcher")

RECORD, SCRIPT = "slurm.json", "slurm-job.sh"  # under BASE_DIR/<project>/launch/
LIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
               "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD"}


class SlurmError(UserError, RuntimeError):
    """A Slurm command failed (sbatch, squeue, scancel, sinfo); the message says which, what it printed, and the
    fix."""


@dataclass
class SlurmOptions:
    nodes: int = 1
    partition: str | None = None
    gpus_per_node: int = 0
    time: str | None = None
    account: str | None = None
    sbatch_args: list[str] = field(default_factory=list)
    requeue: bool = False
    python: str = sys.executable
    workdir: str = str(REPO_ROOT)


def add_slurm_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("Slurm (--backend slurm; docs/slurm.md)")
    g.add_argument("--nodes", type=int, default=1, help="nodes of the job; worker i runs on node i mod N "
                                                        "(default: %(default)s)")
    g.add_argument("--partition", help="partition to submit to (default: the cluster's default)")
    g.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs per node; a node holds gpus-per-node / inner.nproc_per_node workers (default: none)")
    g.add_argument("--time", help="the job's time limit, Slurm's format (minutes, H:MM:SS, D-HH:MM, ...); refused "
                                  "when shorter than one round's estimate")
    g.add_argument("--account", help="account to charge")
    g.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="ARG",
                   help="one more sbatch option, passed through as an #SBATCH line, e.g. --sbatch-arg=--qos=high "
                        "(repeatable)")
    g.add_argument("--requeue", action="store_true", help="let Slurm requeue the job after a node failure (the run "
                                                          "resumes from its state on BASE_DIR)")
    g.add_argument("--python", default=sys.executable, help="interpreter on the nodes (default: this one, "
                                                            "%(default)s)")
    g.add_argument("--workdir", default=str(REPO_ROOT), help="the project checkout on the nodes (default: this "
                                                             "one, %(default)s)")


def options_from(a: argparse.Namespace) -> SlurmOptions:
    return SlurmOptions(nodes=a.nodes, partition=a.partition, gpus_per_node=a.gpus_per_node, time=a.time,
                        account=a.account, sbatch_args=list(a.sbatch_args), requeue=a.requeue, python=a.python,
                        workdir=a.workdir)


# -- time limits -------------------------------------------------------------------------------------------------------
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time(text: str) -> float | None:
    """Seconds of a Slurm time limit (`30`, `30:00`, `4:00:00`, `1-12`, `1-12:30`, `1-12:30:00`); None for
    UNLIMITED / INFINITE."""
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(t)
    if not m:
        raise ConfigError(f"--time {text}: not a Slurm time limit: use minutes (90), MM:SS, H:MM:SS, D-HH, D-HH:MM "
                          f"or D-HH:MM:SS")
    d, a, b, c = m.groups()
    if d is not None:  # days-hours[:minutes[:seconds]]
        return int(d) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:
        return int(a) * 60 + int(b)
    return int(a) * 60


def round_estimate(cfg, paths: RunPaths) -> tuple[float, str]:
    """(seconds one round / generation is expected to take, how that was worked out). Measured on the run itself
    when its metrics.jsonl holds at least two records (the median gap between consecutive ones); else the window
    the coordinator gives a starting worker before it goes on without it (outer.startup_grace_s +
    outer.dead_after_s): a job shorter than that cannot finish even its first round with a worker that starts
    slowly."""
    times = [r["time"] for r in read_jsonl(paths.metrics) if isinstance(r.get("time"), (int, float))]
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    if gaps:
        return statistics.median(gaps), f"the median of this run's last {len(gaps[-20:])} measured rounds " \
                                        f"({paths.metrics})"
    oc = cfg.outer
    return oc.startup_grace_s + oc.dead_after_s, f"no round measured yet: the start-up window of a worker, " \
                                                 f"outer.startup_grace_s {oc.startup_grace_s:g} s + " \
                                                 f"outer.dead_after_s {oc.dead_after_s:g} s"


# -- the plan and the script -------------------------------------------------------------------------------------------
def q(x) -> str:
    return shlex.quote(str(x))


class SlurmLauncher:
    """Plans the run's job, writes its script, submits it; status / logs / stop in slurm_ops (same object)."""

    def __init__(self, config_path: str, overrides: list[str], opts: SlurmOptions, strategy: str = "diloco",
                 out=print):
        self.opts, self.out, self.user_overrides = opts, out, list(overrides)
        if opts.nodes < 1:
            raise ConfigError(f"--nodes {opts.nodes}: must be >= 1")
        if opts.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node {opts.gpus_per_node}: must be >= 0")
        self.local_config = Path(config_path).resolve()
        root = Path(opts.workdir).resolve() if Path(opts.workdir).is_dir() else REPO_ROOT
        # The config as the job sees it: relative to the workdir when it lies in this checkout, else this path.
        self.config_arg = str(self.local_config.relative_to(root)) \
            if self.local_config.is_relative_to(root) else str(self.local_config)
        self.config_path = config_path
        self.configure(strategy)

    def configure(self, strategy: str) -> None:
        """The config for `strategy`; without outer.num_workers in it: one worker per slot (gpus-per-node /
        nproc per node, or 1) on each node, the SSH backend's one-per-machine rule; derived values go to every
        process as overrides, so all agree."""
        s = get_strategy(strategy)
        self.strategy = strategy
        load = lambda n: load_config(self.config_path, self.user_overrides, strategy=strategy,  # noqa: E731
                                     defaults={"outer.num_workers": n})
        self.cfg, derived = load(self.opts.nodes), []
        nproc = self.cfg.inner.nproc_per_node
        if nproc > 1 and not s.multi_process:
            raise ConfigError(f"inner.nproc_per_node = {nproc}: {strategy} workers run as one process each: set it "
                              f"to 1")
        g = self.opts.gpus_per_node
        if g and g % nproc:
            raise ConfigError(f"--gpus-per-node {g} does not split into workers of {nproc} processes "
                              f"(inner.nproc_per_node): give a multiple of {nproc}")
        self.per_node = g // nproc if g else 1
        if "outer.num_workers" not in self.cfg.user_keys:
            n = self.opts.nodes * self.per_node
            if n != self.opts.nodes:
                self.cfg = load(n)
            derived = [f"outer.num_workers={n}"]
            log.info("outer.num_workers = %d: one worker per node (per GPU group with --gpus-per-node); set "
                     "outer.num_workers to choose another number", n)
        self.overrides = [*self.user_overrides, *derived, *self.cfg.default_overrides()]
        self.paths = DiLoCoPaths(self.cfg.run_dir)  # the rounds' markers too (status: latest committed)

    @property
    def nproc(self) -> int:
        return self.cfg.inner.nproc_per_node

    def sets(self) -> list[str]:
        return [x for ov in self.overrides for x in ("--set", ov)]

    def plan(self) -> list[tuple[str, list[str]]]:
        """(role, argv) of the coordinator and each worker, before the supervisor goes around them."""
        s, py = get_strategy(self.strategy), self.opts.python
        conf = ["--config", self.config_arg, *self.sets()]
        procs = [("coordinator", [py, "-m", s.coordinator_module, *conf, "--no-progress"])]
        for i in range(self.cfg.outer.num_workers):
            procs.append((f"worker-{i:03d}", [*worker_argv(py, s.worker_module, self.nproc), *conf[:2], "--worker",
                                              str(i), *conf[2:]]))
        return procs

    def directives(self) -> list[str]:
        o, tasks = self.opts, -(-self.cfg.outer.num_workers // self.opts.nodes)  # workers per node, rounded up
        d = [f"--job-name={self.job_name()}", f"--nodes={o.nodes}", f"--ntasks-per-node={max(1, tasks)}",
             f"--output={self.paths.logs / 'slurm-%j.out'}", "--open-mode=append",
             "--requeue" if o.requeue else "--no-requeue"]
        d += [f"--partition={o.partition}"] if o.partition else []
        d += [f"--account={o.account}"] if o.account else []
        d += [f"--time={o.time}"] if o.time else []
        d += [f"--gpus-per-node={o.gpus_per_node}"] if o.gpus_per_node else []
        for a in o.sbatch_args:
            if "\n" in a or "\r" in a or not a.startswith("-"):
                raise ConfigError(f"--sbatch-arg {a!r}: one sbatch option on one line, starting with '-' "
                                  f"(e.g. --sbatch-arg=--qos=high)")
        for x in d:  # an #SBATCH line ends at a line break: what follows it would be shell code
            if "\n" in x or "\r" in x:
                flag = x.split("=")[0]
                src = "project_name / base_dir" if flag in ("--job-name", "--output") else flag
                raise ConfigError(f"#SBATCH {x!r}: a line break cannot go into the batch script's #SBATCH lines: "
                                  f"remove it from {src}")
        return [*d, *o.sbatch_args]

    def job_name(self) -> str:
        return f"edt-{self.cfg.project_name}"

    def script(self) -> str:
        """The batch script: #SBATCH lines, then bash in which every value is quoted."""
        cfg, o = self.cfg, self.opts
        restarts, logs = cfg.outer.max_restarts, self.paths.logs
        procs = self.plan()
        # Workers that share a node each take their own part of it (--exact: their tasks' CPUs, and their GPUs);
        # a worker alone on its node gets all the job has there. SLURM_CPUS_PER_TASK: srun does not inherit it.
        shared = -(-cfg.outer.num_workers // o.nodes) > 1
        per_worker = ' --exact --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"' if shared else ""
        per_worker += f" --gpus={self.nproc}" if o.gpus_per_node else ""
        lines = ["#!/bin/bash", *(f"#SBATCH {q(d)}" for d in self.directives()),
                 f"# A {get_strategy(self.strategy).name} run, written by `launch_to_machines.py launch --backend "
                 f"slurm` (docs/slurm.md).",
                 "# One srun step per process: the coordinator on the first node (--overlap: it shares the CPUs), "
                 "worker i on node i mod N,",
                 "# each under train.launch.supervise (a process that dies is restarted); a step that ends badly "
                 "(scancel of the step, a",
                 "# lost node) is started again. `stop --backend slurm` = scancel --signal=TERM: every process "
                 "leaves cleanly.",
                 "set -u", f"cd {q(o.workdir)} || exit 2", f"LOGS={q(logs)}", 'mkdir -p "$LOGS"',
                 'NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
                 'echo "=== $(date \'+%F %T\') job $SLURM_JOB_ID, start ${SLURM_RESTART_COUNT:-0}, nodes ${NODES[*]}"',
                 "",
                 "step() {  # step ROLE NODE [SRUN OPTIONS] ARGV...: one srun step, started again unless it ended "
                 "well (0),",
                 "          # with a user error (2) or because it was asked to stop (SIGINT 130, SIGTERM 143)",
                 "    local role=$1 node=$2 tries=0 rc; shift 2",
                 "    while :; do",
                 '        srun --nodes=1 --ntasks=1 --kill-on-bad-exit=0 --job-name="$role" -w "$node" '
                 '--output="$LOGS/$role.log" --open-mode=append "$@"',
                 "        rc=$?",
                 "        case $rc in 0|2|130|143) return $rc;; esac",
                 f"        [ $tries -ge {int(restarts)} ] && return $rc",
                 "        tries=$((tries + 1))",
                 f'        echo "=== $(date \'+%F %T\') slurm: the step of $role ended with status $rc; starting it '
                 f'again ($tries/{int(restarts)})" >> "$LOGS/$role.log"',
                 "        sleep $tries",
                 "    done",
                 "}", ""]
        for i, (role, argv) in enumerate(procs):
            node = '"${NODES[0]}" --overlap' if role == "coordinator" else \
                f'"${{NODES[{i - 1} % ${{#NODES[@]}}]}}"' + per_worker
            name = "the coordinator" if role == "coordinator" else role.replace("-", " ")
            lines.append(f"step {q(role)} {node} "
                         + " ".join(q(x) for x in supervised_argv(o.python, argv, restarts, name)) + " &")
            if role == "coordinator":
                lines.append("COORD=$!")
        lines += ["",
                  "wait $COORD; coord_rc=$?",
                  "if [ $coord_rc != 0 ]; then  # stopped, or failed for good: the workers leave too",
                  '    echo "=== $(date \'+%F %T\') the coordinator ended with status $coord_rc: the workers leave"',
                  '    scancel --signal=TERM "$SLURM_JOB_ID"',
                  "fi",
                  "wait",
                  'echo "=== $(date \'+%F %T\') job $SLURM_JOB_ID: done (coordinator status $coord_rc)"',
                  "case $coord_rc in 0|130|143) exit 0;; esac  # done, or stopped on request",
                  "exit $coord_rc", ""]
        return "\n".join(lines)

    # -- checks and submission -----------------------------------------------------------------------------------------
    def check_time(self) -> None:
        if not self.opts.time:
            return
        limit = parse_time(self.opts.time)
        est, how = round_estimate(self.cfg, self.paths)
        if limit is not None and limit < est:
            fix = "fewer outer.local_steps" if how.startswith("the median") else "a shorter outer.startup_grace_s"
            raise ConfigError(f"--time {self.opts.time} ({limit:g} s) is shorter than one round's estimate "
                              f"({est:g} s; {how}): give a longer --time, or {fix}")

    def check_cluster(self) -> None:
        """sbatch on PATH; the partition exists (sinfo). Nothing is submitted when these fail."""
        if shutil.which("sbatch") is None:
            raise EnvironmentProblem("--backend slurm: no `sbatch` on PATH: run the launcher on a Slurm login node "
                                     "(or `module load slurm`), or use the SSH backend with machines.json")
        if self.opts.partition:
            parts = [p.strip() for p in run_slurm(["sinfo", "-h", "-o", "%R"]).split()]
            if self.opts.partition not in parts:
                raise ConfigError(f"--partition {self.opts.partition}: no such partition on this cluster (sinfo "
                                  f"lists: {', '.join(sorted(set(parts))) or 'none'}): pick one of them, or leave "
                                  f"--partition out for the default")

    def record(self) -> dict | None:
        f = self.paths.root / "launch" / RECORD
        try:
            rec = read_json(f) if f.is_file() else None
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) and "job_id" in rec else None

    def say(self, text: str) -> None:
        self.out(text)

    def launch(self, dry_run: bool = False) -> int:
        self.check_time()
        text = self.script()
        if dry_run:
            self.say(text.rstrip("\n"))
            return 0
        self.check_cluster()
        rec = self.record()
        if rec is not None:
            st = job_state(rec["job_id"])
            if st and st["state"] in LIVE_STATES:  # idempotent, as the SSH backend: never two jobs for one run
                self.say(f"launch (slurm): job {rec['job_id']} of this run is {st['state']}: left as is (`stop` "
                         f"first to start it anew)")
                return 0
        folder = self.paths.root / "launch"
        folder.mkdir(parents=True, exist_ok=True)
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / SCRIPT, text.encode())
        out = run_slurm(["sbatch", "--parsable", str(folder / SCRIPT)])
        job_id = out.strip().splitlines()[-1].split(";")[0].strip()
        if not job_id.isdigit():
            raise SlurmError(f"sbatch answered {out.strip()!r}, not a job id")
        atomic_write_json(folder / RECORD, {"job_id": job_id, "submitted": time.time(), "script": str(folder / SCRIPT),
                                            "strategy": self.strategy, "workers": self.cfg.outer.num_workers,
                                            "roles": [r for r, _ in self.plan()], "options": vars(self.opts)})
        self.say(f"launch (slurm, {self.strategy}, run {self.cfg.run_dir}): submitted job {job_id} "
                 f"({self.cfg.outer.num_workers} workers on {self.opts.nodes} node(s)); script {folder / SCRIPT}")
        self.say("next: `python launch_to_machines.py status --backend slurm`, `... logs -f`, `... stop` (same "
                 "options)")
        return 0


def run_slurm(argv: list[str], timeout: float = 60.0) -> str:
    """stdout of a Slurm client command; SlurmError with what it printed when it fails."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise EnvironmentProblem(f"no `{argv[0]}` on PATH: run the launcher on a Slurm login node (or `module load "
                                 f"slurm`)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{argv[0]}` did not answer within {timeout:g} s: is slurmctld up (`scontrol ping`)?") \
            from None
    if r.returncode != 0:
        msg = " | ".join((r.stderr.strip() or r.stdout.strip() or "(no output)").splitlines()[-3:])
        raise SlurmError(f"`{shlex.join(argv)}` failed (exit status {r.returncode}): {msg}")
    return r.stdout


def job_state(job_id: str) -> dict | None:
    """{'state', 'elapsed', 'limit', 'nodes', 'reason', 'source'} of a job: squeue, else sacct; None when neither
    knows it (finished and forgotten, without accounting)."""
    try:
        out = run_slurm(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T|%M|%l|%N|%r"])
    except SlurmError as e:
        if "Invalid job id" not in str(e):
            raise
        out = ""
    row = next((ln.split("|") for ln in out.splitlines() if ln.count("|") == 4), None)
    if row:
        return {"state": row[0], "elapsed": row[1], "limit": row[2], "nodes": row[3], "reason": row[4],
                "source": "squeue"}
    try:
        out = run_slurm(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State,Elapsed,Timelimit,NodeList,"
                                                                             "ExitCode"])
    except SlurmError as e:  # a cluster without accounting storage: say so, it is not an error of the run
        return {"state": "ENDED", "reason": f"squeue no longer knows the job; sacct: {e}", "source": "none"}
    row = next((ln.split("|") for ln in out.splitlines() if ln.count("|") == 4), None)
    if not row:
        return None
    return {"state": row[0].split()[0], "elapsed": row[1], "limit": row[2], "nodes": row[3],
            "reason": f"exit code {row[4]}", "source": "sacct"}


def job_steps(job_id: str) -> dict[str, dict]:
    """The job's live steps by name (the role: srun --job-name=worker-000): {'step', 'nodes', 'elapsed'}."""
    try:
        out = run_slurm(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i|%j|%N|%M"])
    except SlurmError:
        return {}
    steps = {}
    for ln in out.splitlines():
        parts = ln.split("|")
        if len(parts) == 4:
            steps[parts[1]] = {"step": parts[0], "nodes": parts[2], "elapsed": parts[3]}
    return steps
