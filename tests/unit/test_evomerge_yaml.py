"""EvoMerge speaks mergekit (train/evomerge/mergekit_io.py): a member's recipe as best_config.yaml rebuilds its merge
bit for bit through `python -m train.merge`'s code (and within float rounding through mergekit, where installed),
and a mergekit YAML seeds generation 0's recipe genes (evomerge.initial_recipe) or is refused, naming why."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests.helpers import REPO, tiny_config
from train.config import ConfigError, build_config
from train.edt.genes import generation_rng, random_dna
from train.core.tensorio import load_tensors
from train.edt.store import EDTPaths
from train.evomerge.breeding import EvoMergeBreeding, decode_evomerge, evomerge_genes
from train.evomerge.mergekit_io import member_config, to_mergekit
from train.merge.yaml_merge import run_yaml_merge
from train.merge.yaml_plan import Plan

METHODS = ("linear", "slerp", "task_arithmetic", "ties", "dare_linear", "dare_ties")
TASKS = [{"name": "sort", "data": "task:sort", "metric": "exact_match", "items": 4}]


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    """A fake EvoMerge run folder: generation 0's members a and b (micro Llamas, random init) and a base model with
    a tokenizer (members have none, as in a real run)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("run")
    config = AutoConfig.from_pretrained(REPO / "configs" / "micro-llama.json")
    for seed, where in enumerate(("generations/g000000/members/m000", "generations/g000000/members/m001", "base")):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / where)
    AutoTokenizer.from_pretrained(str(REPO / "data" / "tokenizer")).save_pretrained(root / "base")
    return root


def em_config(root: Path, **evomerge):
    em = {"base_model": str(root / "base"), "tasks": TASKS, **evomerge}
    return build_config(tiny_config(root / "runs", edt={"mode": "evomerge", "initial_population": [
        str(root / "generations/g000000/members/m000"), str(root / "generations/g000000/members/m001")]},
        evomerge=em))


def gen0(root: Path, m: int) -> dict:
    return {"id": f"g000000/m{m:03d}", "generation": 0, "member": m, "parents": [], "elite": False,
            "origin": str(root / f"generations/g000000/members/m{m:03d}"), "tokens": 0, "fitness": 0.5}


def child_record(hyper: dict, tokens: int = 0, g: int = 1, m: int = 0) -> dict:
    return {"id": f"g{g:06d}/m{m:03d}", "generation": g, "member": m, "elite": False, "hyper": hyper,
            "tokens": tokens, "fitness": 1.0, "parents": [
                {"id": "g000000/m000", "path": "generations/g000000/members/m000"},
                {"id": "g000000/m001", "path": "generations/g000000/members/m001"}]}


def comment(text: str, key: str) -> str | None:
    return next((ln.split(": ", 1)[1] for ln in text.splitlines() if ln.startswith(f"# {key}: ")), None)


def merge_yaml(text: str, where: Path, out: Path) -> dict[str, torch.Tensor]:
    """What `python -m train.merge best_config.yaml OUT [--random-seed N]` does, in process."""
    (where / "best_config.yaml").write_text(text)
    seed = comment(text, "random-seed")
    run_yaml_merge(Plan(yaml.safe_load(text), where), out, seed=int(seed) if seed else 0)
    return load_tensors(out / "model.safetensors")


def assert_equal(got: dict, want: dict, tol: float = 0.0) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        if tol == 0.0:
            assert torch.equal(got[k], want[k]), f"{k} differs by {float((got[k] - want[k]).abs().max()):.3g}"
        else:
            assert float((got[k].float() - want[k].float()).abs().max()) <= tol, k


def a_hyper_per_method(cfg) -> dict[str, dict]:
    genes, rng, out = evomerge_genes(cfg), generation_rng(5, 1), {}
    for k in range(400):
        hyper = decode_evomerge(random_dna(genes, rng), cfg, 1, k % 4)
        out.setdefault(hyper["method"], hyper)
    assert set(out) == set(METHODS)
    return out


