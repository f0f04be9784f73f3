"""The EDT side of the BASE_DIR protocol: generation folders, the job queue (claims, leases, re-queue), results.

Layout of one EDT run (under BASE_DIR/<project_name>/, next to run.json, config.json, data/, logs/, workers/):

    generations/g000002/jobs/m001/        the child made by crossover (HF model dir + MANIFEST.json),
                                          outer_momentum.safetensors and job.json (what to run, with which genes)
    generations/g000002/jobs/m001.claim   a worker's claim (created with O_CREAT|O_EXCL: exactly one worker wins);
                                          its mtime is the lease, renewed while the worker runs the job
    generations/g000002/jobs/m001.stale-1 a claim whose lease expired (renamed away: the job is queued again)
    generations/g000002/members/m001/     the mutated member: HF model dir, optimizer.safetensors, result.json and
                                          MANIFEST.json, published by one rename (create-once), + genome.json
                                          (written by the coordinator once the generation's fitness is known)
    generations/g000002/COMMITTED         the coordinator's marker: every job of generation 2 is in place
    lineage.jsonl                         every genome ever evaluated (survives cleanup), lineage.png, fitness.png
    DONE.json                             the run finished (workers exit)

Commit order: jobs/*/ (temp dir, manifest, rename) → COMMITTED. Workers only read committed generations; the
coordinator trusts a member only when its folder (published whole) has a MANIFEST.json. Every file of this layout is
written by train/edt/protocol.py; this module names the paths and reads committed state.
"""
from __future__ import annotations

from pathlib import Path

from train.core import sharedfs
from train.core.store import MANIFEST, RunPaths, read_json


class EDTPaths(RunPaths):
    """Paths of an EDT run (RunPaths adds run.json, config.json, logs, data, workers)."""

    generations = property(lambda self: self.root / "generations")
    lineage = property(lambda self: self.root / "lineage.jsonl")
    lineage_png = property(lambda self: self.root / "lineage.png")
    fitness_png = property(lambda self: self.root / "fitness.png")
    done = property(lambda self: self.root / "DONE.json")

    def gen_dir(self, g: int) -> Path:
        return self.generations / f"g{g:06d}"

    def gen_committed(self, g: int) -> Path:
        return self.gen_dir(g) / "COMMITTED"

    def jobs_dir(self, g: int) -> Path:
        return self.gen_dir(g) / "jobs"

    def job_dir(self, g: int, m: int) -> Path:
        return self.jobs_dir(g) / f"m{m:03d}"

    def member_job_dir(self, mid: str) -> Path:
        """The job folder of member id `mid` ('gGGGGGG/mMMM')."""
        return self.job_dir(*parse_member_id(mid))

    def job_json(self, g: int, m: int) -> Path:
        return self.job_dir(g, m) / "job.json"

    def claim(self, g: int, m: int) -> Path:
        return self.jobs_dir(g) / f"m{m:03d}.claim"

    def members_dir(self, g: int) -> Path:
        return self.gen_dir(g) / "members"

    def member_dir(self, g: int, m: int) -> Path:
        return self.members_dir(g) / f"m{m:03d}"

    def genome(self, g: int, m: int) -> Path:
        return self.member_dir(g, m) / "genome.json"

    def result(self, g: int, m: int) -> Path:
        return self.member_dir(g, m) / "result.json"

    def rel(self, p: Path) -> str:
        return str(Path(p).relative_to(self.root))

    # -- committed state --------------------------------------------------------------------------------------------
    def committed_generations(self) -> list[int]:
        # from listings, never a lookup of a name that may not exist yet (NFS lookup cache: train/core/sharedfs.py)
        return sorted(int(n[1:]) for n in sharedfs.names(self.generations)
                      if n.startswith("g") and n[1:].isdigit() and sharedfs.is_file(self.gen_committed(int(n[1:]))))

    def latest_generation(self) -> int | None:
        gs = self.committed_generations()
        return gs[-1] if gs else None

    def population(self, g: int) -> int:
        return int(read_json(self.gen_committed(g))["population"])

    def has_result(self, g: int, m: int) -> bool:
        return sharedfs.exists(self.member_dir(g, m) / MANIFEST)


def member_id(g: int, m: int) -> str:
    return f"g{g:06d}/m{m:03d}"


def parse_member_id(mid: str) -> tuple[int, int]:
    g, m = mid.split("/")
    return int(g[1:]), int(m[1:])
