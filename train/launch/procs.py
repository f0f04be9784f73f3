"""Local worker processes for the simulators: start, watch, stop (no orphans).

Each worker is a real OS process (`python -m <module> --config ... --worker i`) in its own session / process group,
with stdout and stderr appended to logs/worker-XXX.log in the run folder: the same program the SSH launcher starts
on a cluster. With `nproc` > 1 a worker is a torchrun group instead (`python -m torch.distributed.run --standalone
--nproc_per_node N -m <module> ...`; see train/core/dist.py), still one process group. `stop()` signals each whole
process group (SIGTERM, then SIGKILL after a grace period).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from train.core.config import REPO_ROOT
from train.core.errors import WorkerDied  # noqa: F401  (raised here)


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the simulator dies, even by SIGKILL (Linux prctl)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the worker's own lock still prevents a second copy


def worker_argv(python: str, module: str, nproc: int = 1) -> list[str]:
    """The command prefix that starts one worker: `python -m module`, or a standalone torchrun group of `nproc`
    processes on this host (its own rendezvous on a free local port, so several groups share a host)."""
    if nproc <= 1:
        return [python, "-m", module]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", module]


def tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + ln for ln in lines[-n:])


class LocalWorkers:
    def __init__(self, module: str, config_path: str, overrides: list[str], num: int, log_paths: list[Path],
                 threads: int = 0, extra_args: list[str] | None = None, nproc: int = 1):
        self.module, self.config_path, self.overrides = module, config_path, overrides
        self.num, self.log_paths, self.threads, self.nproc = num, log_paths, threads, nproc
        self.extra_args = extra_args or []
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        if self.threads:
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
        for i in range(self.num):
            cmd = [*worker_argv(sys.executable, self.module, self.nproc), "--config", self.config_path,
                   "--worker", str(i), *[a for ov in self.overrides for a in ("--set", ov)], *self.extra_args]
            if self.threads:
                cmd += ["--threads", str(self.threads)]
            self.log_paths[i].parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_paths[i], "ab") as logf:
                self.procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                                   start_new_session=True, env=env,
                                                   preexec_fn=die_with_parent))

    def check(self) -> None:
        """Raise WorkerDied (with the log's tail) if a worker exited with an error."""
        for i, p in enumerate(self.procs):
            rc = p.poll()
            if rc not in (None, 0):
                how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
                raise WorkerDied(f"worker {i} (pid {p.pid}) {how}; last lines of {self.log_paths[i]}:\n"
                                 f"{tail(self.log_paths[i])}\nFix the cause and run the same command again: the run "
                                 f"resumes from its last committed state.")

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            left = max(0.0, deadline - time.monotonic())
            try:
                p.wait(left)
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, grace: float = 5.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                return
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(p.poll() is None for p in alive):
                time.sleep(0.05)
