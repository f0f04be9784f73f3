"""The file form of the merge methods: streamed merges equal in-memory ones, stay within a memory budget, and
mismatched parents are refused before any tensor is read."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from train.merge import methods as merge_methods
from train.merge.methods import MergeError, Recipe, merge_state_dicts
from train.merge.stream import check_compatible, merge_model_dirs
from train.core.store import verify_manifest
from train.core.tensorio import load_tensors, save_streaming

MICRO = json.loads((REPO / "configs" / "micro-llama.json").read_text())


def hf_dir(path: Path, seed: int, tied: bool = True, **config) -> Path:
    """A real HF model directory (save_pretrained of a micro Llama) with the repo's tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**MICRO, "tie_word_embeddings": tied, **config})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "data" / "tokenizer" / f, path / f)
    return path


def weights(d: Path) -> dict[str, torch.Tensor]:
    return load_tensors(d / "model.safetensors")


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return [hf_dir(root / name, seed) for name, seed in (("a", 1), ("b", 2), ("base", 3))]


RECIPES = [Recipe("linear", weights=(0.3, 0.9)), Recipe("slerp", t_curves={"self_attn": [0, 1], "default": 0.3}),
           Recipe("task_arithmetic", weights=(0.5, 0.8), lambda_=1.1), Recipe("ties", density=(0.3, 0.6)),
           Recipe("ties", weights=(0.7, 0.5), density=0.5, consensus_method="count"),
           Recipe("dare_linear", density=0.5, seed=3), Recipe("dare_ties", weights=(1.0, 0.5), density=0.4)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.method + ("-count" if r.consensus_method == "count"
                                                                      else ""))
def test_streamed_merge_equals_the_in_memory_merge(three, tmp_path, monkeypatch, recipe):
    monkeypatch.setattr(merge_methods, "CHUNK", 1000)  # the 2048×16 embedding spans 33 chunks
    a, b, base = three
    out = tmp_path / "child"
    info = merge_model_dirs(recipe, [a, b], out, base_model_dir=base)
    got = weights(out)
    use_base = recipe.method in Recipe.NEEDS_BASE
    expect = merge_state_dicts(recipe, [weights(a), weights(b)], weights(base) if use_base else None)
    assert list(got) == list(expect) and "lm_head.weight" not in got  # tied: the embedding only, as the parents
    for k in expect:
        assert torch.equal(got[k], expect[k]), k
    assert info["finite"] and info["bytes_written"] == (out / "model.safetensors").stat().st_size
    size = (a / "model.safetensors").stat().st_size
    assert info["bytes_read"] >= (3 if use_base else 2) * (size - 4096)
    verify_manifest(out)
    assert json.loads((out / "config.json").read_text()) == json.loads((a / "config.json").read_text())
    assert (out / "tokenizer.json").is_file()
    # a second run gives the same bytes (DARE's stream is seeded per tensor name)
    assert merge_model_dirs(recipe, [a, b], tmp_path / "again", base_model_dir=base)["sha256"] == info["sha256"]