@pytest.fixture(scope="module")
def children(run_root):
    """One child per method, made as the coordinator makes it (EvoMergeBreeding.fill), in its job folder."""
    cfg = em_config(run_root)
    made = {}
    for i, (method, hyper) in enumerate(sorted(a_hyper_per_method(cfg).items())):
        job = run_root / f"generations/g{i + 1:06d}/jobs/m000"
        job.mkdir(parents=True)
        a, b = (SimpleNamespace(dir=run_root / f"generations/g000000/members/m{m:03d}", id=f"g000000/m{m:03d}")
                for m in (0, 1))
        EvoMergeBreeding(cfg).fill(i + 1, a, b, hyper, False, {"bytes_read": 0, "bytes_written": 0})(job)
        made[method] = (i + 1, hyper)
    return cfg, made


@pytest.mark.parametrize("method", METHODS)
def test_best_config_rebuilds_the_merge_bit_for_bit(method, run_root, children, tmp_path):
    cfg, made = children
    g, hyper = made[method]
    records = [gen0(run_root, 0), gen0(run_root, 1), child_record(hyper, tokens=960, g=g)]
    text, info = member_config(cfg, EDTPaths(run_root), records, f"g{g:06d}/m000", "best of a test")
    mk = yaml.safe_load(text)
    assert mk["merge_method"] == method and len(mk["models"]) == 2 and info["sft"] and not info["missing"]
    assert comment(text, "reproduces") == str(run_root / f"generations/g{g:06d}/jobs/m000")
    assert comment(text, "sft-mutated") == "true" and (comment(text, "random-seed") is not None) == ("dare" in method)
    assert ("base_model" in mk) == (method != "linear")
    assert_equal(merge_yaml(text, tmp_path, tmp_path / "out"),
                 load_tensors(Path(comment(text, "reproduces")) / "model.safetensors"))


def test_copies_are_followed_to_the_merge_and_generation_0_is_a_passthrough(run_root, children, tmp_path):
    cfg, made = children
    g, hyper = made["slerp"]
    elite = {"id": f"g{g + 1:06d}/m002", "generation": g + 1, "member": 2, "elite": True, "hyper": {}, "tokens": 0,
             "fitness": 1.0, "parents": [{"id": f"g{g:06d}/m000", "path": "x"}] * 2}
    refill = {**elite, "id": f"g{g + 2:06d}/m001", "elite": False, "refilled": True, "copy_of": elite["id"]}
    records = [gen0(run_root, 0), gen0(run_root, 1), child_record(hyper, g=g), elite, refill]
    text, info = member_config(cfg, EDTPaths(run_root), records, refill["id"], "final")
    assert info["origin"] == f"g{g:06d}/m000" and comment(text, "sft-mutated") == "false"
    assert f"{refill['id']} is a copy" in text and "rebuilds the member itself" in text
    text0, info0 = member_config(cfg, EDTPaths(run_root), records + [{**elite, "id": "g000009/m000", "parents": [
        {"id": "g000000/m001"}] * 2}], "g000009/m000", "best of generation 9")
    assert yaml.safe_load(text0)["merge_method"] == "passthrough" and info0["origin"] == "g000000/m001"
    assert_equal(merge_yaml(text0, tmp_path, tmp_path / "out"),
                 load_tensors(run_root / "generations/g000000/members/m001/model.safetensors"))


def test_pruned_folders_and_count_consensus_are_said(run_root, children):
    cfg, made = children
    g, hyper = made["ties"]
    rec = child_record(hyper, g=g)
    rec["parents"][1] = {"id": "g000000/m005", "path": "generations/g000000/members/m005"}
    text, info = member_config(cfg, EDTPaths(run_root), [gen0(run_root, 0), rec], rec["id"], "x")
    assert info["missing"] == [str(run_root / "generations/g000000/members/m005")] and "keep_generations" in text
    count = {**hyper, "recipe": {**hyper["recipe"], "consensus_method": "count"}}
    text, info = member_config(cfg, EDTPaths(run_root), [gen0(run_root, 0), child_record(count, g=g)], rec["id"], "x")
    assert info["reproduces"] is None and yaml.safe_load(text) is None and "no mergekit recipe" in text


