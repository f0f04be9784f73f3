"""A private Slurm cluster for the Slurm backend's tests: munged (with a generated key), slurmctld and three slurmd
(nodes n1, n2, n3, all on this host: Slurm's multiple-slurmd mode, one port each) as child processes of the test, on
loopback ports, with their own slurm.conf, state and spool directories in the test's temp dir. No system config,
no system munge key, no system service is touched; the client commands find the cluster through SLURM_CONF.

Config: select/cons_tres, proctrack/linuxproc, task/none (no cgroups), no accounting storage (so `sacct` says
accounting is disabled: the launcher's status falls back to squeue), each node 4 CPUs whatever the host has
(SlurmdParameters=config_overrides). Two settings only make the tests quicker: credentials live 10 s, not 120
(`cred_expire`: a requeued job may start again once its old credentials expired) and the scheduler runs every
1-2 s. slurmd runs jobs as their user and so must run as root: without root, or without the binaries
(`apt-get install slurm-wlm munge`; .ci/run does), the tests skip with that reason.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2", "n3")
BINARIES = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def find(name: str) -> str | None:
    hit = shutil.which(name)
    if hit:
        return hit
    return next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def skip_reason() -> str | None:
    missing = [b for b in BINARIES if find(b) is None]
    if missing:
        return f"no {', '.join(missing)}: `apt-get install slurm-wlm munge` (.ci/run does, as root) to run the " \
               f"Slurm tests"
    if os.geteuid() != 0:
        return "the Slurm tests start slurmd, which runs job steps as their user and needs root: run them as root"
    return None


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def plugin_dir() -> str | None:
    for d in ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm", "/usr/lib64/slurm",
              "/usr/lib/slurm", "/usr/local/lib/slurm"):
        if os.path.isfile(f"{d}/select_cons_tres.so"):
            return d
    return None


@dataclass
class Slurm:
    dir: Path
    conf: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict:
        """The environment a client command needs to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        r = subprocess.run([find(argv[0]) or argv[0], *argv[1:]], capture_output=True, text=True, env=self.env,
                           timeout=timeout)
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def node_states(self) -> dict[str, str]:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(ln.split() for ln in r.stdout.splitlines() if len(ln.split()) == 2)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.dir.glob("*.log")))

    def cancel_all(self, timeout: float = 20) -> None:
        """scancel every job of the cluster and wait until squeue is empty (their processes are slurmstepd's, not
        ours: stopping the daemons would leave them running)."""
        ids = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if ids:
            self.run("scancel", *ids, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip():
            time.sleep(0.2)

    def stop(self) -> None:
        try:
            self.cancel_all()
            self.run("scontrol", "shutdown", check=False, timeout=10)
        except (OSError, subprocess.SubprocessError):
            pass
        for name in [n for n in self.procs if n != "munged"] + ["munged"]:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            deadline = time.monotonic() + 10
            while p.poll() is None and time.monotonic() < deadline and name != "munged":
                time.sleep(0.1)  # scontrol shutdown ends the daemons by themselves
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)  # our own child's group (started in its own session)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)


def write_conf(d: Path, ctld_port: int, node_ports: list[int], plugins: str) -> Path:
    conf = d / "slurm.conf"
    lines = [
        "ClusterName=edttest", "SlurmctldHost=localhost", f"SlurmctldPort={ctld_port}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={d / 'munge' / 'munge.socket'},cred_expire=10", f"PluginDir={plugins}",
        f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}/%n",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd-%n.log'}",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MailProg=/bin/true",
        "ReturnToService=2", "SlurmdParameters=config_overrides", "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2,bf_interval=1",
        "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=5", "MinJobAge=300",
        "MessageTimeout=20", "SlurmctldDebug=info", "SlurmdDebug=info",
        *(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs=4 RealMemory=1000 State=UNKNOWN"
          for n, p in zip(NODES, node_ports)),
        f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP", ""]
    conf.write_text("\n".join(lines))
    return conf


def start_slurm(d: Path, timeout: float = 40) -> Slurm:
    """munged, slurmctld and one slurmd per node; returns once sinfo shows every node idle."""
    plugins = plugin_dir()
    if plugins is None:
        raise RuntimeError("no Slurm plugin directory with select_cons_tres.so")
    for sub in ("munge", "state", *(f"spool/{n}" for n in NODES)):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "munge").chmod(0o755)  # munged wants the socket's folder reachable by every user
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ctld_port, *node_ports = free_ports(1 + len(NODES))
    conf = write_conf(d, ctld_port, node_ports, plugins)
    s = Slurm(d, conf)

    def spawn(name: str, argv: list[str]) -> None:
        with open(d / f"{name}.out", "ab") as out:
            s.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=s.env, start_new_session=True)

    try:
        m = d / "munge"
        spawn("munged", [find("munged"), "-F", "--force", f"--socket={m / 'munge.socket'}", f"--key-file={key}",
                         f"--log-file={m / 'munged.log'}", f"--pid-file={m / 'munged.pid'}",
                         f"--seed-file={m / 'munged.seed'}"])
        _wait(lambda: (m / "munge.socket").exists(), 10, "munged's socket", s)
        spawn("slurmctld", [find("slurmctld"), "-D", "-i", "-f", str(conf)])
        _wait(lambda: s.run("scontrol", "ping", check=False).stdout.count("UP") > 0, 15, "slurmctld answers", s)
        for n in NODES:
            spawn(f"slurmd-{n}", [find("slurmd"), "-D", "-N", n, "-f", str(conf)])
        _wait(lambda: sorted(s.node_states().values()) == ["idle"] * len(NODES), timeout, "every node idle", s)
    except BaseException:
        s.stop()
        raise
    return s


def _wait(pred, timeout: float, what: str, s: Slurm) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        dead = [n for n, p in s.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            outs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in s.dir.glob("*.out"))
            raise RuntimeError(f"Slurm did not come up ({what}; exited: {dead or 'none'}):\n{outs}\n{s.logs()}")
        time.sleep(0.1)
