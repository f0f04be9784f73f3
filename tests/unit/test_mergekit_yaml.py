"""`python -m train.merge CONFIG.yml OUT_DIR`: mergekit users' common mistakes are one line each, nothing written;
the random methods are reproducible per --random-seed."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from tests.helpers import REPO
from train.core.errors import MergeError
from train.core.tensorio import load_tensors
from train.merge import kernels
from train.merge.yaml_merge import run_yaml_merge
from train.merge.yaml_plan import Plan

MODELS = REPO / "tests" / "data" / "mergekit" / "models"


def plan(cfg: dict, tmp_path) -> Plan:
    return Plan(cfg, tmp_path)


def ties(*models, **params) -> dict:
    return {"merge_method": "ties", "base_model": str(MODELS / "base"),
            "models": [{"model": str(m), "parameters": {"weight": 1.0, "density": 0.5, **params}} for m in models]}


def variant(tmp_path, name: str, **config) -> str:
    d = tmp_path / name
    shutil.copytree(MODELS / "a", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(d)


@pytest.mark.parametrize("make, message", [
    (lambda t: ties(MODELS / "a", t / "nope"), "no such directory"),
    (lambda t: ties(MODELS / "a", variant(t, "v", vocab_size=40)), "vocab_size 40 vs 32"),
    (lambda t: ties(MODELS / "a", variant(t, "v", vocab_size=40)), "set `tokenizer_source: base`"),
    (lambda t: {**ties(MODELS / "a"), "tokenizer_source": "union"}, "no tokenizer could be loaded"),
    (lambda t: {**ties(MODELS / "a"), "merge_method": "ram", "parameters": {"epsilon": -1}}, "epsilon = -1"),
    (lambda t: ties(MODELS / "a", variant(t, "m", model_type="mistral", architectures=["MistralForCausalLM"])),
     "different architectures"),
    (lambda t: {"merge_method": "linear", "models": [{"model": str(MODELS / "a"), "parameters": {"weight": 1}},
                                                     {"model": str(MODELS / "deep"), "parameters": {"weight": 1}}]},
     "layer counts differ"),
    (lambda t: ties(MODELS / "a", MODELS / "b", density=1.5), "density = 1.5"),
    (lambda t: ties(MODELS / "a", MODELS / "b", weight="x"), "must be a finite number"),
    (lambda t: {**ties(MODELS / "a"), "merge_method": "magic"}, "is not one of"),
    (lambda t: {**ties(MODELS / "a"), "modules": {}}, "key 'modules'"),
    (lambda t: {**ties(MODELS / "a"), "tokenizer_source": "base", "tokenizer": {}}, "give one of them"),
    (lambda t: {**ties(MODELS / "a"), "tokenizer": {"tokens": {"X": {"source": {"kind": "magic"}}}}},
     "tokenizer.tokens['X']: source must be"),
    (lambda t: {**ties(MODELS / "a"), "tokenizer": {"pad_to_multiple_of": 0}}, "pad_to_multiple_of 0"),
    (lambda t: {**ties(MODELS / "a"), "typo": 1}, "unknown key 'typo'"),
    (lambda t: ties(MODELS / "a", desnity=0.3), "['desnity'] are not ties's"),
    (lambda t: {"merge_method": "slerp", "base_model": str(MODELS / "a"), "parameters": {"t": 0.5},
                "models": [{"model": str(MODELS / m)} for m in "abc"]}, "exactly 2 inputs"),
    (lambda t: {"merge_method": "linear", "models": [{"model": str(MODELS / "a")}]}, "missing required parameter"),
    (lambda t: {**ties(MODELS / "a"), "chat_template": "chatmI"}, "one of alpaca, chatml, exaone, llama3"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, make, message):
    out = tmp_path / "out"
    with pytest.raises(MergeError) as e:
        run_yaml_merge(plan(make(tmp_path), tmp_path), out)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_cli_prints_one_line_and_exits_2(tmp_path):
    cfg = tmp_path / "bad.yml"
    cfg.write_text(yaml.safe_dump(ties(MODELS / "a", MODELS / "b", density=2)))
    r = subprocess.run([sys.executable, "-m", "train.merge", str(cfg), str(tmp_path / "out")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "density" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["dare_ties", "dare_linear", "della", "della_linear"])
def test_random_methods_reproducible_by_seed(tmp_path, method):
    cfg = {"merge_method": method, "base_model": str(MODELS / "base"),
           "models": [{"model": str(MODELS / m), "parameters": {"weight": 0.5, "density": 0.5}} for m in "ab"]}
    outs = []
    for i, seed in enumerate((1, 1, 2)):
        run_yaml_merge(plan(cfg, tmp_path), tmp_path / str(i), seed=seed)
        outs.append(load_tensors(tmp_path / str(i) / "model.safetensors"))
    k = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(outs[0][k], outs[1][k]) and not torch.equal(outs[0][k], outs[2][k])


def test_della_keeps_by_rank_and_dare_by_density():
    """DELLA's keep probability rises with |δ|'s rank in its row (density ± ε); DARE keeps ≈ density, L1 kept."""
    g = torch.Generator().manual_seed(0)
    delta = torch.randn(200, 400, generator=g)
    kept = kernels.sparsify(delta, "della", 0.5, False, epsilon=0.2, generator=g) != 0
    ranks = delta.abs().argsort(1).argsort(1)
    low, high = kept[ranks < 40].float().mean(), kept[ranks >= 360].float().mean()
    assert abs(float(low) - 0.32) < 0.02 and abs(float(high) - 0.68) < 0.02
    dare = kernels.sparsify(delta, "random", 0.3, True, generator=g)
    assert abs(float((dare != 0).float().mean()) - 0.3) < 0.01
    assert torch.isclose(dare.abs().sum(), delta.abs().sum(), rtol=1e-4)


def union(**extra) -> dict:
    return {"merge_method": "ties", "base_model": str(MODELS / "vbase"), "tokenizer_source": "union",
            "models": [{"model": str(MODELS / m), "parameters": {"weight": 0.5, "density": 0.7}} for m in ("va", "vb")],
            **extra}


def test_union_output_loads_and_runs_in_transformers(tmp_path):
    """The tokenizer_source merge is a working HF model: its tokenizer knows every model's tokens, its embeddings
    have one row per token, config.json says so, and the named chat template is in tokenizer_config.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.merge.chat_templates import CHAT_TEMPLATES
    run_yaml_merge(plan(union(chat_template="chatml"), tmp_path), tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert model.config.vocab_size == len(tok) == 33 and model.get_input_embeddings().weight.shape[0] == 33
    ids = tok("a z C D A", return_tensors="pt").input_ids
    assert ids.shape[1] == 5 and tok.unk_token_id not in ids[0].tolist()
    assert torch.isfinite(model(ids).logits).all()
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"] == \
        CHAT_TEMPLATES["chatml"]
    text = tok.apply_chat_template([{"role": "user", "content": "a b"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\na b<|im_end|>\n<|im_start|>assistant\n"


def test_tied_embeddings_are_remapped_once(tmp_path):
    """Models that tie lm_head to embed_tokens: the output has no lm_head, and its embed_tokens rows are the
    untied merge's (a row's sources do not depend on lm_head)."""
    from safetensors.torch import save_file
    refs = {}
    for m in ("vbase", "va", "vb"):
        d = tmp_path / m
        shutil.copytree(MODELS / m, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
        sd = load_tensors(d / "model.safetensors")
        del sd["lm_head.weight"]
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
        refs[m] = str(d)
    cfg = union()
    cfg["base_model"] = refs["vbase"]
    for e, m in zip(cfg["models"], ("va", "vb")):
        e["model"] = refs[m]
    run_yaml_merge(plan(cfg, tmp_path), tmp_path / "tied")
    run_yaml_merge(plan(union(), tmp_path), tmp_path / "untied")
    tied, untied = (load_tensors(tmp_path / d / "model.safetensors") for d in ("tied", "untied"))
    assert "lm_head.weight" not in tied and tied["model.embed_tokens.weight"].shape[0] == 33
    assert torch.equal(tied["model.embed_tokens.weight"], untied["model.embed_tokens.weight"])


def test_named_chat_templates_render_as_mergekits():
    """Each named template renders the pinned conversations (scripts/mergekit_reference.py) as mergekit's file of
    that name does through apply_chat_template, raising where it raises."""
    sys.path.insert(0, str(REPO / "scripts"))
    from mergekit_reference import CONVERSATIONS, LETTERS, render, tiny_tokenizer

    from train.merge.chat_templates import CHAT_TEMPLATES
    want = json.loads((REPO / "tests" / "data" / "mergekit" / "expected" / "chat_templates.json").read_text())
    assert sorted(want) == sorted(CHAT_TEMPLATES)
    tok = tiny_tokenizer(list(LETTERS), [])
    for name, tpl in CHAT_TEMPLATES.items():
        got = [render(tok, tpl, c, g) for c in CONVERSATIONS for g in (False, True)]
        assert got == want[name], name
