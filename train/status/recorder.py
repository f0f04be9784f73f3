"""What a coordinator calls as each round / generation closes: keep the workers' timings (timeline.jsonl) and redraw
timeline.png in the background.

The sidecars (DiLoCo) and results (EDT) that hold when each worker trained and published are pruned with their
rounds (outer.keep_rounds), so the coordinator, their one reader, appends the fields the timeline needs to
timeline.jsonl right after the commit and before the pruning (a few small JSON reads; one append). Drawing runs on
a daemon thread at most every MIN_INTERVAL_S seconds (longer when drawing is slow: at most ~10% of one core), so a
round never waits for matplotlib; `close()` draws the final picture. Only with `logging.plot`; the journal always.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from train.core import sharedfs
from train.core.store import append_jsonl, read_json
from train.exchange.store import DiLoCoPaths
from train.status.timeline import (DELTA_FIELDS, JOURNAL, PICTURE, build_timeline, gen_committed_time, live_results,
                                   read_journal)

log = logging.getLogger("timeline")

MIN_INTERVAL_S = 5.0


class TimelineRecorder:
    def __init__(self, root: str | Path, draw: bool = True, title: str = "",
                 min_interval_s: float = MIN_INTERVAL_S):
        self.root, self.draw_png, self.title = Path(root), draw, title
        self.min_interval_s = min_interval_s
        self._seen: set[tuple[int, int]] | None = None  # (round or generation, worker or member) in the journal
        self._want = threading.Event()
        self._stop = threading.Event()
        self._drawing = threading.Lock()
        self._thread: threading.Thread | None = None
        self._cost = 0.0

    def _journal_keys(self) -> set[tuple[int, int]]:
        if self._seen is None:
            self._seen = set()
            for line in read_journal(self.root):
                self._seen |= {(int(d["round"]), int(d["worker"])) for d in line.get("deltas", [])}
                self._seen |= {(int(j["generation"]), int(j["member"])) for j in line.get("jobs", [])}
        return self._seen

    # -- DiLoCo: round r closed (θ_{r+1} committed); call before rounds are pruned ------------------------------------
    def round_closed(self, r: int, known: dict[tuple[int, int], dict] | None = None) -> None:
        """`known`: sidecars the caller has read already, by (round, worker) (the coordinator's accepted and late
        deltas): not read again (at 256 workers, 256 opens a round less); the others in the two deltas folders
        (rejected, or published after the round closed) are read here."""
        known = known or {}
        try:
            paths, seen = DiLoCoPaths(self.root), self._journal_keys()
            deltas = []
            for q in (r - 1, r):  # r - 1: a late delta published after its round closed
                d = paths.deltas_dir(q)
                for name in sharedfs.names(d) if q >= 0 else []:
                    if not (name.startswith("w") and name.endswith(".json") and name[1:-5].isdigit()):
                        continue
                    if (q, int(name[1:-5])) in seen:
                        continue
                    meta = known.get((q, int(name[1:-5]))) or read_json(d / name)
                    deltas.append({k: meta[k] for k in DELTA_FIELDS if k in meta})
            if deltas:
                append_jsonl(self.root / JOURNAL, {"round": r, "closed": time.time(), "deltas": deltas})
                seen |= {(int(x["round"]), int(x["worker"])) for x in deltas}
        except (OSError, ValueError, KeyError) as e:  # the picture is not worth stopping a run for: say it, go on
            log.warning("timeline: round %d not recorded (%s)", r, e)
        self.request()

    # -- EDT: generation g evaluated (call before its members are pruned) ---------------------------------------------
    def generation_closed(self, g: int) -> None:
        try:
            seen = self._journal_keys()
            committed = gen_committed_time(self.root, g)
            jobs = [j for j in live_results(self.root, g) if (g, int(j["member"])) not in seen]
            append_jsonl(self.root / JOURNAL, {"generation": g, "closed": time.time(), "committed": committed,
                                               "jobs": jobs})
            seen |= {(g, int(j["member"])) for j in jobs}
        except (OSError, ValueError, KeyError) as e:
            log.warning("timeline: generation %d not recorded (%s)", g, e)
        self.request()

    # -- drawing --------------------------------------------------------------------------------------------------
    def request(self) -> None:
        """Redraw soon (on the background thread, throttled)."""
        if not self.draw_png:
            return
        self._want.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="timeline", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            self._want.wait(0.5)
            if not self._want.is_set():
                continue
            wait = max(self.min_interval_s, 10 * self._cost) - (time.monotonic() - last)
            if wait > 0:
                self._stop.wait(wait)
                if self._stop.is_set():
                    return
            self._want.clear()
            last = time.monotonic()
            self.draw()

    def draw(self) -> None:
        with self._drawing:
            t = time.perf_counter()
            try:
                from train.status.draw import draw_timeline
                draw_timeline(build_timeline(self.root), self.root / PICTURE, title=self.title)
            except Exception as e:  # noqa: BLE001  (a drawing bug must not stop a run: said once per failure)
                log.warning("timeline.png not drawn: %s: %s", type(e).__name__, e)
            self._cost = time.perf_counter() - t

    def close(self) -> None:
        """Stop the background thread and draw the final picture (the end of a run)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.draw_png:
            self.draw()