def test_the_child_loads_with_from_pretrained_and_dtype_can_be_changed(three, tmp_path):
    from transformers import AutoModelForCausalLM
    a, b, _ = three
    merge_model_dirs(Recipe("slerp"), [a, b], tmp_path / "c", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "c"))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert json.loads((tmp_path / "c" / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_parents_and_an_explicit_tied_lm_head(three, tmp_path):
    a, b, _ = three
    wa = weights(a)
    shard = tmp_path / "sharded"
    shard.mkdir()
    shutil.copy(a / "config.json", shard / "config.json")
    names = list(wa)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, part in halves.items():
        save_streaming(shard / fname, {n: wa[n] for n in part})
    (shard / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in halves.items() for n in part}}))
    explicit = tmp_path / "explicit"  # an older tied checkpoint that also stores lm_head.weight
    explicit.mkdir()
    shutil.copy(b / "config.json", explicit / "config.json")
    wb = weights(b)
    save_streaming(explicit / "model.safetensors", {**wb, "lm_head.weight": wb["model.embed_tokens.weight"]})
    r = Recipe("linear", weights=(1.0, 2.0))
    merge_model_dirs(r, [shard, explicit], tmp_path / "x")
    merge_model_dirs(r, [a, b], tmp_path / "y")
    assert (tmp_path / "x" / "model.safetensors").read_bytes() == (tmp_path / "y" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("change,match", [
    (dict(hidden_size=32, intermediate_size=32), r"tensor 'model.embed_tokens.weight' has shape \[2048, 32\] vs "
                                                 r"\[2048, 16\]"),
    (dict(vocab_size=2050), "config.json field 'vocab_size' differs: 2050 vs 2048"),
    (dict(tie_word_embeddings=False), "field 'tie_word_embeddings' differs"),
    (dict(num_hidden_layers=3), r"tensor\(s\) \['model.layers.2"),
    (dict(model_type_override="mistral"), "field 'model_type' differs"),
])
def test_mismatched_parents_are_refused_before_any_work(three, tmp_path, change, match):
    a, _, base = three
    override = change.pop("model_type_override", None)
    bad = hf_dir(tmp_path / "bad", 5, tied=change.pop("tie_word_embeddings", True), **change)
    if override:
        cfg = json.loads((bad / "config.json").read_text())
        cfg["model_type"] = override
        (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MergeError, match=match) as e:
        merge_model_dirs(Recipe("ties"), [a, bad], tmp_path / "out", base_model_dir=base)
    assert f"model 1 ({bad})" in str(e.value) and f"model 0 ({a})" in str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))
    with pytest.raises(MergeError, match=match):
        check_compatible([a, bad])
    with pytest.raises(MergeError, match=f"base model \\({bad}\\)"):  # the base is checked as strictly
        check_compatible([a, base], base_model_dir=bad)


def test_a_missing_tensor_a_different_tokenizer_and_a_non_model_dir_are_named(three, tmp_path):
    a, b, _ = three
    c = tmp_path / "c"
    shutil.copytree(b, c)
    wc = weights(c)
    del wc["model.layers.1.mlp.up_proj.weight"]
    save_streaming(c / "model.safetensors", wc)
    with pytest.raises(MergeError, match=r"model 1 .*tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        check_compatible([a, c])
    d = tmp_path / "d"
    shutil.copytree(b, d)
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 5000, "content": "<extra>"})
    (d / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(MergeError, match="tokenizer.json vocabulary sizes differ"):
        check_compatible([a, d])
    with pytest.raises(MergeError, match="no config.json"):
        check_compatible([a, tmp_path])
    summary = check_compatible([a, b])
    assert summary["names"][0] == "model.embed_tokens.weight" and summary["num_layers"] == 2
    assert summary["bytes"] == sum(t.numel() * 4 for t in weights(a).values())


def test_a_streamed_ties_merge_keeps_exactly_k_of_tied_magnitudes_across_chunks(tmp_path, monkeypatch):
    """Task vectors of ±0.5 only (every magnitude tied, as bf16 fine-tunes often are): each tensor keeps exactly
    k = int(density · numel) entries, the first k in flat order, though the ties span many chunks."""
    monkeypatch.setattr(merge_methods, "CHUNK", 100)
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (64, 32), "model.layers.0.mlp.up_proj.weight": (48, 32),
              "model.norm.weight": (32,)}
    # multiples of 1/64: base ± 0.5 and its difference to the base are exact in float32, so the ties are real
    base = {n: (torch.randn(shape, generator=g) * 64).round() / 64 for n, shape in shapes.items()}
    delta = {n: torch.where(torch.rand(t.shape, generator=g) < 0.5, 0.5, -0.5) for n, t in base.items()}
    for name, sd in (("base", base), ("x", {n: base[n] + delta[n] for n in base})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
        save_streaming(tmp_path / name / "model.safetensors", sd)
    merge_model_dirs(Recipe("ties", weights=(1.0,), density=0.3), [tmp_path / "x"], tmp_path / "out",
                     base_model_dir=tmp_path / "base")
    got = weights(tmp_path / "out")
    for n, d in delta.items():
        k = int(0.3 * d.numel())  # 614, 460, 9
        flat = (got[n] - base[n]).reshape(-1)
        assert int((flat != 0).sum()) == k, n
        expect = d.reshape(-1).clone()
        expect[k:] = 0  # one model: its own sign always agrees, divided by its weight 1
        assert torch.allclose(flat, expect, atol=1e-6), n


def test_a_ties_density_that_keeps_nothing_of_a_small_tensor_is_refused_before_any_read(three, tmp_path,
                                                                                       monkeypatch):
    from train.merge import stream as merge_stream
    a, b, base = three
    monkeypatch.setattr(merge_stream.ModelFiles, "source", lambda self, name: pytest.fail(f"read {name}"))
    # int(0.05 · 16) = 0 for the 16-element norms of the micro Llama (the larger tensors keep k ≥ 1)
    with pytest.raises(MergeError, match=r"keeps int\(0.05 × 16\) = 0 entries of tensor 'model\..*norm\.weight'"):
        merge_model_dirs(Recipe("ties", density=0.05), [a, b], tmp_path / "out", base_model_dir=base)
    with pytest.raises(MergeError, match=r"density 0.04 of model 1 keeps int\(0.04 × 16\) = 0"):
        merge_model_dirs(Recipe("ties", density=(0.5, 0.04)), [a, b], tmp_path / "out", base_model_dir=base)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))


