"""Ctrl-C on the simulator stops every child process (no orphans), and the same command resumes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.helpers.proc import ctrl_c_default, script_cmd
from train.exchange.store import DiLoCoPaths


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_ctrl_c_stops_all_workers_and_rerun_resumes(write_config, tmp_path):
    # far more rounds than it can train before the Ctrl-C lands, however fast the box: the signal, not the speed,
    # ends the first run (with 40 rounds a fast box finished them before the test had read round 1)
    cfg_path = write_config(outer={"rounds": 100_000, "local_steps": 3})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    cmd = script_cmd("diloco_sim.py", "--config", str(cfg_path))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=ctrl_c_default)
    deadline = time.monotonic() + 180
    while (paths.latest_committed() or 0) < 1:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no round committed in time"
        time.sleep(0.2)
    pids = [json.loads(paths.progress(w).read_text())["pid"] for w in range(2)]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "run the same command to resume" in out
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "worker processes survived Ctrl-C"
    reached = paths.latest_committed()

    # Same command, fewer rounds left: resumes (no round 0 re-init) and finishes.
    out = subprocess.run(cmd + ["--rounds", str(reached + 2)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "initialising round 0" not in out.stderr
    assert paths.latest_committed() == reached + 2
