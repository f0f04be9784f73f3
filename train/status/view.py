"""The status view of a run (`python -m train.status RUN_DIR`): what its files on BASE_DIR say now. Read-only: it
never writes or locks anything in the run folder, and learns that files exist from folder listings
(train/core/sharedfs.py), never from lookups of names another machine is about to create.

`gather(root)` -> a dict (what `--json` prints); `render(view)` -> the text. Rows: strategy, round / generation and
ETA; one row per worker (state, host, pid, age of its last beat, restarts, last delta's round, tok/s); the last
rounds' time-to-quorum, bytes and utilisation; missing or rejected deltas with their reasons; the coordinator's
state. A worker's state comes from its lease (workers/wXXX/progress.json): training, publishing (its steps are done,
its delta not yet in), waiting, joining, left, exited, or dead (its pid is gone on this host, or its beat is older
than outer.dead_after_s; `--watch` judges the beat from its changes on this machine's clock, as the coordinator
does: docs/elastic.md).
"""
from __future__ import annotations

import math
import socket
import statistics
import time
from pathlib import Path

from train.core import objstore, sharedfs
from train.core.errors import NotFound
from train.core.heartbeat import boot_id, pid_alive
from train.core.store import read_json, read_jsonl
from train.exchange.store import DiLoCoPaths
from train.status.timeline import build_timeline, live_deltas, log_tail, read_layout, read_progress, strategy_of

RECENT = 5  # rounds / generations in the table


class Liveness:
    """When each lease's (lease, beat) last changed, on this machine's monotonic clock (for --watch)."""

    def __init__(self):
        self.seen: dict[str, tuple[tuple, float]] = {}

    def silent_s(self, name: str, rec: dict, now: float) -> float | None:
        key = (rec.get("lease"), rec.get("beat"))
        old = self.seen.get(name)
        if old is None or old[0] != key:
            self.seen[name] = (key, now)
            return None if old is None else 0.0
        return now - old[1]


def check_run(root: Path) -> DiLoCoPaths:
    paths = DiLoCoPaths(root)
    if not sharedfs.exists(paths.run_json):
        raise NotFound(f"{root}: not a run folder (no run.json); pass BASE_DIR/<project_name> of a DiLoCo or EDT run")
    return paths


def _config(paths: DiLoCoPaths) -> dict:
    try:
        return read_json(paths.config_json) if sharedfs.exists(paths.config_json) else {}
    except (OSError, ValueError):
        return {}


def beat_age(rec: dict, now: float) -> float | None:
    t = rec.get("time")
    return round(max(0.0, now - float(t)), 1) if isinstance(t, (int, float)) else None


def judge(rec: dict, now: float, dead_after_s: float, silent: float | None = None) -> str | None:
    """'dead: why' when the lease's writer is gone without a final record, else None."""
    if not rec or rec.get("status") in ("exited", "left"):
        return None
    pid = rec.get("pid")
    if isinstance(pid, int) and rec.get("host") == socket.gethostname() and \
            (not rec.get("boot_id") or rec.get("boot_id") == boot_id()):
        if not pid_alive(pid, rec.get("proc_start")):
            return f"process {pid} gone on this host"
    if silent is not None:
        return f"no beat for {silent:.1f} s" if silent >= dead_after_s else None
    age = beat_age(rec, now)
    if age is not None and age >= dead_after_s:
        return f"last beat {age:.1f} s ago (dead_after_s = {dead_after_s:g})"
    return None


def worker_state(rec: dict, has_delta: bool) -> str:
    st = str(rec.get("status") or "")
    if st in ("training", "replaying"):
        if rec.get("steps") and rec.get("step") == rec.get("steps") and not has_delta:
            return "publishing"
        return "training"
    if st.startswith("waiting") or st == "idle":
        return "waiting"
    if st in ("joining", "left"):
        return st
    if st == "exited":
        return "exited" + (f" ({rec['error']})" if rec.get("error") else "")
    return st or "not started"


def restarts_of(paths: DiLoCoPaths, w: int) -> int:
    """Restarts its supervisor made (the `restart k/N` lines in the worker's log)."""
    return sum(1 for ln in log_tail(paths.worker_log(w)).splitlines() if "; restart " in ln and " exited with " in ln
               or "was killed by signal" in ln and "restarting" in ln)


