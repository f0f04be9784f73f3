"""EvoMerge (EDT in post-training mode): the recipe genome, config errors, and runs with real processes."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, tiny_config
from tests.helpers.proc import kill_all, run_script, start_script, wait_until
from train.config import ConfigError, build_config
from train.edt.store import EDTPaths
from train.edt.genes import crossover_dna, generation_rng, mutate_dna, random_dna
from train.evomerge.breeding import decode_evomerge, evomerge_genes
from train.merge.methods import Recipe
from train.core.store import read_json, read_jsonl, verify_manifest

pytestmark = pytest.mark.xdist_group("specialists")  # one xdist worker: the module's shared fixture

TASKS = ("addition", "reverse", "sort")


def evomerge_raw(base_dir, models: list[str], base: str | None = None, **evomerge) -> dict:
    em = {"datasets": {t: f"task:{t}" for t in TASKS}, "sft_items": 200, "max_length": 32, "max_new_tokens": 8,
          "tasks": [{"name": t, "data": f"task:{t}", "metric": "exact_match", "items": 8} for t in TASKS]}
    if base:
        em["base_model"] = base
    em.update(evomerge)
    return tiny_config(base_dir, outer={"num_workers": 2},
                       edt={"mode": "evomerge", "initial_population": models, "population_size": 4,
                            "max_generations": 2, "mutation_steps": 3, "fitness": "tasks", "job_lease_s": 30},
                       evomerge=em, logging={"plot": True})


# -- the genome (pure, fast) -----------------------------------------------------------------------------------------
def test_genes_follow_the_configured_methods():
    cfg = build_config(evomerge_raw("/tmp/x", ["a", "b"], methods=["slerp"], curve_points=3))
    genes = evomerge_genes(cfg)
    assert "method" not in genes and "weight" not in genes and "density" not in genes
    assert {f"t_attn_{i}" for i in range(3)} | {f"t_mlp_{i}" for i in range(3)} | {"t_rest"} <= set(genes)
    assert {f"mix_{t}" for t in TASKS} <= set(genes)
    full = evomerge_genes(build_config(evomerge_raw("/tmp/x", ["a", "b"], base="base")))
    assert {"method", "weight", "density", "scale"} <= set(full)


def test_decoded_recipes_are_valid_and_round_trip_through_json():
    cfg = build_config(evomerge_raw("/tmp/x", ["a", "b"], base="base", density=[0.4, 0.9], scale=[0.5, 1.5]))
    genes, rng = evomerge_genes(cfg), generation_rng(0, 0)
    seen = set()
    for k in range(200):
        hyper = decode_evomerge(random_dna(genes, rng), cfg, 1, k % 4)
        rec = json.loads(json.dumps(hyper))["recipe"]  # as genome.json stores it
        recipe = Recipe.from_dict(rec)
        assert recipe.method == hyper["method"] and recipe.to_dict() == Recipe.from_dict(recipe.to_dict()).to_dict()
        seen.add(recipe.method)
        if recipe.method in ("ties", "dare_ties", "dare_linear"):
            assert 0.4 <= rec["density"] <= 0.9
        if recipe.method == "slerp":
            assert len(rec["t_curves"]["self_attn"]) == 5 and 0 <= rec["t_curves"]["default"] <= 1
        else:
            assert abs(sum(rec["weights"]) - 1) < 1e-5
        assert abs(sum(hyper["mix"].values()) - 1) < 1e-5 and hyper["inner_lr"] > 0
    assert seen == {"linear", "slerp", "task_arithmetic", "ties", "dare_linear", "dare_ties"}


def test_dna_crossover_and_mutation_change_the_recipe():
    cfg = build_config(evomerge_raw("/tmp/x", ["a", "b"], base="base"))
    genes, rng = evomerge_genes(cfg), generation_rng(3, 1)
    a, b = random_dna(genes, rng), random_dna(genes, rng)
    child, moved = mutate_dna(crossover_dna(a, b, rng), 1.0, 0.3, rng)
    assert moved and set(child) == set(genes)
    assert decode_evomerge(child, cfg, 1, 0) != decode_evomerge(a, cfg, 1, 0)


def test_evomerge_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"evomerge.methods\[0\] = \"ties\": merges task vectors: set "
                                          r"evomerge.base_model"):
        build_config(evomerge_raw("/tmp/x", ["a", "b"], methods=["ties"]))
    with pytest.raises(ConfigError, match="edt.initial_population = \\[\\]: evomerge needs the fine-tuned models"):
        build_config({"edt": {"mode": "evomerge"}})
    with pytest.raises(ConfigError, match=r"evomerge.tasks\[0\] = .*unknown key 'metrc'"):
        build_config(evomerge_raw("/tmp/x", ["a", "b"], tasks=[{"name": "a", "data": "task:sort", "metrc": "x"}]))
    with pytest.raises(ConfigError, match="evomerge.density = \\[0, 1\\]: low must be > 0"):
        build_config(evomerge_raw("/tmp/x", ["a", "b"], density=[0, 1]))


# -- real processes --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def specialists(tmp_path_factory):
    """A micro base model and three specialists fine-tuned from it, one per task (a few SFT steps each)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from train.evomerge.sft import SFTMixture, ensure_chat_template, train_sft
    from train.evomerge.tasks import task_items

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    tok = ensure_chat_template(AutoTokenizer.from_pretrained(str(REPO / "data" / "tokenizer")))
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "micro-llama.json"))
    base.save_pretrained(root / "base")
    out = {"base": str(root / "base")}
    for t in TASKS:
        model = AutoModelForCausalLM.from_pretrained(str(root / "base"))
        mix = SFTMixture({t: task_items(t, 200, "train")}, {t: 1.0}, tok, 32, seed=1)
        train_sft(model, mix, 15, 3e-3, batch_size=8)
        model.save_pretrained(root / t)
        tok.save_pretrained(root / t)
        out[t] = str(root / t)
    return out