@pytest.mark.skipif(importlib.util.find_spec("mergekit") is None, reason="mergekit not installed (extra: mergekit)")
@pytest.mark.parametrize("method", ["linear", "slerp", "task_arithmetic", "ties"])
def test_mergekit_yaml_rebuilds_the_merge(method, run_root, children, tmp_path):
    """mergekit itself on best_config.yaml: equal within float rounding (DARE's mask is mergekit's own draw)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from mergekit_reference import run_mergekit

    cfg, made = children
    g, hyper = made[method]
    text, _ = member_config(cfg, EDTPaths(run_root), [gen0(run_root, 0), gen0(run_root, 1), child_record(hyper, g=g)],
                            f"g{g:06d}/m000", "x")
    (tmp_path / "best_config.yaml").write_text(text)
    run_mergekit(tmp_path / "best_config.yaml", tmp_path / "mk")
    assert_equal(load_tensors(tmp_path / "mk" / "model.safetensors"),
                 load_tensors(Path(comment(text, "reproduces")) / "model.safetensors"), tol=1e-6)


# -- evomerge.initial_recipe -------------------------------------------------------------------------------------------
def initial(run_root: Path, tmp_path: Path, recipe: dict, **evomerge):
    path = tmp_path / "start.yml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    raw = tiny_config(tmp_path / "runs", edt={"mode": "evomerge"},
                      evomerge={"tasks": TASKS, "initial_recipe": str(path), **evomerge})
    cfg = build_config(raw)
    return cfg, decode_evomerge(EvoMergeBreeding(cfg).initial_dna(random_dna(evomerge_genes(cfg),
                                                                            generation_rng(0, 0))), cfg, 0, 0)


def mk(run_root: Path, method: str, params: dict, per=({}, {}), base: bool = True) -> dict:
    a, b = (str(run_root / f"generations/g000000/members/m{m:03d}") for m in (0, 1))
    out = {"merge_method": method, "models": [{"model": a, "parameters": per[0]}, {"model": b, "parameters": per[1]}],
           "parameters": params}
    if base:
        out["base_model"] = a if method == "slerp" else str(run_root / "base")
        if method == "slerp":
            out["models"] = out["models"][1:]
    return out


def test_an_initial_recipe_seeds_the_genes_and_names_the_population(run_root, tmp_path):
    start = mk(run_root, "ties", {"lambda": 1.2}, ({"weight": 0.6, "density": 0.5}, {"weight": 0.4, "density": 0.5}))
    cfg, hyper = initial(run_root, tmp_path, start)
    assert cfg.edt.initial_population == [m["model"] for m in start["models"]]
    assert cfg.evomerge.base_model == start["base_model"]
    r = hyper["recipe"]
    assert (r["method"], r["weights"], r["density"], r["lambda"]) == ("ties", [0.6, 0.4], 0.5, 1.2)
    # the round trip: the genome's recipe written back as mergekit YAML says what the YAML said
    back = to_mergekit(r, [m["model"] for m in start["models"]], start["base_model"])
    assert [m["parameters"] for m in back["models"]] == [m["parameters"] for m in start["models"]]
    assert back["parameters"] == {"normalize": True, "lambda": 1.2}
    json.dumps(cfg.to_dict())  # the filled config is what config.json stores


def test_initial_slerp_curves_and_unnormalised_task_arithmetic(run_root, tmp_path):
    t = [{"filter": "self_attn", "value": [0.1, 0.5, 0.9]}, {"filter": "mlp", "value": 0.25}, {"value": 0.4}]
    _, hyper = initial(run_root, tmp_path, mk(run_root, "slerp", {"t": t}), curve_points=3)
    assert hyper["recipe"]["t_curves"] == {"self_attn": [0.1, 0.5, 0.9], "mlp": [0.25] * 3, "default": 0.4}
    ta = mk(run_root, "task_arithmetic", {"lambda": 0.5}, ({"weight": 0.9}, {"weight": 0.9}))
    _, hyper = initial(run_root, tmp_path, ta)
    assert hyper["recipe"]["weights"] == [0.5, 0.5] and hyper["recipe"]["lambda"] == pytest.approx(0.9)


@pytest.mark.parametrize("change, match", [
    (lambda r: r.update(merge_method="passthrough"), "genome encodes linear, slerp"),
    (lambda r: r.update(slices=[]), "slices / modules"),
    (lambda r: r["models"].append({"model": "org/third"}), "of 3 model"),
    (lambda r: r["parameters"].update(rescale=False), "rescale"),
    (lambda r: r["models"][0]["parameters"].update(weight=[0.5, 0.6]), "one number here"),
    (lambda r: r["models"][0]["parameters"].update(density=0.9), "one density for both"),
    (lambda r: r["models"][0]["parameters"].update(weight=9.0), "outside its gene's range"),
    (lambda r: r["parameters"].update(normalize=False), "normalize: false for dare_ties"),
    (lambda r: r["parameters"].update(gamma=0.1), "not a parameter"),
    (lambda r: r.update(tokenizer={}), "cannot seed"),
])
def test_what_the_genome_cannot_encode_is_refused(run_root, tmp_path, change, match):
    start = mk(run_root, "dare_ties", {"normalize": True}, ({"weight": 0.5, "density": 0.5},
                                                           {"weight": 0.5, "density": 0.5}))
    change(start)
    with pytest.raises(ConfigError, match=match) as e:
        initial(run_root, tmp_path, start)
    assert "evomerge.initial_recipe" in str(e.value)


def test_initial_recipe_config_errors(run_root, tmp_path):
    with pytest.raises(ConfigError, match="has 2 points: .* evomerge.curve_points = 5"):
        initial(run_root, tmp_path, mk(run_root, "slerp", {"t": [{"filter": "mlp", "value": [0, 1]}, {"value": 0.5}]}))
    with pytest.raises(ConfigError, match="one gradient for every tensor"):
        initial(run_root, tmp_path, mk(run_root, "slerp", {"t": [0.0, 1.0]}))
    with pytest.raises(ConfigError, match="not among evomerge.methods"):
        initial(run_root, tmp_path, mk(run_root, "linear", {}, ({"weight": 1}, {"weight": 1}), base=False),
                methods=["slerp"])
    with pytest.raises(ConfigError, match="differs from evomerge.base_model"):
        initial(run_root, tmp_path, mk(run_root, "ties", {}), base_model=str(run_root / "generations"))
    with pytest.raises(ConfigError, match="no such file"):
        build_config(tiny_config(tmp_path, edt={"mode": "evomerge"}, evomerge={"tasks": TASKS,
                                                                               "initial_recipe": "nope.yml"}))
    with pytest.raises(ConfigError, match="is for edt.mode"):
        build_config(tiny_config(tmp_path, evomerge={"initial_recipe": "nope.yml"}))
    with pytest.raises(ConfigError, match="elects signs by sum"):
        initial(run_root, tmp_path, mk(run_root, "ties", {}, ({"weight": 0.5, "density": 0.5},) * 2),
                consensus_method="count")


def test_generation_0_carries_the_initial_recipe(run_root, tmp_path):
    """write_initial_population: every member of generation 0 has the YAML's recipe (its other genes random)."""
    from train.core.store import read_json
    from train.edt.breed import write_initial_population
    from train.edt.store import EDTPaths

    start = mk(run_root, "dare_linear", {"lambda": 0.8}, ({"weight": 0.3, "density": 0.7},
                                                         {"weight": 0.7, "density": 0.7}))
    cfg, _ = initial(run_root, tmp_path, start)
    cfg.edt.population_size = 3
    paths = EDTPaths(tmp_path / "run")
    write_initial_population(cfg, paths, EvoMergeBreeding(cfg))
    recipes = [read_json(paths.job_json(0, m))["hyper"]["recipe"] for m in range(3)]
    for r in recipes:
        assert (r["method"], r["weights"], r["density"], r["lambda"]) == ("dare_linear", [0.3, 0.7], 0.7, 0.8)
    mixes = [read_json(paths.job_json(0, m))["genome"]["dna"].get("inner_lr") for m in range(3)]
    assert len(set(mixes)) == 3  # the genes the recipe does not name stay random