# -- memory ----------------------------------------------------------------------------------------------------------
RSS_SCRIPT = r"""
import json, sys, torch
from pathlib import Path
from train.merge.methods import Recipe
from train.merge.stream import merge_model_dirs

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

torch.set_num_threads(1)  # a memory test: one thread is fastest on a shared, oversubscribed box
(torch.randn(1000) * 2).sum()  # start torch's machinery before the baseline
root = Path(sys.argv[1])
baseline = status("VmRSS")
try:  # reset the high-water mark to now (Linux >= 4.0), so imports' transient peaks do not count
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    pass
baseline = max(baseline, status("VmHWM"))
info = merge_model_dirs(Recipe(sys.argv[2], density=0.5), [root / "a", root / "b"], root / "out",
                        base_model_dir=root / "base")
print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "finite": info["finite"]}))
"""


def synthetic_model(path: Path, seed: int, mb: int) -> int:
    """An HF-style directory with `mb` MB of float32: a 16 MB embedding (4 chunks) and 2 MB tensors."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "vocab_size": 4096, "tie_word_embeddings": True}))
    tensors = {"model.embed_tokens.weight": torch.randn(4096, 1024, generator=g)}
    for i in range((mb - 16) // 2):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(512, 1024, generator=g)
    save_streaming(path / "model.safetensors", tensors)
    return (path / "model.safetensors").stat().st_size


def test_a_streamed_ties_merge_stays_within_a_memory_budget_well_below_one_model(tmp_path):
    """ties reads three 300 MB models (the most inputs, the most working memory of the methods); the process may
    grow by half a model at most (measured: ~110 MB, independent of model size; through safe_open's mmap, ~500 MB
    for 150 MB models)."""
    size = 0
    for name, seed in (("a", 1), ("b", 2), ("base", 3)):
        size = synthetic_model(tmp_path / name, seed, mb=300)
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path), "ties"], capture_output=True, text=True,
                         cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    used = r["peak"] - r["baseline"]
    assert r["finite"] and used < 0.5 * size, f"peak RSS grew by {used / 1e6:.0f} MB for a {size / 1e6:.0f} MB model"
