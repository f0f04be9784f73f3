"""The launcher's agent on each host: start, inspect, tail and stop this host's processes of a run.

The SSH launcher (launch_to_machines.py) runs `python -m train.launch.remote <command> ...` on each host, in the
project checkout, with the machine's interpreter; the last stdout line `EDT-JSON <json>` is the answer.

    start     --config C [--set K=V] --machine LABEL --role worker-000 [--check S] [--max-restarts N] -- ARGV...
              Start ARGV detached (own session = own process group, stdin /dev/null, stdout+stderr appended to
              logs/<role>.log) and record it atomically in launch/<role>.json (host, pid, pgid, log, command, start
              time, the process's kernel start time). Every role — the workers and the coordinator — runs under
              its supervisor (train/launch/procs.py, the simulators' own: restarted up to N times, default
              outer.max_restarts; the supervisor leads the process group, its child is in it; a restarted
              coordinator resumes from its last commit). A live process already recorded for the role is reused,
              never doubled (a killed supervisor takes its child with it: the role is then started again). Fails
              when the process exits within S seconds (with the log's tail).
    status    ... --machine LABEL [--role R ...]   the roles' state, pid, last log line, round / generation, whether
              the supervisor lives, the restarts it made, how a process that nobody stopped ended (its lease's
              last record), and the coordinator's lease: what it does and how long ago it beat
    logs      ... --role R ... [--lines N] [--follow [--for S]]   `role<TAB>line`; follow ends on stdin EOF
    stop      ... --machine LABEL [--role R ...] [--grace S]  SIGTERM (then SIGKILL) exactly the recorded process
              groups of this machine (a supervisor and its worker together: the worker leaves, nothing restarts);
              a record whose pid now belongs to another process is left alone.
    preflight ... [--write-token T | --read-token T | --remove-token T]   interpreter, torch, transformers, GPUs,
              config and code fingerprints, and the shared-BASE_DIR token test.
Records and logs live under BASE_DIR/<project>/launch/ and logs/. Nothing here imports torch except preflight.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from train.config import load_config
from train.core import objstore, sharedfs
from train.core.errors import UserError
from train.core.coordinator_lease import coordinator_lease_path
from train.core.store import atomic_write_json, read_json, read_jsonl, sha256_file
from train.exchange.store import DiLoCoPaths
from train.launch.procs import supervised_argv

MARK = "EDT-JSON "


def answer(obj: dict, rc: int = 0) -> int:
    sys.stdout.write(MARK + json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()
    return rc


# -- process identity -------------------------------------------------------------------------------------------------
def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, start time in clock ticks since boot) of a live pid, from /proc (Linux)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[2]), int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st and st[1] == pgid and st[0] != "Z":
                out.append(int(d))
    return out


def state_of(rec: dict) -> str:
    """running / stopped / elsewhere (recorded on another host: this host cannot tell)."""
    if rec.get("hostname") != socket.gethostname() or rec.get("boot_id") != boot_id():
        return "elsewhere" if rec.get("hostname") != socket.gethostname() else "stopped"
    pgid = rec["pgid"]
    leader = _stat(pgid)
    if leader is not None and leader[2] != rec["proc_start"]:
        return "stopped"  # the pgid now names another process group: ours is gone
    return "running" if group_members(pgid) else "stopped"


# -- paths ------------------------------------------------------------------------------------------------------------
def record_path(paths: DiLoCoPaths, role: str) -> Path:
    return paths.root / "launch" / f"{role}.json"


def log_path(paths: DiLoCoPaths, role: str) -> Path:
    return paths.logs / f"{role}.log"


def records(paths: DiLoCoPaths, machine: str | None = None) -> dict[str, dict]:
    out = {}
    folder = paths.root / "launch"
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            rec = read_json(p)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and "pgid" in rec and (machine is None or rec.get("machine") == machine):
            out[p.stem] = rec
    return out


def tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024 * max(1, n // 200 + 1)))
            return f.read().decode(errors="replace").splitlines()[-n:] if n else []
    except OSError:
        return []


# -- commands ---------------------------------------------------------------------------------------------------------
def cmd_start(a, paths: DiLoCoPaths, cfg) -> int:
    role = a.role[0]
    restarts = a.max_restarts if a.max_restarts >= 0 else cfg.outer.max_restarts
    name = "the coordinator" if role == "coordinator" else role.replace("-", " ")
    argv = supervised_argv(sys.executable, a.argv, restarts, name) \
        if role.startswith("worker-") or role == "coordinator" else list(a.argv)
    rec_file, log_file = record_path(paths, role), log_path(paths, role)
    rec_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(rec_file.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two launchers at once: one starts, the other sees it running
        if rec_file.is_file():
            old = read_json(rec_file)
            st = state_of(old)
            if st == "running":
                return answer({**old, "state": "running", "reused": True})
            if st == "elsewhere":
                return answer({"state": "failed", "error": f"{role} is recorded as started on host "
                               f"{old.get('hostname')} (pid {old.get('pid')}): stop it there first"}, 1)
        with open(log_file, "ab") as logf:
            logf.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} launch_to_machines: {role} on "
                       f"{a.machine} ({socket.gethostname()}): {' '.join(a.argv)}\n".encode())
            logf.flush()
            try:
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                     start_new_session=True, close_fds=True)
            except OSError as e:
                return answer({"state": "failed", "error": f"cannot run {a.argv[0]!r}: {e}"}, 1)
        st = _stat(p.pid)
        rec = {"role": role, "machine": a.machine, "hostname": socket.gethostname(), "boot_id": boot_id(),
               "pid": p.pid, "pgid": p.pid, "proc_start": st[2] if st else None, "log": str(log_file),
               "command": a.argv, "cwd": os.getcwd(), "started": time.time(), "launcher_pid": os.getpid(),
               "max_restarts": restarts if argv != a.argv else 0}
        atomic_write_json(rec_file, rec)
    deadline = time.monotonic() + a.check
    while time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.1)
    if p.poll() is not None:
        rec.update(exited=time.time(), returncode=p.returncode)
        atomic_write_json(rec_file, rec)
        return answer({**rec, "state": "failed", "error": f"exited with status {p.returncode} right away",
                       "log_tail": tail(log_file, 15)}, 1)
    return answer({**rec, "state": "running", "reused": False})


def lease_of(paths: DiLoCoPaths, role: str) -> dict | None:
    """The role's lease (train/core/heartbeat.py): workers/wXXX/progress.json, coordinator/progress.json."""
    if role == "coordinator":
        f = coordinator_lease_path(paths.root)
    elif role.startswith("worker-") and role.split("-")[1].isdigit():
        f = paths.progress(int(role.split("-")[1]))
    else:
        return None
    try:
        rec = read_json(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def progress_of(paths: DiLoCoPaths, role: str) -> dict:
    p = lease_of(paths, role)
    if p is None:
        return {}
    out = {k: p[k] for k in ("status", "round", "generation", "step", "steps", "loss", "time", "beat", "pid", "error")
           if k in p}
    if p.get("last_status"):  # a final record: "left" / "exited" after what it was doing
        out["status"] = f"{p['status']} ({p['last_status']})"
    if p.get("host") == socket.gethostname() and p.get("boot_id") in (None, boot_id()) and \
            isinstance(p.get("time"), (int, float)):
        out["beat_age_s"] = round(max(0.0, time.time() - p["time"]), 1)  # this host's clock wrote it: comparable
    return out


def restarts_in_log(path: Path) -> int:
    """Restarts the supervisor logged since the role's last start (`=== ... launch_to_machines:` header)."""
    n = 0
    for ln in tail(path, 2000):
        if " launch_to_machines: " in ln and ln.startswith("=== "):
            n = 0
        elif "; restart " in ln and " in " in ln:
            n += 1
    return n


def health(rec: dict, paths: DiLoCoPaths, role: str, state: str) -> dict:
    """What `status` adds to running / stopped: the supervisor's state, its restarts, and how a process that
    nobody stopped ended (its lease's last record; a SIGKILL or a killed supervisor writes none)."""
    out: dict = {}
    supervised = bool(rec.get("max_restarts"))
    if supervised:
        out["restarts"] = restarts_in_log(Path(rec.get("log") or log_path(paths, role)))
    if state == "running":
        leader = _stat(rec["pid"])
        alive = leader is not None and leader[0] != "Z" and leader[2] == rec.get("proc_start")
        if supervised:
            out["supervisor"] = "alive" if alive else "gone"
        out["summary"] = "running" + (", supervisor gone (its child runs on alone; `launch` cannot restart it until it "
                                      "ends)" if supervised and not alive else "") + \
            (f", {out['restarts']} restart{'s' * (out['restarts'] != 1)}" if out.get("restarts") else "")
        return out
    if state != "stopped":
        return out
    if rec.get("stopped_by"):
        out["summary"] = f"stopped: {rec['stopped_by']} by `stop`"
        return out
    lease = lease_of(paths, role) or {}
    ended = lease.get("status") in ("exited", "left") and (lease.get("time") or 0) >= (rec.get("started") or 0)
    if ended and lease.get("error"):
        out["ended"] = f"failed: {lease['error']}"
    elif ended:
        out["ended"] = "left" if lease["status"] == "left" else \
            "exited (done)" if lease.get("last_status") == "done" else "exited"
    else:
        out["ended"] = "died (no final record: killed, or its supervisor was)" + \
            (f" after {out['restarts']} restarts" if out.get("restarts") else "")
    out["summary"] = f"stopped: {out['ended']}"
    return out


def run_totals(paths: DiLoCoPaths, cfg) -> dict:
    """The run's own length, {"rounds": R, "generations": G}: from its config.json in BASE_DIR (what its coordinator
    runs, the launch's --set overrides included) once written, else from `cfg` (the config this command was given,
    which may lack those overrides: `status` without the launch's `--set outer.rounds=4` would say 4/10)."""
    own = {}
    try:
        if sharedfs.exists(paths.config_json):
            own = read_json(paths.config_json)
    except (OSError, ValueError):  # unreadable: the given config's values (the status still answers)
        own = {}
    outer, edt = own.get("outer") or {}, own.get("edt") or {}
    return {"rounds": outer.get("rounds", cfg.outer.rounds),
            "generations": edt.get("max_generations", cfg.edt.max_generations)}


def cmd_status(a, paths: DiLoCoPaths, cfg) -> int:
    recs = records(paths)
    roles = list(dict.fromkeys(a.role + [r for r, rec in recs.items() if rec.get("machine") == a.machine]))
    out = []
    for role in roles:
        rec = recs.get(role)
        item = {"role": role, "state": "not started", "log_last": (tail(log_path(paths, role), 1) or [""])[0]}
        if rec:
            item.update({k: rec.get(k) for k in ("pid", "pgid", "hostname", "machine", "started", "log")})
            item["state"] = state_of(rec) if rec.get("machine") == a.machine else f"on {rec.get('machine')}"
            item.update(health(rec, paths, role, item["state"]))
        item["progress"] = progress_of(paths, role)
        out.append(item)
    metrics = read_jsonl(paths.metrics)
    last = metrics[-1] if metrics else {}
    from train.edt.store import EDTPaths

    gens = EDTPaths(paths.root).committed_generations()  # EDT's commit markers (none in a DiLoCo run)
    run = {"run_dir": objstore.url_of(paths.root), "committed": paths.latest_committed(), **run_totals(paths, cfg),
           "committed_generation": max(gens) if gens else None,
           "final": sharedfs.is_file(paths.final / "MANIFEST.json"),
           "last": {k: last[k] for k in ("round", "generation", "eval_loss", "train_loss") if k in last}}
    return answer({"processes": out, "run": run, "hostname": socket.gethostname()})


def cmd_stop(a, paths: DiLoCoPaths) -> int:
    recs = {r: rec for r, rec in records(paths, a.machine).items() if not a.role or r in a.role}
    live = {r: rec for r, rec in recs.items() if state_of(rec) == "running"}
    for rec in live.values():
        try:
            os.killpg(rec["pgid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    out = {r: "already stopped" if state_of(rec) == "stopped" else f"recorded on {rec.get('hostname')}: not here"
           for r, rec in recs.items() if r not in live}
    deadline = time.monotonic() + a.grace
    while time.monotonic() < deadline and any(group_members(rec["pgid"]) for rec in live.values()):
        time.sleep(0.1)
    for role, rec in live.items():
        how = "stopped (SIGTERM)"
        if group_members(rec["pgid"]):
            try:
                os.killpg(rec["pgid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            how = f"killed (SIGKILL after {a.grace:.0f}s)"
            end = time.monotonic() + 5
            while time.monotonic() < end and group_members(rec["pgid"]):
                time.sleep(0.05)
        rec.update(stopped=time.time(), stopped_by=how)
        atomic_write_json(record_path(paths, role), rec)
        out[role] = f"{how}, pid {rec['pid']}"
    return answer({"stopped": out})


class LogFollower:
    """The log files of several processes, by role: their last lines, then each new complete line as it is written
    (a file truncated or replaced is read again from its start). Used here on each machine and by the Slurm
    backend's `logs -f` (train/launch/slurm_ops.py)."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.pos = {r: 0 for r in files}
        self.buf = {r: b"" for r in files}

    def last(self, n: int) -> list[tuple[str, str]]:
        """(role, line) for the last n lines of each file; following starts after them."""
        out = []
        for role, f in self.files.items():
            out += [(role, ln) for ln in tail(f, n)]
            self.pos[role] = f.stat().st_size if f.is_file() else 0
        return out

    def new_lines(self) -> list[tuple[str, str]]:
        """(role, line) for each complete line written since the last call."""
        out = []
        for role, f in self.files.items():
            try:
                size = f.stat().st_size
            except OSError:
                continue
            if size < self.pos[role]:
                self.pos[role] = 0  # truncated / replaced
            if size > self.pos[role]:
                with open(f, "rb") as fh:
                    fh.seek(self.pos[role])
                    data = self.buf[role] + fh.read(size - self.pos[role])
                self.pos[role] = size
                *lines, self.buf[role] = data.split(b"\n")
                out += [(role, ln.decode(errors="replace")) for ln in lines]
        return out


def cmd_logs(a, paths: DiLoCoPaths) -> int:
    follower = LogFollower({r: log_path(paths, r) for r in a.role})
    for role, ln in follower.last(a.lines):
        print(f"{role}\t{ln}")
    sys.stdout.flush()
    if not a.follow:
        return 0
    end = time.monotonic() + a.for_s if a.for_s else None
    while end is None or time.monotonic() < end:
        for role, ln in follower.new_lines():
            print(f"{role}\t{ln}")
        sys.stdout.flush()
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the launcher closed the channel (Ctrl-C): stop following
    return 0


def code_fingerprint(root: Path) -> str:
    """sha256 over the project's Python sources (train/*.py and the top-level scripts): same code everywhere?"""
    h = hashlib.sha256()
    for p in sorted(list(root.glob("*.py")) + list((root / "train").rglob("*.py"))):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()[:16]


def cmd_preflight(a, paths: DiLoCoPaths, cfg) -> int:
    info: dict = {"hostname": socket.gethostname(), "python": sys.executable, "python_version": sys.version.split()[0],
                  "cwd": os.getcwd(), "config_sha256": sha256_file(a.config), "run_dir": str(paths.root),
                  "code": code_fingerprint(Path(__file__).resolve().parents[2])}
    for mod in ("torch", "transformers"):
        try:
            m = __import__(mod)
            info[mod] = m.__version__
        except Exception as e:  # report, don't crash: this is what preflight is for
            info[mod + "_error"] = f"{type(e).__name__}: {e}"
    if "torch" in info:
        import torch
        info["cuda_devices"] = torch.cuda.device_count()
    base = paths.root.parent
    token = a.write_token or a.read_token or a.remove_token
    store = objstore.store_for(base)
    # an object store: the token is an object (a dot name would stay in this machine's mirror)
    tfile = base / (f"edt-preflight-{token}.json" if store else f".edt-preflight-{token}.json")
    try:
        if store is not None:
            store.check()  # the bucket answers, takes this machine's credentials and conditional writes
        if a.write_token:
            atomic_write_json(tfile, {"token": token, "hostname": socket.gethostname()})
            info["token"] = "written"
        elif a.read_token:
            got = read_json(tfile) if sharedfs.is_file(tfile) else {}
            info["token"] = "seen" if got.get("token") == token else "missing"
        elif a.remove_token:
            sharedfs.unlink(tfile)
            info["token"] = "removed"
    except (OSError, UserError) as e:
        info["token"] = f"error: {e}"
    info["base_dir"] = objstore.url_of(base)
    return answer(info)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.launch.remote", description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("start", "status", "logs", "stop", "preflight"))
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--machine", default="")
    ap.add_argument("--role", action="append", default=[])
    ap.add_argument("--check", type=float, default=2.0)
    ap.add_argument("--max-restarts", type=int, default=-1, help="start: restarts of a worker (-1: the config's)")
    ap.add_argument("--grace", type=float, default=10.0)
    ap.add_argument("--lines", type=int, default=20)
    ap.add_argument("--follow", action="store_true")
    ap.add_argument("--for", dest="for_s", type=float, default=0.0)
    for t in ("write", "read", "remove"):
        ap.add_argument(f"--{t}-token", default="")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after `--`: the command to start, verbatim
    a = ap.parse_args(argv[:cut])
    a.argv = argv[cut + 1:]
    try:  # a user error is the answer (one line, exit 2): the launcher shows it under the host's name
        return run(a)
    except UserError as e:
        return answer({"error": str(e)}, 2)


def run(a: argparse.Namespace) -> int:
    cfg = load_config(a.config, a.set)
    paths = DiLoCoPaths(cfg.run_dir)
    if any(not r.replace("-", "").isalnum() for r in a.role):
        return answer({"error": f"bad role name in {a.role}"}, 2)
    if a.command == "start":
        if not a.argv or len(a.role) != 1:
            return answer({"error": "start needs one --role and the command after --"}, 2)
        return cmd_start(a, paths, cfg)
    if a.command == "status":
        return cmd_status(a, paths, cfg)
    if a.command == "stop":
        return cmd_stop(a, paths)
    if a.command == "logs":
        return cmd_logs(a, paths)
    return cmd_preflight(a, paths, cfg)


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "remote", logging.WARNING)  # stdout is the answer; warnings and a crash's one line on stderr