def write_cfg(tmp_path, raw: dict) -> str:
    path = tmp_path / "evolution.json"
    path.write_text(json.dumps(raw, indent=1))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_mismatched_parents_are_refused_before_any_work(tmp_path, specialists):
    """edt_sim.py (its coordinator refuses the parents after it has started the worker processes, which it stops)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    other = AutoConfig.from_pretrained(REPO / "configs" / "micro-llama.json")
    other.intermediate_size = 48
    AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path / "wider")
    raw = evomerge_raw(tmp_path / "runs", [specialists["addition"], str(tmp_path / "wider")])
    out = run_script("edt_sim.py", "--config", write_cfg(tmp_path, raw), timeout=180)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "wider" in out.stderr and "shape" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "runs" / "t" / "generations").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_evomerge_three_specialists_two_generations_resume_after_sigkill(tmp_path, specialists):
    """Cluster layout (coordinator + 2 workers as separate processes): SIGKILL the coordinator and a worker in
    generation 1, rerun the same commands, and the run completes with the report."""
    models = [specialists[t] for t in TASKS]
    raw = evomerge_raw(tmp_path / "runs", models, base=specialists["base"])
    raw["edt"]["mutation_steps"] = 150
    cfg = write_cfg(tmp_path, raw)
    paths = EDTPaths(tmp_path / "runs" / "t")
    logs = tmp_path / "logs"
    logs.mkdir()

    def start_all(k: int):
        return [start_script([str(REPO / "edt.py"), "--config", cfg], logs / f"coord-{k}.log")] + \
               [start_script(["-m", "train.edt.worker", "--config", cfg, "--worker", str(w)], logs / f"w{w}-{k}.log")
                for w in range(2)]

    procs = start_all(1)
    try:
        # kill everything as soon as generation 1's jobs (the merged children) are committed: mid-generation
        wait_until(lambda: paths.gen_committed(1).is_file(), 240, "generation 1 committed", procs[0])
        for p in procs:  # all frozen at once first: none trains on while another is being killed
            os.killpg(p.pid, signal.SIGSTOP)
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        published = sum(paths.has_result(1, m) for m in range(4))
        assert not paths.done.exists() and published < 4, "the run finished before the kill: raise mutation_steps"
        procs = start_all(2)
        assert procs[0].wait(300) == 0, (logs / "coord-2.log").read_text()[-3000:]
        assert all(p.wait(60) == 0 for p in procs[1:])
    finally:
        kill_all(procs)
    recs = read_jsonl(paths.metrics)
    assert [r["generation"] for r in recs] == [0, 1]
    lineage = read_jsonl(paths.lineage)
    assert len({r["id"] for r in lineage}) == len(lineage) == 8
    gen0 = [r for r in lineage if r["generation"] == 0]
    assert {r["origin"] for r in gen0} == set(models)
    for r in lineage:
        assert set(r["scores"]) == set(TASKS)
        if r["generation"] == 1 and not r["elite"]:
            assert r["origin"] == r["hyper"]["method"] and len(r["parents"]) == 2
            job = read_json(paths.job_json(1, r["member"]))
            genome = read_json(paths.genome(1, r["member"]))  # the recipe that made the member round-trips
            assert genome["hyper"] == job["hyper"] == r["hyper"]
            assert Recipe.from_dict(genome["hyper"]["recipe"]).method == r["hyper"]["method"]
            assert job["steps"] == 150
        if r["elite"]:
            assert r["fitness"] == max(p["fitness"] for p in r["parents"])  # carried unchanged: same score
    # the report: every parent and the final member, per task
    rep = read_json(paths.root / "evomerge_report.json")
    assert len(rep["rows"]) == 4 and all(set(row["scores"]) == set(TASKS) for row in rep["rows"])
    assert (paths.root / "evomerge_report.png").stat().st_size > 5_000
    assert "| model |" in (paths.root / "evomerge_report.md").read_text()
    verify_manifest(paths.final)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(str(paths.final))
    assert AutoTokenizer.from_pretrained(str(paths.final)).chat_template
    assert_best_configs_round_trip(paths, tmp_path, cfg)


def assert_best_configs_round_trip(paths: EDTPaths, tmp_path, cfg_path: str) -> None:
    """best_config.yaml per generation and for the final member; `python -m train.merge best_config.yaml OUT`
    rebuilds, bit for bit, the model its `# reproduces:` comment names (the merge before SFT, or the initial model
    an elite carries); so does the YAML of every merged child of generation 1."""
    import yaml

    from train.config import load_config
    from train.core.tensorio import load_tensors
    from train.evomerge.mergekit_io import member_config
    from train.edt.lineage import load_lineage
    from train.merge.yaml_merge import run_yaml_merge
    from train.merge.yaml_plan import Plan

    def field(text: str, key: str) -> str | None:
        return next((ln.split(": ", 1)[1] for ln in text.splitlines() if ln.startswith(f"# {key}: ")), None)

    final = read_json(paths.done)["best"]
    text = (paths.root / "best_config.yaml").read_text()
    last = (paths.gen_dir(1) / "best_config.yaml").read_text()  # the same member: the same recipe
    assert text.splitlines()[1:] == last.splitlines()[1:] and final in text.splitlines()[0]
    assert (paths.gen_dir(0) / "best_config.yaml").is_file()
    assert yaml.safe_load(text)["merge_method"] in ("passthrough", "linear", "slerp", "task_arithmetic", "ties",
                                                     "dare_linear", "dare_ties")
    seed = field(text, "random-seed")
    out = run_script("-m", "train.merge", str(paths.root / "best_config.yaml"), str(tmp_path / "rebuilt"),
                     *(["--random-seed", seed] if seed else []), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    want = Path(field(text, "reproduces"))
    got, ref = load_tensors(tmp_path / "rebuilt" / "model.safetensors"), load_tensors(want / "model.safetensors")
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    cfg, lineage = load_config(cfg_path, strategy="edt"), load_lineage(paths.root)
    for i, r in enumerate(r for r in lineage if r["generation"] == 1 and not r["elite"]):
        text, info = member_config(cfg, paths, lineage, r["id"], "a test")
        assert field(text, "sft-mutated") == "true" and info["reproduces"] == str(paths.job_dir(1, r["member"]))
        rebuilt = tmp_path / r["id"].replace("/", "-")
        if i == 0:  # the command on a merge (the final member above may be an elite: a passthrough)
            (tmp_path / "child.yaml").write_text(text)
            seed = ["--random-seed", str(info["seed"])] if info["seed"] is not None else []
            out = run_script("-m", "train.merge", str(tmp_path / "child.yaml"), str(rebuilt), *seed, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]
        else:  # the same, in process
            run_yaml_merge(Plan(yaml.safe_load(text), tmp_path), rebuilt, seed=info["seed"] or 0)
        got = load_tensors(rebuilt / "model.safetensors")
        ref = load_tensors(paths.job_dir(1, r["member"]) / "model.safetensors")
        assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref), r["hyper"]["method"]


def test_lora_mutation_trains_merges_back_and_scores(tmp_path, specialists):
    """The worker's mutation with evomerge.lora: adapters trained on the DNA's mix, merged into plain weights,
    then scored on the fixed held-out items of every task."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from train.evomerge.mutate import EvoMergeMutation

    cfg = build_config(evomerge_raw(tmp_path / "runs", [specialists[t] for t in TASKS],
                                    lora={"r": 4, "alpha": 8}))
    mutation = EvoMergeMutation(cfg, torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(specialists["addition"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    job = {"steps": 5, "position": {"sft": 7},
           "hyper": {"inner_lr": 3e-3, "mix": {"addition": 0.0, "reverse": 1.0, "sort": 0.0}}}
    out = mutation(model, job, 1, 0, lambda i, loss: None, tmp_path)
    assert out["position"] == {"sft": 7 + 5 * cfg.inner.per_device_batch_size}
    assert set(out["scores"]) == set(TASKS) and out["train_loss"] > 0 and out["eval_loss"] > 0
    assert out["task_fitness"] == pytest.approx(sum(out["scores"].values()))
    assert not any("lora" in n for n, _ in model.named_parameters())  # a plain model again
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if "proj" in n)
    again = EvoMergeMutation(cfg, torch.device("cpu"))  # another worker: the very same held-out items
    assert again.items == mutation.items
