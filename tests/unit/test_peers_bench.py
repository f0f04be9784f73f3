"""bench/peers.py without torchft: it says so, and how to install the extra, in one line (exit 2), before any run."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent.parent / "bench"


def load_peers(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_peers", BENCH / "peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_missing_torchft_says_how_to_install(monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "torchft" or m.startswith("torchft.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` raises ImportError, as when not installed
    peers = load_peers(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["peers.py", "--quick"])
    assert peers.main() == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "torchft" in err and "pip install -c requirements/lock.txt -e '.[peers]'" in err
