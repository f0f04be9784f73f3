"""The DiLoCo side of the BASE_DIR protocol: round folders, deltas, the global model, the workers' snapshots.

Layout of one DiLoCo run (under BASE_DIR/<project_name>/, next to run.json, config.json, data/, logs/, workers/):

    rounds/r000003/deltas/w001.safetensors + .json   worker 1's delta of round 3 and its sidecar
    rounds/r000003/global/                           θ_3, an HF model folder with MANIFEST.json
    rounds/r000003/outer_state.safetensors           the outer momentum after round 3
    rounds/r000003/update.safetensors                with a codec: the encoded update θ_3 − θ_2
    rounds/r000003/COMMITTED                         the coordinator's marker: round 3 is in place
    workers/w001/opt-r000003.safetensors             worker 1's inner optimizer state (only it reads it)

Which process writes which file: docs/protocol.md. EDT's layout beside it: train/edt/store.py.
"""
from __future__ import annotations

from pathlib import Path

from train.core import sharedfs
from train.core.store import RunPaths


class DiLoCoPaths(RunPaths):
    """Paths of a DiLoCo run (RunPaths adds run.json, config.json, logs, data, workers)."""

    rounds = property(lambda self: self.root / "rounds")

    def round_dir(self, r: int) -> Path:
        return self.rounds / f"r{r:06d}"

    def global_dir(self, r: int) -> Path:
        return self.round_dir(r) / "global"

    def outer_state(self, r: int) -> Path:
        return self.round_dir(r) / "outer_state.safetensors"

    def committed(self, r: int) -> Path:
        return self.round_dir(r) / "COMMITTED"

    def update_file(self, r: int) -> Path:
        """The compressed outer update θ_r − θ_{r−1} (compressed exchange; docs/compression.md)."""
        return self.round_dir(r) / "update.safetensors"

    def is_checkpoint(self, r: int) -> bool:
        """Round r has a complete fp32 global model directory (every round without compression)."""
        return sharedfs.exists(self.global_dir(r) / "MANIFEST.json")

    def deltas_dir(self, r: int) -> Path:
        return self.round_dir(r) / "deltas"

    def delta_file(self, r: int, w: int) -> Path:
        return self.deltas_dir(r) / f"w{w:03d}.safetensors"

    def delta_meta(self, r: int, w: int) -> Path:
        return self.deltas_dir(r) / self.delta_meta_name(w)

    @staticmethod
    def delta_meta_name(w: int) -> str:
        """The sidecar's name in its deltas folder (a string: a poll matches N names to a listing)."""
        return f"w{w:03d}.json"

    def worker_opt(self, w: int, r: int) -> Path:
        return self.worker_dir(w) / f"opt-r{r:06d}.safetensors"

    def worker_pending_delta(self, w: int, r: int) -> Path:
        return self.worker_dir(w) / f"delta-r{r:06d}.safetensors"

    # -- committed state --------------------------------------------------------------------------------------------
    # Another machine makes these files: existence is read from folder listings, never from a lookup of a name
    # that may not exist yet (an NFS client caches "no such file" for up to a minute: train/core/sharedfs.py).
    def committed_rounds(self) -> list[int]:
        out = []
        for name in sharedfs.names(self.rounds):
            if name.startswith("r") and name[1:].isdigit() and sharedfs.is_file(self.committed(int(name[1:]))):
                out.append(int(name[1:]))
        return sorted(out)

    def is_committed(self, r: int) -> bool:
        return sharedfs.exists(self.committed(r))

    def latest_committed(self, hint: int | None = None) -> int | None:
        """The last committed round. `hint`: a round known to be committed; then only the rounds after it are
        looked at, not every round directory (rounds commit in order and are pruned oldest first)."""
        if hint is not None and self.is_committed(hint):
            r = hint
            while self.is_committed(r + 1):
                r += 1
            return r
        rs = self.committed_rounds()
        return rs[-1] if rs else None
