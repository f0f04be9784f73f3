"""status / logs / stop of a run submitted with `launch_to_machines.py launch --backend slurm` (train/launch/slurm.py).

status: the job (squeue; sacct once squeue has forgotten it, where the cluster keeps accounting), its steps (one per
worker, named after the role), and the run's own state on BASE_DIR (each process's lease, the committed round /
generation, the last log line). logs: the coordinator's and the workers' log files (the steps append to
logs/<role>.log) and the batch output (logs/slurm-<job>.out). stop: `scancel --signal=TERM` (every step's process
gets SIGTERM: each supervisor passes it on and restarts nothing, each worker leaves at its next inner step, the
coordinator stops, the script sees steps that were asked to stop and exits 0), then `scancel` after --grace seconds
for whatever still runs.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from train.config import ConfigError
from train.core.store import atomic_write_json
from train.launch.remote import LogFollower, progress_of, run_totals, tail
from train.launch.slurm import LIVE_STATES, RECORD, SlurmLauncher, job_state, job_steps, run_slurm


def _record(ln: SlurmLauncher) -> dict:
    rec = ln.record()
    if rec is None:
        raise ConfigError(f"{ln.paths.root / 'launch' / RECORD}: no Slurm job recorded for run {ln.cfg.run_dir}: "
                          f"`launch --backend slurm` it first (with the same --config / --set / --project)")
    return rec


def run_state(ln: SlurmLauncher) -> dict:
    paths, cfg = ln.paths, ln.cfg
    from train.core import sharedfs
    from train.edt.store import EDTPaths

    gens = EDTPaths(paths.root).committed_generations()
    return {"run_dir": str(paths.root), "committed": paths.latest_committed(), **run_totals(paths, cfg),
            "committed_generation": max(gens) if gens else None,
            "final": sharedfs.is_file(paths.final / "MANIFEST.json")}


def status(ln: SlurmLauncher, as_json: bool = False) -> int:
    rec = _record(ln)
    job = job_state(rec["job_id"]) or {"state": "UNKNOWN", "reason": "neither squeue nor sacct knows it"}
    steps = job_steps(rec["job_id"]) if job.get("state") in LIVE_STATES else {}
    procs = []
    for role in rec.get("roles") or [r for r, _ in ln.plan()]:
        st = steps.get(role, {})
        procs.append({"role": role, "step": st.get("step", ""),
                      "nodes": st.get("nodes", ""), "progress": progress_of(ln.paths, role),
                      "log_last": (tail(ln.paths.logs / f"{role}.log", 1) or [""])[0]})
    run = run_state(ln)
    if as_json:
        ln.say(json.dumps({"job": {"id": rec["job_id"], **job}, "processes": procs, "run": run}, indent=1,
                          sort_keys=True))
        return 0
    ln.say(f"job {rec['job_id']}: {job['state']}" + "".join(f", {k} {job[k]}" for k in ("elapsed", "limit", "nodes")
                                                            if job.get(k)) + (f" ({job['reason']})" if
                                                                             job.get("reason") not in (None, "None")
                                                                             else ""))
    rows = [("process", "step", "node", "state", "last log line")]
    for p in procs:
        pr = p["progress"]
        where = pr.get("status", "")
        at = next((f" {k} {pr[k]}" for k in ("generation", "round") if k in pr), "")
        last = p["log_last"] if len(p["log_last"]) <= 100 else p["log_last"][:97] + "..."
        rows.append((p["role"], p["step"] or "-", p["nodes"] or "-", (where + at).strip() or "-", last))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        ln.say("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    what = f"generation {run['committed_generation']} of {run['generations']}" \
        if run["committed_generation"] is not None else f"round {run['committed']} of {run['rounds']}"
    ln.say(f"run {run['run_dir']}: latest committed {what}" + (", final model written" if run["final"] else ""))
    return 0


def log_files(ln: SlurmLauncher, rec: dict) -> dict[str, Path]:
    roles = rec.get("roles") or [r for r, _ in ln.plan()]
    return {"slurm": ln.paths.logs / f"slurm-{rec['job_id']}.out",
            **{r: ln.paths.logs / f"{r}.log" for r in roles}}


def logs(ln: SlurmLauncher, only: str | None = None, lines: int = 20, follow: bool = False,
         for_s: float = 0.0) -> int:
    rec = _record(ln)
    files = log_files(ln, rec)
    if only is not None:
        if only not in files:
            raise ConfigError(f"--host {only}: not a process of job {rec['job_id']} (one of: {', '.join(files)})")
        files = {only: files[only]}
    follower = LogFollower(files)
    for role, text in follower.last(lines):
        ln.say(f"[{role}] {text}")
    end = time.monotonic() + for_s if for_s else None
    try:
        while follow and (end is None or time.monotonic() < end):
            for role, text in follower.new_lines():
                ln.say(f"[{role}] {text}")
            time.sleep(0.3)
    except KeyboardInterrupt:
        pass
    return 0


def stop(ln: SlurmLauncher, grace: float = 10.0) -> int:
    """A clean leave: SIGTERM to every step of the job (not to the batch script: it waits for them and ends
    the job), then scancel whatever is left after `grace` seconds. The record keeps how it ended."""
    rec = _record(ln)
    job_id = rec["job_id"]
    st = job_state(job_id)
    if not st or st["state"] not in LIVE_STATES:
        ln.say(f"stop: job {job_id} is not running ({(st or {}).get('state', 'unknown to squeue and sacct')}): "
               f"nothing to stop")
        return 0
    if st["state"] == "PENDING":
        run_slurm(["scancel", job_id])
        how = "cancelled while pending"
    else:
        run_slurm(["scancel", "--signal=TERM", job_id])
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            st = job_state(job_id)
            if not st or st["state"] not in LIVE_STATES:
                break
            time.sleep(0.3)
        if st and st["state"] in LIVE_STATES:
            run_slurm(["scancel", job_id])
            how = f"cancelled (scancel after {grace:g} s: it had not ended after SIGTERM)"
        else:
            how = "stopped (SIGTERM: every process left)"
    rec.update(stopped=time.time(), stopped_by=how)
    atomic_write_json(ln.paths.root / "launch" / RECORD, rec)
    left = [r for r in rec.get("roles", []) if str(progress_of(ln.paths, r).get("status", "")).startswith("left")]
    ln.say(f"stop: job {job_id} {how}" + (f"; left cleanly: {', '.join(left)}" if left else ""))
    return 0


def run_command(a) -> int:
    """launch_to_machines.py's subcommand `a.command` with --backend slurm (machines.json is not read)."""
    from train.launch.cli import overrides_from
    from train.launch.slurm import options_from

    if a.command == "preflight":
        raise ConfigError("preflight checks the SSH hosts of machines.json; with --backend slurm, `launch --dry-run` "
                          "prints the job's script and `launch` checks sbatch, the partition and --time")
    ln = SlurmLauncher(a.config, overrides_from(a), options_from(a), strategy=a.strategy)
    if a.command == "launch":
        return ln.launch(a.dry_run)
    if a.dry_run:
        raise ConfigError("--dry-run: only `launch` has one with --backend slurm (it prints the batch script)")
    if a.command == "status":
        return status(ln, a.json)
    if a.command == "logs":
        return logs(ln, a.host, a.lines, a.follow, a.for_s)
    return stop(ln, a.grace)