def gather(root: str | Path, now: float | None = None, live: Liveness | None = None) -> dict:
    from train.core.store import base_path

    root = base_path(root)  # an s3:// URL: its local mirror (train/core/objstore.py)
    paths = check_run(root)
    now = time.time() if now is None else now
    mono = time.monotonic()
    cfg = _config(paths)
    outer, edt = cfg.get("outer") or {}, cfg.get("edt") or {}
    dead_after = float(outer.get("dead_after_s") or 10.0)
    strategy = strategy_of(root)
    metrics = read_jsonl(paths.metrics)
    key = "generation" if strategy == "edt" else "round"
    recs = {int(m[key]): m for m in metrics if key in m}
    total = int(edt.get("max_generations") or 0) if strategy == "edt" else int(outer.get("rounds") or 0)
    done = max(recs, default=None)
    if strategy == "edt":
        from train.status.timeline import _generations, gen_committed_time
        gens = [g for g in _generations(root) if gen_committed_time(root, g) is not None]
        committed = max(gens, default=None)
        done_n = (done + 1) if done is not None else 0
    else:
        committed = paths.latest_committed()
        done_n = committed or 0
    times = [float(recs[k]["time"]) for k in sorted(recs) if "time" in recs[k]]
    per = statistics.median([b - a for a, b in zip(times, times[1:])][-10:]) if len(times) > 2 else None
    eta = round(per * max(0, total - done_n), 1) if per is not None and total else None

    tl = build_timeline(root, now)
    # the coordinator
    crec = read_progress(root / "coordinator" / "progress.json")
    c_dead = judge(crec, now, dead_after, live.silent_s("coordinator", crec, mono) if live else None)
    kind = _run_kind(paths)
    if kind.get("kind") == "diloco_optimizer" and not crec:  # a user's own loop: its reducer worker steps
        c_dead = None
        crec = {"status": f"none (a DiLoCoOptimizer run: worker {kind.get('reducer', 0)} reduces)"}
    coordinator = {"state": ("dead" if c_dead else crec.get("status") or "not started"),
                   "doing": crec.get("last_status") if crec.get("status") == "exited" else crec.get("status"),
                   "round": crec.get("round", crec.get("generation")), "host": crec.get("host"),
                   "pid": crec.get("pid"), "beat_age_s": beat_age(crec, now), **({"why": c_dead} if c_dead else {})}

    # the workers
    layout = read_layout(root)
    n = max([s.get("slots", 0) for s in layout.get("segments", [])] +
            [int(outer.get("num_workers") or 0)] +
            [int(x[1:]) + 1 for x in sharedfs.names(root / "workers") if x.startswith("w") and x[1:].isdigit()])
    latest = committed or 0
    open_deltas = {int(d["worker"]): d for d in live_deltas(paths, [latest])} if strategy == "diloco" else {}
    workers = []
    for w in range(n):
        rec = read_progress(paths.progress(w))
        name = f"w{w:03d}"
        lane = next((ln for ln in tl.lanes if ln.name == name), None)
        dead = judge(rec, now, dead_after, live.silent_s(name, rec, mono) if live else None)
        state = "dead" if dead else worker_state(rec, w in open_deltas)
        last = _last_delta(paths, w, lane, strategy)
        workers.append({"worker": name, "state": state, "host": rec.get("host"), "pid": rec.get("pid"),
                        "beat_age_s": beat_age(rec, now), "restarts": restarts_of(paths, w),
                        "round": rec.get("round", rec.get("generation")), "step": rec.get("step"),
                        "steps": rec.get("steps"), "last_delta": last.get("round"), "tok_s": last.get("tok_s"),
                        **({"why": dead} if dead else {})})

    # the last rounds
    rows = []
    quorum = max(int(outer.get("min_workers") or 1), math.ceil(max(n, 1) / 2))
    batch = int((cfg.get("inner") or {}).get("total_batch_size") or 1)
    # (DiLoCo's round 0 is the initial model: nothing was exchanged, nothing to show)
    for k in [k for k in sorted(recs) if k > 0 or strategy != "diloco"][-RECENT:]:
        rec = recs[k]
        prev = recs.get(k - 1)
        row = {key: k, "seconds": round(float(rec["time"]) - float(prev["time"]), 2) if prev and "time" in rec and
               "time" in prev else None, "bytes": rec.get("bytes_total")}
        if strategy == "diloco" and k > 0:
            row["ttq_s"] = _time_to_quorum(tl, k - 1, prev, quorum)
            row["H"], row["idle"] = _steps_and_idle(tl, k, rec, prev, batch)
            row["deltas"] = len(rec.get("workers_used") or [])
            if "fragment" in rec:  # streaming DiLoCo: the fragment this commit synced (docs/streaming.md)
                row["fragment"] = rec["fragment"]
        row["utilisation"] = _round_utilisation(tl, k, strategy, recs)
        rows.append(row)

    problems = []
    for k in sorted(recs):
        rec = recs[k]
        for w, why in sorted((rec.get("missing_why") or {}).items()):
            problems.append({key: k - 1 if strategy == "diloco" else k, "worker": w, "kind": "missing", "why": why})
        for w, why in sorted((rec.get("rejected") or {}).items()):
            problems.append({key: k - 1 if strategy == "diloco" else k, "worker": w, "kind": "rejected", "why": why})
        for m, why in sorted((rec.get("refilled") or {}).items()):
            problems.append({key: k, "worker": m, "kind": "refilled", "why": why})
    return {"run": objstore.url_of(root), "strategy": strategy, "project": cfg.get("project_name") or root.name,
            "unit": key, "committed": committed, "total": total, "eta_s": eta,
            "finished": sharedfs.exists(paths.final / "MANIFEST.json") or sharedfs.exists(root / "DONE.json"),
            "coordinator": coordinator, "workers": workers, "recent": rows, "problems": problems[-10:],
            "time": now}


