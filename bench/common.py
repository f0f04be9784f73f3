"""Shared benchmark helpers: timing, page-cache control, results files."""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"


def overlap_sets(spec: str, H: int) -> list[str]:
    """The overrides of an overlap spec as the benches name it: RULE[@TAU], e.g. delayed, delayed@5, delayed@end
    (outer.overlap = RULE, outer.overlap_steps = TAU; end: the segment's end, i.e. H; no TAU: 0, adaptive)."""
    rule, _, tau = spec.partition("@")
    return [f"outer.overlap={rule or 'none'}", f"outer.overlap_steps={H if tau == 'end' else tau or 0}"]


def fold_steps(run_dir: Path) -> list[int]:
    """With delayed / eager overlap: after how many steps of its next segment each worker folded each committed
    round in (the `fold_step` of every delta sidecar of the run; H = at the segment's end)."""
    out = []
    for f in sorted(Path(run_dir).glob("rounds/r*/deltas/w*.json")):
        step = json.loads(f.read_text()).get("fold_step")
        if step is not None:
            out.append(int(step))
    return out


def fold_summary(steps: list[int], H: int) -> str:
    """'after 6 of 25 steps (median; 2-16)' for a list of fold steps, '-' without overlap."""
    if not steps:
        return "-"
    return f"after {statistics.median(steps):g} of {H} (median; {min(steps)}-{max(steps)})"


CODE_FILES = ("train/**/*.py", "diloco.py", "diloco_sim.py", "edt.py", "edt_sim.py", "configs/*.json",
              "data/tokenizer/*.json", "data/corpus/*.txt")


def code_fingerprint() -> str:
    """12 hex digits of sha256 over what decides a training run's numbers: the training code, the model configs,
    the tokenizer and the corpus (not the docs, the tests or the benches). Cached results carry it, so a change to
    the code never mixes old runs with new ones in one table."""
    h = hashlib.sha256()
    for f in sorted({f for pattern in CODE_FILES for f in REPO.glob(pattern) if f.is_file()}):
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def drop_caches() -> bool:
    """Drop the page cache (root only) so reads come from the disk; False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn, *a, **k) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return time.perf_counter() - t0, out


def median(xs):
    return statistics.median(xs)


def save_result(name: str, record: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def table(rows: list[list], header: list[str]) -> str:
    cols = list(zip(*([header] + [[str(c) for c in r] for r in rows])))
    widths = [max(len(c) for c in col) for col in cols]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*[str(c) for c in r]) for r in rows]
    return "\n".join(lines)


def smollm_config(small: bool):
    """A SmolLM2-135M-shaped LlamaConfig (538 MB in fp32); `small`: a quick check of a script itself."""
    from transformers import LlamaConfig
    if small:
        return LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5)
