"""bench/utilisation.py's arithmetic on sidecars written the way workers write them (the bench itself is a
benchmark, not a test): busy / wall, idle per round, and the shared link's load per round against the compute."""
from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import utilisation  # noqa: E402


def test_measure_reads_busy_wall_idle_and_the_links_bytes_per_round(tmp_path):
    # 2 workers, 3 rounds: each segment trains 2 s, then 1 s between segments; a round reads 1 MB and writes 3 MB
    # per worker (θ; delta + state snapshot), the coordinator moves 5 MB (metrics.jsonl; round 1 reads more)
    for w in range(2):
        for r in range(3):
            d = tmp_path / "rounds" / f"r{r:06d}" / "deltas"
            d.mkdir(parents=True, exist_ok=True)
            end = 100.0 + 3.0 * r + 2.0
            (d / f"w{w:03d}.json").write_text(json.dumps({
                "train_seconds": 2.0, "trained_at": end, "time": end + 0.5, "load_seconds": 0.25 if r else 0.0,
                "handoff_seconds": 0.0, "io": {"read": 1_000_000, "written": 3_000_000}}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"round": 0}, {"round": 1, "bytes_read": 9_000_000, "bytes_written": 1_000_000},
        {"round": 2, "bytes_read": 4_000_000, "bytes_written": 1_000_000},
        {"round": 3, "bytes_read": 4_000_000, "bytes_written": 1_000_000})) + "\n")
    m = utilisation.measure(tmp_path, workers=2, rounds=3)
    assert abs(m["utilisation"] - 6.0 / 8.0) < 1e-9  # 3 segments of 2 s in 8 s, first step to last step's end
    assert abs(m["idle_per_round_s"] - 1.0) < 1e-9 and abs(m["load_per_round_s"] - 0.25) < 1e-9
    assert abs(m["busy_per_round_s"] - 2.0) < 1e-9
    assert m["link_bytes_per_round"] == 2 * 4_000_000 + 5_000_000  # round 1 (data, θ_0) left out
