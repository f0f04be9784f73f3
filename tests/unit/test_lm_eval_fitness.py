"""lm-eval fitness (evomerge.lm_eval, train/evomerge/lm_eval_fitness.py): the config shape and its one-line errors,
the sign rule, and a tiny local task (tests/data/lm_eval/) run through the real harness on a micro Llama."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import pin_threads, tiny_config
from train.config import ConfigError, build_config, load_config
from train.core.errors import EnvironmentProblem
from train.edt.genes import fitness_function
from train.evomerge.lm_eval_fitness import LMEvalTask, combine, parse_tasks

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "tests" / "data" / "lm_eval"  # edt_tiny_qa (multiple choice), edt_tiny_lm (perplexities)
N_DOCS = 8  # rows of tests/data/lm_eval/tiny_qa.jsonl

try:
    import lm_eval  # noqa: F401
    HAVE_LM_EVAL = True
except ImportError:
    HAVE_LM_EVAL = False
needs_lm_eval = pytest.mark.skipif(not HAVE_LM_EVAL, reason="lm-eval is not installed (pip install 'edt[lmeval]')")


def micro_llama(seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(REPO / "configs" / "micro-llama.json")))


@pytest.fixture(scope="module")
def in_repo_root():
    """The task YAMLs name their JSONL relative to the repository root (where workers run), as `datasets` resolves
    data_files against the working directory."""
    old = os.getcwd()
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(old)


# -- the config shape, without lm-eval -----------------------------------------------------------------------------
def test_task_list_in_mergekit_evolve_shape():
    tasks = parse_tasks(["arc_easy", {"name": "gsm8k", "weight": 2, "metric": "exact_match,strict-match"},
                         {"name": "edt_tiny_qa", "metric": "acc_norm"}])
    assert tasks == [LMEvalTask("arc_easy", 1.0, "acc,none"), LMEvalTask("gsm8k", 2.0, "exact_match,strict-match"),
                     LMEvalTask("edt_tiny_qa", 1.0, "acc_norm,none")]
    assert [t.key for t in tasks] == ["arc_easy/acc", "gsm8k/exact_match,strict-match", "edt_tiny_qa/acc_norm"]
    with pytest.raises(ConfigError, match="listed twice"):
        parse_tasks(["arc_easy", {"name": "arc_easy", "metric": "acc,none"}])
    with pytest.raises(ConfigError, match=r"unknown key 'metrics'"):
        parse_tasks([{"name": "arc_easy", "metrics": "acc"}])


def test_sign_rule_and_missing_metric():
    res = {"results": {"a": {"alias": "a", "acc,none": 0.5, "acc_stderr,none": "N/A", "sample_len": 8},
                       "b": {"word_perplexity,none": 40.0, "bits_per_byte,none": 2.0}},
           "higher_is_better": {"a": {"acc": True}, "b": {"word_perplexity": False, "bits_per_byte": False}}}
    tasks = parse_tasks([{"name": "a", "weight": 2.0}, {"name": "b", "metric": "bits_per_byte", "weight": 0.5}])
    scores, fitness = combine(tasks, res)
    assert scores == {"a/acc": 0.5, "b/bits_per_byte": 2.0}  # raw values
    assert fitness == pytest.approx(2.0 * 0.5 - 0.5 * 2.0)  # lower-is-better counts negatively
    with pytest.raises(ConfigError, match=r"task 'a' has no metric 'acc_norm,none'; it produced acc,none$"):
        combine(parse_tasks([{"name": "a", "metric": "acc_norm"}]), res)
    with pytest.raises(ConfigError, match="no results for task 'c'"):
        combine(parse_tasks(["c"]), res)


def evomerge_config(tmp_path, lm_eval: dict, **edt) -> dict:
    return tiny_config(tmp_path, edt={"mode": "evomerge", "fitness": "lm_eval", "initial_population": ["a", "b"],
                                      **edt},
                       evomerge={"tasks": [{"name": "sort", "data": "task:sort", "items": 4}], "lm_eval": lm_eval})


@pytest.mark.parametrize("lm_eval, match", [
    ({}, r"edt.fitness = \"lm_eval\": ranks by lm-evaluation-harness tasks: needs edt.mode = evomerge and "),
    ({"tasks": []}, r"evomerge.lm_eval.tasks = \[\]: must be a non-empty list"),
    ({"task": ["x"]}, r"evomerge.lm_eval = .*unknown key 'task'; allowed: tasks, include_path"),
    ({"tasks": [{"name": "x", "weight": "1"}]}, r"evomerge.lm_eval.tasks\[0\].weight = \"1\": must be a finite"),
    ({"tasks": [{"name": "x", "metric": "a,b,c"}]}, r"evomerge.lm_eval.tasks\[0\].metric = \"a,b,c\""),
    ({"tasks": [{"task": "x"}]}, r"evomerge.lm_eval.tasks\[0\] = .*must be a task name or an object"),
    ({"tasks": ["x"], "limit": 0}, r"evomerge.lm_eval.limit = 0: must be null, a document count"),
    ({"tasks": ["x"], "batch_size": 0}, r"evomerge.lm_eval.batch_size = 0: must be null or an integer >= 1"),
    ({"tasks": ["x"], "include_path": 3}, r"evomerge.lm_eval.include_path = 3: must be a folder"),
])
def test_config_errors_are_one_line(tmp_path, lm_eval, match):
    with pytest.raises(ConfigError, match="^<defaults>: " + match) as e:  # build_config names the source
        build_config(evomerge_config(tmp_path, lm_eval))
    assert "\n" not in str(e.value)


def test_config_shape_accepted_and_fitness_reads_the_worker_sum(tmp_path):
    le = {"tasks": ["edt_tiny_qa", {"name": "edt_tiny_lm", "weight": 0.5, "metric": "bits_per_byte"}],
          "include_path": "tests/data/lm_eval", "limit": 4, "num_fewshot": 0, "batch_size": 4}
    cfg = build_config(evomerge_config(tmp_path, le))
    assert cfg.evomerge.lm_eval == le and cfg.edt.fitness == "lm_eval"
    with pytest.raises(ConfigError, match="needs edt.mode = evomerge"):
        build_config(tiny_config(tmp_path, edt={"fitness": "lm_eval"}))
    f = fitness_function("lm_eval")
    assert f({"lm_eval_fitness": 1.25, "task_fitness": 9.0}) == 1.25
    assert f({"lm_eval_fitness": float("nan")}) == float("-inf") and f({}) == float("-inf")


def test_missing_package_names_the_extra(monkeypatch):
    from train.evomerge.lm_eval_fitness import LMEvalFitness
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    with pytest.raises(EnvironmentProblem, match=r"needs the package 'lm-eval'.*pip install 'edt\[lmeval\]'"):
        LMEvalFitness(["edt_tiny_qa"])


# -- the real harness ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harness(in_repo_root):
    from train.evomerge.lm_eval_fitness import LMEvalFitness
    tasks = [{"name": "edt_tiny_qa", "weight": 2.0}, {"name": "edt_tiny_qa", "weight": 0.5, "metric": "acc_norm"},
             {"name": "edt_tiny_lm", "weight": 0.25, "metric": "bits_per_byte,none"}]
    return LMEvalFitness(tasks, include_path=str(TASKS_DIR), include_defaults=False, batch_size=4)


@needs_lm_eval
def test_tiny_local_task_through_the_real_harness(harness, tok):
    pin_threads()
    model = micro_llama(0)
    model.train()
    random.seed(123)
    torch.manual_seed(123)
    want_py, want_torch = random.random(), torch.rand(1)
    random.seed(123)
    torch.manual_seed(123)
    res = harness(model, tok)
    assert model.training  # the mode it had
    assert (random.random(), torch.rand(1)) == (want_py, want_torch)  # the harness's seeding did not leak
    s = res["scores"]
    assert sorted(s) == ["edt_tiny_lm/bits_per_byte", "edt_tiny_qa/acc", "edt_tiny_qa/acc_norm"]
    assert res["samples"] == {"edt_tiny_qa": N_DOCS, "edt_tiny_lm": N_DOCS}
    for k in ("edt_tiny_qa/acc", "edt_tiny_qa/acc_norm"):  # a fraction of the 8 questions
        assert 0 <= s[k] <= 1 and (s[k] * N_DOCS) == pytest.approx(round(s[k] * N_DOCS))
    assert s["edt_tiny_lm/bits_per_byte"] > 1  # an untrained model over a 2048-token vocabulary
    assert res["fitness"] == pytest.approx(2.0 * s["edt_tiny_qa/acc"] + 0.5 * s["edt_tiny_qa/acc_norm"]
                                           - 0.25 * s["edt_tiny_lm/bits_per_byte"])
    assert harness(model, tok)["scores"] == s  # the same docs, the same model: the same scores
    other = harness(micro_llama(1), tok)["scores"]  # and they are the model's
    assert other["edt_tiny_lm/bits_per_byte"] != s["edt_tiny_lm/bits_per_byte"]


@needs_lm_eval
def test_unknown_task_metric_and_missing_data_are_named(tmp_path, in_repo_root):
    from train.evomerge.lm_eval_fitness import LMEvalFitness
    with pytest.raises(ConfigError, match=r"^evomerge.lm_eval.tasks\[0\].name = 'edt_tiny_q': lm-eval knows no such "
                                          r"task; close: edt_tiny_qa.*; under include_path: edt_tiny_lm, edt_tiny_qa "):
        LMEvalFitness(["edt_tiny_q"], include_path=str(TASKS_DIR), include_defaults=False)
    with pytest.raises(ConfigError, match=r"^evomerge.lm_eval.tasks\[1\].metric = 'f1,none': task 'edt_tiny_qa' "
                                          r"produces acc,none, acc_norm,none$"):
        LMEvalFitness([{"name": "edt_tiny_lm", "metric": "word_perplexity"}, {"name": "edt_tiny_qa", "metric": "f1"}],
                      include_path=str(TASKS_DIR), include_defaults=False)
    with pytest.raises(ConfigError, match=r"metric = 'acc,none': task 'edt_tiny_lm' produces bits_per_byte,none, "
                                          r"byte_perplexity,none, word_perplexity,none$"):
        LMEvalFitness(["edt_tiny_lm"], include_path=str(TASKS_DIR), include_defaults=False)  # acc,none by default
    broken = TASKS_DIR.joinpath("edt_tiny_qa.yaml").read_text().replace("tiny_qa.jsonl", "no_such.jsonl")
    (tmp_path / "broken.yaml").write_text(broken.replace("task: edt_tiny_qa", "task: edt_broken"))
    with pytest.raises(ConfigError, match=r"^evomerge.lm_eval: lm-eval could not load \['edt_broken'\] \(.*\); "
                                          r"offline, point the task YAMLs at local files"):
        LMEvalFitness(["edt_broken"], include_path=str(tmp_path), include_defaults=False)


@needs_lm_eval
def test_worker_mutation_reports_lm_eval_scores(tmp_path, in_repo_root):
    """The worker's evaluation (EvoMergeMutation) with evomerge.lm_eval: scores gain the harness's task/metric keys,
    edt.fitness = lm_eval ranks by lm_eval_fitness, the built-in tasks still give eval_loss."""
    from train.evomerge.mutate import EvoMergeMutation
    le = {"tasks": [{"name": "edt_tiny_qa", "weight": 1.0}], "include_path": "tests/data/lm_eval",
          "include_defaults": False, "limit": 4}
    path = tmp_path / "evolution.json"
    path.write_text(json.dumps(evomerge_config(tmp_path, le)))
    cfg = load_config(str(path))
    mutation = EvoMergeMutation(cfg, torch.device("cpu"))
    pin_threads()
    result = mutation(micro_llama(0), {"steps": 0, "hyper": {}, "position": {}}, 0, 0, None, tmp_path)
    assert set(result["scores"]) == {"sort", "edt_tiny_qa/acc"}
    assert result["scores"]["edt_tiny_qa/acc"] * 4 == pytest.approx(round(result["scores"]["edt_tiny_qa/acc"] * 4))
    assert fitness_function(cfg.edt.fitness)(result) == result["lm_eval_fitness"] == result["scores"]["edt_tiny_qa/acc"]
    assert result["eval_loss"] > 0 and result["task_fitness"] == result["scores"]["sort"]