def _run_kind(paths) -> dict:
    """run.json's identity (`kind`: diloco_optimizer for a DiLoCoOptimizer run), {} if unreadable."""
    try:
        ident = read_json(paths.run_json).get("identity")
    except (OSError, ValueError, AttributeError):
        return {}
    return ident if isinstance(ident, dict) else {}


def _last_delta(paths: DiLoCoPaths, w: int, lane, strategy: str) -> dict:
    """The round of the worker's last published delta (EDT: generation of its last job) and its tok/s."""
    if strategy == "edt":
        segs = [s for s in (lane.segments if lane else []) if s.state == "compute" and s.label != "open"]
        return {"round": segs[-1].round} if segs else {}
    f = paths.worker_state(w)
    try:
        side = (read_json(f) if sharedfs.exists(f) else {}).get("sidecar") or {}
    except (OSError, ValueError):
        side = {}
    if "round" not in side:
        return {}
    secs = float(side.get("train_seconds") or 0.0)
    return {"round": side["round"], "tok_s": round(side.get("tokens", 0) / secs) if secs > 0 else None}


def _time_to_quorum(tl, r: int, prev: dict | None, quorum: int) -> float | None:
    """Seconds from the start of round r (the commit before it) until its quorum-th delta was published."""
    if not prev or "time" not in prev:
        return None
    start = float(prev["time"]) + float(prev.get("commit_s") or 0.0)
    pubs = sorted(max(s.end for s in ln.segments if s.round == r and s.state in ("compute", "publishing"))
                  for ln in tl.lanes if ln.name != "coordinator" and
                  any(s.round == r and s.state == "publishing" for s in ln.segments))
    return round(pubs[quorum - 1] - start, 2) if len(pubs) >= quorum else None


def _steps_and_idle(tl, k: int, rec: dict, prev: dict | None, batch: int) -> tuple[dict, dict]:
    """Each worker's inner steps in the round committed as k (from the windows it read) and its idle seconds: the
    round's wall time (commit to commit) less its compute time in the round."""
    steps: dict[str, int] = {}
    for key, v in sorted((rec.get("data") or {}).items()):  # wXXX, and wXXX+i: the windows it carried in
        if "@" not in key:
            steps[key[:4]] = steps.get(key[:4], 0) + int(v[1]) // max(1, batch)
    idle = {}
    if prev and "time" in prev and "time" in rec:
        wall = float(rec["time"]) - float(prev["time"])
        for ln in tl.lanes:
            if ln.name in steps:
                comp = sum(s.end - s.start for s in ln.segments if s.state == "compute" and s.round == k - 1)
                idle[ln.name] = round(max(0.0, wall - comp), 2)
    return steps, idle


