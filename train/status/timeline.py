"""The data behind timeline.png (no matplotlib here: tests assert on it): lanes, segments and marks of a run, read
from its folder on BASE_DIR only.

One lane per worker and one for the coordinator; time on the x axis (wall clock, seconds since the run's first
event). A worker's segments per round (DiLoCo), from its delta's sidecar (trained_at, train_seconds, time):

    compute     its H inner steps: [trained_at - train_seconds, trained_at]
    publishing  writing its delta and sidecar: [trained_at, time]  (with overlap it runs beside the next segment:
                `sub` segments are drawn in the lower half of the lane)
    waiting     published, waiting for the round to close (the outer step): [time, the round's commit]
    idle        the rest until its next segment starts: loading θ, polling, starting up
    restarting  between two segments of different processes (its lease changed: it died and was restarted)

EDT: a job's mutation (compute, labelled g/m) on the lane of the worker that published it. The coordinator's lane:
collecting, reducing, committing, evaluating (DiLoCo, from the round records) or collecting and breeding (EDT).

Marks: death (a supervisor's "exited with signal 9" line in the worker's log, or a round that closed without it
because it was dead or gone), restart, join (the data layout), late (a straggler left behind, a late delta folded
in), left. Sidecars and results are pruned with their rounds, so the coordinator's recorder
(train/status/recorder.py) appends them to timeline.jsonl as each round closes; the open round is read live.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from train.core import sharedfs
from train.core.store import read_json, read_jsonl
from train.exchange.store import DiLoCoPaths

JOURNAL = "timeline.jsonl"
PICTURE = "timeline.png"
# the fields of a delta's sidecar (DiLoCo) or a member's result.json (EDT) the timeline keeps
DELTA_FIELDS = ("round", "worker", "lease", "host", "trained_at", "train_seconds", "load_seconds", "handoff_seconds",
                "time", "bytes", "io", "tokens", "inner_steps", "fold_step", "planned_steps", "lr")
RESULT_FIELDS = ("generation", "member", "worker", "host", "attempt", "time", "train_seconds", "eval_seconds",
                 "tokens", "bytes_read", "bytes_written", "refilled")
# supervisor lines (train/launch/procs.py): "<date> <time> ... worker 1 exited with signal 9; restart 1/3 in 1.0 s"
_SUPERVISOR = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\b.*?\b(exited with (?:signal|status) \d+|was killed by "
                         r"signal \d+)(?:; restart (\d+)/(\d+) in ([\d.]+) s)?")
LOG_TAIL_BYTES = 1 << 20  # the end of a worker's log that is searched for supervisor lines


@dataclass
class Segment:
    start: float
    end: float
    state: str            # compute, publishing, waiting, idle, restarting; coordinator: collecting, reducing, ...
    round: int | None = None
    label: str = ""
    sub: bool = False     # drawn in the lower half of the lane (runs beside another segment)


@dataclass
class Mark:
    t: float
    kind: str             # death, restart, join, late, left
    text: str = ""
    round: int | None = None


@dataclass
class Lane:
    name: str             # "w000", ..., "coordinator"
    segments: list[Segment] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    def state_seconds(self, state: str) -> float:
        return sum(s.end - s.start for s in self.segments if s.state == state and not s.sub)


@dataclass
class Timeline:
    strategy: str                                  # "diloco" or "edt"
    lanes: list[Lane]
    boundaries: list[tuple[int, float]]            # (round / generation committed, when)
    bytes: list[tuple[int, int]]                   # (round / generation, bytes that crossed BASE_DIR)
    utilisation: dict[str, float]                  # worker lane -> compute time / its span
    t0: float = 0.0
    t1: float = 0.0
    fragments: dict[int, int] = field(default_factory=dict)  # streaming DiLoCo: round committed -> fragment synced

    def lane(self, name: str) -> Lane:
        return next(ln for ln in self.lanes if ln.name == name)

    def to_json(self) -> dict:
        return asdict(self)


# -- reading the run folder -----------------------------------------------------------------------------------------
def strategy_of(root: Path) -> str:
    """'edt' for a run with generations (EDT, EvoMerge), else 'diloco'."""
    return "edt" if sharedfs.exists(Path(root) / "generations") else "diloco"


def read_journal(root: Path) -> list[dict]:
    return read_jsonl(Path(root) / JOURNAL)


def read_layout(root: Path) -> dict:
    f = Path(root) / "data" / "layout.json"
    try:
        return read_json(f) if sharedfs.exists(f) else {}
    except (OSError, ValueError):
        return {}


def read_progress(path: Path) -> dict:
    try:
        rec = read_json(path) if sharedfs.exists(path) else None
    except (OSError, ValueError):
        rec = None
    return rec if isinstance(rec, dict) else {}


def log_tail(path: Path, nbytes: int = LOG_TAIL_BYTES) -> str:
    """The last `nbytes` of a log on BASE_DIR ('' if there is none). On an object store: this machine's copy when it
    writes that log (a copy at most one upload older than the bucket's), else the tail its writer put in the bucket
    (train/core/logship.py)."""
    import os

    from train.core import logship, objstore

    if (store := objstore.store_for(path)) is not None:
        try:
            local = os.stat(path).st_mtime
        except OSError:
            local = None
        try:
            remote = store.stat(path).st_mtime  # one HEAD, no retry loop: a view must not hang on the bucket
        except Exception:  # noqa: BLE001  (no copy in the bucket, or the bucket away: this machine's, if any)
            remote = None
        try:
            if local is not None and (remote is None or local >= remote - logship.SHIP_EVERY_S - 5):
                with open(path, "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - nbytes))
                    return f.read().decode("utf-8", "replace")
            return store.read_bytes(path)[-nbytes:].decode("utf-8", "replace") if remote is not None else ""
        except Exception:  # noqa: BLE001
            return ""
    if not sharedfs.exists(path):
        return ""
    fd = sharedfs.open_fd(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return sharedfs.pread(fd, nbytes, max(0, size - nbytes), path).decode("utf-8", "replace")
    finally:
        os.close(fd)


def supervisor_events(log_text: str) -> list[Mark]:
    """Deaths and restarts the supervisor wrote into a process's log (local time of the host that wrote them)."""
    out = []
    for line in log_text.splitlines():
        m = _SUPERVISOR.match(line)
        if not m:
            continue
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
        out.append(Mark(t, "death", m.group(2)))
        if m.group(3):
            out.append(Mark(t + float(m.group(5)), "restart", f"restart {m.group(3)}/{m.group(4)}"))
    return out


def live_deltas(paths: DiLoCoPaths, rounds: list[int]) -> list[dict]:
    """Sidecars of the given rounds that are on disk now (the rounds not yet in the journal)."""
    out = []
    for r in rounds:
        d = paths.deltas_dir(r)
        for name in sharedfs.names(d):
            if name.startswith("w") and name.endswith(".json") and name[1:-5].isdigit():
                try:
                    meta = read_json(d / name)
                except (OSError, ValueError):
                    continue
                out.append({k: meta[k] for k in DELTA_FIELDS if k in meta})
    return out


# -- the timeline ---------------------------------------------------------------------------------------------------
def build_timeline(root: str | Path, now: float | None = None) -> Timeline:
    """The timeline of the run in `root` as its files on BASE_DIR say now."""
    root = Path(root)
    now = time.time() if now is None else now
    if strategy_of(root) == "edt":
        return _edt_timeline(root, now)
    return _diloco_timeline(root, now)


def _close_times(metrics: list[dict], key: str) -> dict[int, float]:
    return {int(m[key]): float(m["time"]) for m in metrics if key in m and "time" in m}


def _diloco_timeline(root: Path, now: float) -> Timeline:
    paths = DiLoCoPaths(root)
    metrics = read_jsonl(paths.metrics)
    recs = {int(m["round"]): m for m in metrics if "round" in m}
    closes = _close_times(metrics, "round")     # θ_k committed at closes[k]: delta round k - 1 closed
    journal = read_journal(root)
    deltas: dict[tuple[int, int], dict] = {}
    for line in journal:
        for d in line.get("deltas", []):
            deltas[(int(d["round"]), int(d["worker"]))] = d
    done = {r for r, _ in deltas}
    latest = max(closes, default=0)
    for d in live_deltas(paths, [r for r in range(max(0, latest - 1), latest + 2) if r not in done]):
        deltas.setdefault((int(d["round"]), int(d["worker"])), d)
    layout = read_layout(root)
    slots = max([s.get("slots", 0) for s in layout.get("segments", [])] + [w + 1 for _, w in deltas] + [0])
    lanes = []
    util: dict[str, float] = {}
    for w in range(slots):
        name = f"w{w:03d}"
        lane = Lane(name)
        mine = sorted((d for (r, ww), d in deltas.items() if ww == w), key=lambda d: d["round"])
        _worker_segments(lane, mine, closes)
        _worker_marks(lane, paths, w, recs, layout, closes)
        _open_segment(lane, read_progress(paths.progress(w)), now, closes)
        lanes.append(lane)
        span = _span(lane)
        if span > 0:
            util[name] = lane.state_seconds("compute") / span
    lanes.append(_coordinator_lane(recs))
    boundaries = sorted(closes.items())
    nbytes = [(k, int(recs[k].get("bytes_total", 0))) for k in sorted(recs) if k > 0]
    frags = {k: int(recs[k]["fragment"]) for k in sorted(recs) if "fragment" in recs[k]}
    return _finish(Timeline("diloco", lanes, boundaries, nbytes, util, fragments=frags), now)


def _worker_segments(lane: Lane, mine: list[dict], closes: dict[int, float]) -> None:
    """compute / publishing / waiting / idle / restarting from the worker's sidecars, in round order."""
    prev = None
    for d in mine:
        r = int(d["round"])
        end = float(d.get("trained_at") or d["time"])
        start = end - float(d.get("train_seconds") or 0.0)
        pub_end = max(end, float(d["time"]))
        if prev is not None:
            p_end = prev["_pub_end"]
            gap0 = max(prev["_end"], p_end) if p_end <= start else prev["_end"]
            if prev.get("lease") and d.get("lease") and prev["lease"] != d["lease"]:
                lane.segments.append(Segment(gap0, start, "restarting", r))
            elif gap0 < start:
                close = closes.get(int(prev["round"]) + 1, start)
                mid = min(max(close, gap0), start)
                if mid > gap0:
                    lane.segments.append(Segment(gap0, mid, "waiting", int(prev["round"])))
                if start > mid:
                    lane.segments.append(Segment(mid, start, "idle", r))
        # rounds by time: each worker's own H, written on its compute bar
        label = f"H{d['inner_steps']}" if d.get("planned_steps") is not None else f"r{r}"
        lane.segments.append(Segment(start, end, "compute", r, label))
        nxt = next((x for x in mine if int(x["round"]) == r + 1), None)
        overlapped = nxt is not None and float(nxt.get("trained_at") or nxt["time"]) - \
            float(nxt.get("train_seconds") or 0.0) < pub_end
        if pub_end > end:
            lane.segments.append(Segment(end, pub_end, "publishing", r, sub=overlapped))
        d = dict(d, _end=end, _pub_end=pub_end)
        prev = d
    if prev is not None:  # the last delta: waiting for its round to close, if it has
        close = closes.get(int(prev["round"]) + 1)
        if close is not None and close > prev["_pub_end"]:
            lane.segments.append(Segment(prev["_pub_end"], close, "waiting", int(prev["round"])))


def _worker_marks(lane: Lane, paths: DiLoCoPaths, w: int, recs: dict[int, dict], layout: dict,
                  closes: dict[int, float]) -> None:
    name = lane.name
    lane.marks += supervisor_events(log_tail(paths.worker_log(w)))
    for k, rec in sorted(recs.items()):
        why = (rec.get("missing_why") or {}).get(name)
        t = closes.get(k)
        if why and t is not None:
            kind = ("late" if why.startswith("straggler") else "left" if "status left" in why else
                    "death" if why.startswith(("dead", "process", "never started", "exited")) else "missed")
            if kind == "death" and any(m.kind == "death" and m.t <= t for m in lane.marks if m.round is None):
                kind = "missed"  # the log already marks the death itself
            lane.marks.append(Mark(t, kind, f"round {k - 1} closed without it: {why}", k - 1))
        late = (rec.get("late") or {}).get(name)
        if late and t is not None:
            lane.marks.append(Mark(t, "late", f"its late delta of round {late['round']} folded into round {k - 1} "
                                              f"(weight {late['weight']:g})", k - 1))
        rej = (rec.get("rejected") or {}).get(name)
        if rej and t is not None:
            lane.marks.append(Mark(t, "rejected", f"round {k - 1}: rejected: {rej}", k - 1))
    for seg in layout.get("segments", [])[1:]:
        why = str(seg.get("why", ""))
        m = re.match(r"join: worker\(s\) \[([\d, ]+)\]", why)
        if m and w in [int(x) for x in m.group(1).split(",")]:
            fr = int(seg.get("from_round", 0))
            t = closes.get(fr, closes.get(fr - 1))
            if t is not None:
                lane.marks.append(Mark(t, "join", f"joins at round {fr}", fr))
    pr = read_progress(paths.progress(w))
    if pr.get("status") == "left" and pr.get("time"):
        lane.marks.append(Mark(float(pr["time"]), "left", "left the run (SIGTERM)", pr.get("round")))
    lane.marks.sort(key=lambda m: m.t)


def _open_segment(lane: Lane, pr: dict, now: float, closes: dict[int, float]) -> None:
    """The live part: what the worker's lease says it does now, since its last segment ended."""
    st = str(pr.get("status") or "")
    if st in ("exited", "left", "") or not pr.get("time"):
        return
    since = max([s.end for s in lane.segments] + [closes[max(closes)] if closes else now])
    if now - float(pr["time"]) > 30 or since >= now:  # a stale record says nothing about now
        return
    state = "compute" if st in ("training", "replaying") else "waiting" if st.startswith("waiting") else "idle"
    lane.segments.append(Segment(since, now, state, pr.get("round"), "open"))


def _coordinator_lane(recs: dict[int, dict]) -> Lane:
    lane = Lane("coordinator")
    for k in sorted(recs):
        if k == 0 or k - 1 not in recs:
            continue
        prev, rec = recs[k - 1], recs[k]
        t0 = float(prev["time"]) + float(prev.get("commit_s") or 0.0)
        t_rec = float(rec["time"])
        # the record is made right after the outer step: collecting (until the round closed) ran until reduce_s
        # before it (wait_s only reaches the last arrival; a straggler deadline is waited after it)
        collect_end = max(t0, t_rec - float(rec.get("reduce_s") or 0.0))
        lane.segments.append(Segment(t0, collect_end, "collecting", k - 1))
        if t_rec > collect_end:
            lane.segments.append(Segment(collect_end, t_rec, "reducing", k - 1))
        c_end = t_rec + float(rec.get("commit_s") or 0.0)
        lane.segments.append(Segment(t_rec, c_end, "committing", k - 1))
        if rec.get("eval_s"):
            lane.segments.append(Segment(c_end, c_end + float(rec["eval_s"]), "evaluating", k, sub=True))
    return lane


def _edt_timeline(root: Path, now: float) -> Timeline:
    paths = DiLoCoPaths(root)
    metrics = read_jsonl(paths.metrics)
    recs = {int(m["generation"]): m for m in metrics if "generation" in m}
    jobs: dict[tuple[int, int], dict] = {}
    closes: dict[int, float] = {}
    for line in read_journal(root):
        if "generation" in line:
            closes[int(line["generation"])] = float(line.get("committed") or line["closed"])
        for j in line.get("jobs", []):
            jobs[(int(j["generation"]), int(j["member"]))] = j
    for g in _generations(root):
        closes.setdefault(g, gen_committed_time(root, g))
        if g not in {gg for gg, _ in jobs}:
            for j in live_results(root, g):
                jobs.setdefault((int(j["generation"]), int(j["member"])), j)
    closes = {g: t for g, t in closes.items() if t is not None}
    workers = sorted({int(j["worker"]) for j in jobs.values() if j.get("worker") is not None})
    n = max(workers + [len(_worker_dirs(root)) - 1, -1]) + 1
    lanes, util = [], {}
    for w in range(n):
        lane = Lane(f"w{w:03d}")
        mine = sorted((j for j in jobs.values() if j.get("worker") == w), key=lambda j: float(j["time"]))
        prev_end = None
        for j in mine:
            end = float(j["time"])
            start = end - float(j.get("train_seconds") or 0.0) - float(j.get("eval_seconds") or 0.0)
            if prev_end is not None and start > prev_end:
                lane.segments.append(Segment(prev_end, start, "idle", int(j["generation"])))
            lane.segments.append(Segment(start, end, "compute", int(j["generation"]),
                                         f"g{j['generation']}/m{int(j['member']):03d}"))
            prev_end = end
        lane.marks += supervisor_events(log_tail(paths.worker_log(w)))
        _open_segment(lane, read_progress(paths.progress(w)), now, {})
        lane.marks.sort(key=lambda m: m.t)
        lanes.append(lane)
        span = _span(lane)
        if span > 0:
            util[lane.name] = lane.state_seconds("compute") / span
    coord = Lane("coordinator")
    for g in sorted(closes):
        rec = recs.get(g)
        if rec is None or "time" not in rec:
            continue
        coord.segments.append(Segment(closes[g], float(rec["time"]), "collecting", g, f"g{g}"))
        if g + 1 in closes and closes[g + 1] > float(rec["time"]):
            coord.segments.append(Segment(float(rec["time"]), closes[g + 1], "breeding", g + 1))
    for g, rec in sorted(recs.items()):  # a slot refilled by selection: its job was abandoned (docs/elastic.md)
        for m, why in (rec.get("refilled") or {}).items():
            coord.marks.append(Mark(float(rec.get("time") or now), "refilled", f"g{g}/{m} refilled: {why}", g))
    lanes.append(coord)
    nbytes = [(g, int(recs[g].get("bytes_total", 0))) for g in sorted(recs)]
    return _finish(Timeline("edt", lanes, sorted(closes.items()), nbytes, util), now)


def _generations(root: Path) -> list[int]:
    gens = Path(root) / "generations"
    return sorted(int(n[1:]) for n in sharedfs.names(gens) if n.startswith("g") and n[1:].isdigit())


def gen_committed_time(root: Path, g: int) -> float | None:
    f = Path(root) / "generations" / f"g{g:06d}" / "COMMITTED"
    try:
        return float(read_json(f)["time"]) if sharedfs.exists(f) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _worker_dirs(root: Path) -> list[str]:
    return [n for n in sharedfs.names(Path(root) / "workers") if n.startswith("w") and n[1:].isdigit()]


def live_results(root: Path, g: int) -> list[dict]:
    """result.json of every member of generation g on disk now (EDT)."""
    members = Path(root) / "generations" / f"g{g:06d}" / "members"
    out = []
    for name in sharedfs.names(members):
        f = members / name / "result.json"
        if not (name.startswith("m") and name[1:].isdigit()) or not sharedfs.exists(f):
            continue
        try:
            res = read_json(f)
        except (OSError, ValueError):
            continue
        if "time" in res:
            out.append({"member": int(name[1:]), "generation": g, **{k: res[k] for k in RESULT_FIELDS if k in res}})
    return out


def _span(lane: Lane) -> float:
    main = [s for s in lane.segments if not s.sub]
    return (max(s.end for s in main) - min(s.start for s in main)) if main else 0.0


def _finish(tl: Timeline, now: float) -> Timeline:
    ts = [t for ln in tl.lanes for s in ln.segments for t in (s.start, s.end)] + \
         [m.t for ln in tl.lanes for m in ln.marks] + [t for _, t in tl.boundaries]
    tl.t0, tl.t1 = (min(ts), max(ts)) if ts else (now, now)
    return tl


def dumps(tl: Timeline) -> str:
    return json.dumps(tl.to_json(), sort_keys=True)
