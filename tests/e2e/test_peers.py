"""bench/peers.py end to end at its smallest: one torchft run and one EDT run of the same 2-worker job (real torchft
lighthouse, gloo replicas and diloco_sim processes), and the bench's last line. Skipped without torchft (the `peers`
extra). Same θ_0, windows, inner loop and outer step on both sides, so the final eval losses agree to float
summation order (torchft sums the pseudo-gradients over gloo, EDT's coordinator in its own order)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytest.importorskip("torchft")

LINE = re.compile(r"^peers: torchft (\d+\.\d+) s/round loss (\d+\.\d+); edt (\d+\.\d+) s/round loss (\d+\.\d+)$")


@pytest.mark.slow
@pytest.mark.timeout(900)
# the long tier (python -m pytest -m long; CI runs it): the torchft side-by-side bench (bench/peers.py), minutes of
# torchft start-ups
@pytest.mark.long
def test_two_rounds_same_loss_in_both(tmp_path):
    out = tmp_path / "peers.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "peers.py"), "--workers", "2", "--outer", "nesterov",
                        "--rounds", "3", "--local-steps", "2", "--eval-batches", "1", "--no-fault",
                        "--results", str(out)], cwd=REPO, capture_output=True, text=True, timeout=880)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    m = LINE.match(p.stdout.strip().splitlines()[-1])
    assert m, p.stdout[-2000:]
    loss_t, loss_e = float(m[2]), float(m[4])
    assert abs(loss_t - loss_e) <= 1e-3 * loss_e
    res = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert res["torchft"]["participants"] == {"1": 2, "2": 2, "3": 2}  # every round had both replicas
    assert res["edt"]["participants"] == {"1": 2, "2": 2, "3": 2}
