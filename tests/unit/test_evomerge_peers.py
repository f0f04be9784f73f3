"""bench/evomerge_peers.py's pure parts: the curves it reads from each tool, the lm-eval task and genome YAMLs it
writes, the vllm placeholder of its mergekit-evolve environment, and its one-line refusals (no run of either tool)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

BENCH = Path(__file__).resolve().parent.parent.parent / "bench"


@pytest.fixture
def peers(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_evomerge_peers", BENCH / "evomerge_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MK_OUT = """Resharding models: 100%
Received 4 genotypes
New best score: 0.8500
Merge configuration:
merge_method: ties
Received 4 genotypes
Received 4 genotypes
New best score: 1.2000
!!! OPTIMIZATION COMPLETE !!!
Best cost: -1.2000
"""


def test_mergekit_curve_counts_generations_and_keeps_the_best(peers):
    assert peers.mergekit_curve(MK_OUT) == [(4, 0.85), (8, 0.85), (12, 1.2)]
    assert peers.mergekit_curve(MK_OUT.replace("Best cost: -1.2000", "Best cost: -1.3000"))[-1] == (12, 1.3)
    assert peers.mergekit_curve("no evaluations here") == []


def test_edt_curve_counts_every_evaluated_member(peers):
    lineage = [{"generation": 0, "fitness": 0.9}, {"generation": 0, "fitness": 0.5},
               {"generation": 1, "fitness": 0.7}, {"generation": 1, "fitness": 0.8},
               {"generation": 2, "fitness": 1.3}, {"generation": 2, "fitness": None}]
    assert peers.edt_curve(lineage) == [(2, 0.9), (4, 0.9), (5, 1.3)]
    lineage[2]["carried_from"] = "g000000/m000"  # an elite scored by its parent's evaluation: no evaluation spent
    assert peers.edt_curve(lineage) == [(2, 0.9), (3, 0.9), (4, 1.3)]


def test_first_reach_best_at_and_spread(peers):
    curve = [(4, 0.5), (8, 1.0), (12, 1.0)]
    assert peers.first_reach(curve) == (1.0, 8)
    assert peers.best_at(curve, 7) == 0.5 and peers.best_at(curve, 3) is None and peers.best_at(curve, 99) == 1.0
    assert peers.spread([1.0, 3.0, 2.0]) == "2.00 (1.00-3.00)"
    assert peers.spread([2.0]) == "2.00" and peers.spread([None]) == "-"


def test_task_yaml_is_an_exact_match_generation_task(peers, tmp_path):
    doc = yaml.safe_load(peers.task_yaml("edt_peer_sort", tmp_path / "sort.jsonl", max_gen_toks=12))
    assert doc["task"] == "edt_peer_sort" and doc["output_type"] == "generate_until"
    assert doc["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "sort.jsonl")
    assert doc["generation_kwargs"]["until"] == ["<|endoftext|>", "\n"]
    assert doc["generation_kwargs"]["max_gen_toks"] == 12 and doc["generation_kwargs"]["do_sample"] is False
    (metric,) = doc["metric_list"]
    assert metric["metric"] == "exact_match" and metric["regexes_to_ignore"] == ["^\\s+", "\\s+$"]


def test_evolve_yaml_is_mergekit_evolves_shape(peers):
    doc = yaml.safe_load(peers.evolve_yaml(["/m/a", "/m/b"], "/m/base", ["t1", "t2"], "ties", 2))
    assert doc["genome"] == {"models": ["/m/a", "/m/b"], "merge_method": "ties", "base_model": "/m/base",
                             "layer_granularity": 2}
    assert doc["tasks"] == [{"name": "t1", "metric": "exact_match,none"}, {"name": "t2", "metric": "exact_match,none"}]
    assert doc["apply_chat_template"] is False and doc["fewshot_as_multiturn"] is False


def test_vllm_placeholder_makes_the_module_importable_without_vllm(peers, tmp_path):
    """A stand-in lm_eval whose models/vllm_causallms.py imports vllm (absent), as lm-eval >= 0.4.10's does."""
    pkg = tmp_path / "lm_eval" / "models"
    pkg.mkdir(parents=True)
    (tmp_path / "lm_eval" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "vllm_causallms.py").write_text("import vllm\n")
    (tmp_path / "placeholder.py").write_text(peers.SHIM)
    code = ("import placeholder, lm_eval.models\n"
            "m = lm_eval.models.vllm_causallms\n"
            "m.VLLM.AUTO_MODEL_CLASS = 1\n"
            "try:\n    m.VLLM()\nexcept ImportError as e:\n    print('refused:', e)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    assert "refused: vllm is not installed" in p.stdout


def test_missing_mergekit_evolve_says_how_to_install(peers, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["evomerge_peers.py", "--quick", "--python", str(tmp_path / "nope" / "python")])
    assert peers.main() == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "mergekit-evolve is not installed" in err and "python bench/evomerge_peers.py --setup" in err


def test_a_parent_that_does_not_load_is_named(peers, monkeypatch, capsys, tmp_path):
    for name in ("base", "addition", "reverse", "sort"):
        (tmp_path / name).mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    monkeypatch.setattr(sys, "argv", ["evomerge_peers.py", "--quick", "--tools", "edt", "--models", str(tmp_path)])
    assert peers.main() == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"parent base ({tmp_path / 'base'}) does not load with transformers")