def _round_utilisation(tl, k: int, strategy: str, recs: dict) -> float | None:
    """Compute time of the round's (generation's) segments over the workers x the round's wall time."""
    rnd = k - 1 if strategy == "diloco" else k
    lo = recs.get(k - 1, {}).get("time") if strategy == "diloco" else None
    hi = recs[k].get("time")
    lanes = [ln for ln in tl.lanes if ln.name != "coordinator"]
    comp = [sum(s.end - s.start for s in ln.segments if s.state == "compute" and s.round == rnd) for ln in lanes]
    if lo is None or hi is None or not lanes or hi <= lo:
        return None
    return round(sum(comp) / (len(lanes) * (float(hi) - float(lo))), 3)


# -- the text -------------------------------------------------------------------------------------------------------
def _fmt_s(x) -> str:
    return "-" if x is None else f"{x:.1f}s" if x < 600 else f"{x / 60:.0f}m"


def _table(head: tuple, rows: list[tuple]) -> list[str]:
    rows = [tuple("-" if c is None else str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]


def render(v: dict) -> str:
    unit = v["unit"]
    lines = [f"{v['project']} ({v['strategy']}) {v['run']}",
             f"{unit} {v['committed'] if v['committed'] is not None else '-'}"
             + (f"/{v['total']}" if v["total"] else "") + " committed"
             + (", finished" if v["finished"] else f", ETA {_fmt_s(v['eta_s'])}" if v["eta_s"] is not None else "")]
    c = v["coordinator"]
    lines.append(f"coordinator: {c['state']}" + (f" (was {c['doing']})" if c["state"] == "exited" and c.get("doing")
                                                  else "")
                 + (f" {unit} {c['round']}" if c.get("round") is not None else "")
                 + (f", pid {c['pid']} on {c['host']}" if c.get("pid") else "")
                 + (f", beat {_fmt_s(c['beat_age_s'])} ago" if c.get("beat_age_s") is not None else "")
                 + (f": {c['why']}" if c.get("why") else ""))
    lines.append("workers:")
    lines += _table(("worker", "state", "host", "pid", "beat", "restarts", unit, "last delta", "tok/s"),
                    [(w["worker"], w["state"] + (f" ({w['why']})" if w.get("why") else ""), w["host"], w["pid"],
                      _fmt_s(w["beat_age_s"]) if w["beat_age_s"] is not None else None, w["restarts"],
                      (f"{w['round']} ({w['step']}/{w['steps']})" if w.get("steps") else w["round"]),
                      w["last_delta"], w["tok_s"]) for w in v["workers"]])
    if v["recent"]:
        lines.append(f"last {unit}s:")
        frag = any("fragment" in r for r in v["recent"])
        head = (unit, *(("fragment",) if frag else ()), "seconds", "to quorum", "deltas", "MB", "utilisation",
                "H per worker", "idle s per worker") \
            if v["strategy"] == "diloco" else (unit, "seconds", "MB", "utilisation")
        rows = []
        for r in v["recent"]:
            mb = None if r.get("bytes") is None else f"{r['bytes'] / 1e6:.2f}"
            ut = None if r.get("utilisation") is None else f"{100 * r['utilisation']:.0f}%"
            hs = "/".join(str(h) for h in (r.get("H") or {}).values()) or None
            idle = "/".join(f"{x:.1f}" for x in (r.get("idle") or {}).values()) or None
            rows.append((r[unit], *((r.get("fragment"),) if frag else ()), r["seconds"], r.get("ttq_s"),
                         r.get("deltas"), mb, ut, hs, idle) if v["strategy"] == "diloco"
                        else (r[unit], r["seconds"], mb, ut))
        lines += _table(head, rows)
    if v["problems"]:
        lines.append("missing / rejected:")
        lines += [f"  {unit} {p[unit]} {p['worker']} {p['kind']}: {p['why']}" for p in v["problems"]]
    return "\n".join(lines)
