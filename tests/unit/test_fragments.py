"""Streaming DiLoCo's fragments (train/exchange/fragments.py) and its keys' checks (outer.fragments,
fragment_delay, fragment_mix): the split, the schedule, the pieces' views and writes, the one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, tiny_config
from train.config import build_config
from train.core.errors import ConfigError
from train.exchange.fragments import Fragments

LLAMA4 = {"model.embed_tokens.weight": (2048, 32),
          **{f"model.layers.{i}.{k}": s for i in range(4)
             for k, s in (("self_attn.q_proj.weight", (32, 32)), ("mlp.up_proj.weight", (86, 32)),
                          ("input_layernorm.weight", (32,)))},
          "model.norm.weight": (32,)}


def numel(shape) -> int:
    return int(torch.Size(shape).numel())


@pytest.mark.parametrize("P", [1, 2, 4])
def test_every_value_is_in_exactly_one_fragment_and_sizes_are_even(P):
    fr = Fragments(LLAMA4, P)
    total = sum(numel(s) for s in LLAMA4.values())
    assert sum(fr.numel(p) for p in range(P)) == total
    # the strided block split: fragment p holds blocks p, p + P, ...; rows of the embedding spread over all
    for p in range(P):
        blocks = {int(k.split(".")[2]) for k in fr.pieces(p) if ".layers." in k}
        assert blocks == set(range(p, 4, P))
        assert fr.numel(p) <= 1.1 * total / P
    assert "model.norm.weight" in fr.pieces(P - 1)
    # the schedule: round r syncs fragment r mod P
    assert [fr.of_round(r) for r in range(2 * P)] == list(range(P)) * 2


def test_pieces_are_views_and_put_never_writes_into_a_held_tensor():
    fr = Fragments(LLAMA4, 4)
    t = {n: torch.randn(s) for n, s in LLAMA4.items()}
    held = t["model.embed_tokens.weight"]
    before = held.clone()
    piece = "model.embed_tokens.weight[512:1024]"
    assert piece in fr.pieces(1) and fr.shapes(1)[piece] == (512, 32)
    assert torch.equal(fr.get(t, piece), held[512:1024])
    fr.put(t, piece, torch.zeros(512, 32))
    assert torch.equal(held, before)  # a copy was changed, not the tensor a worker or the evaluation may hold
    assert torch.equal(t["model.embed_tokens.weight"][512:1024], torch.zeros(512, 32))
    assert torch.equal(t["model.embed_tokens.weight"][:512], before[:512])
    v = fr.view(1, t)
    assert set(v) == set(fr.pieces(1)) and Fragments(LLAMA4, 1).view(0, t) is t


def test_more_fragments_than_blocks_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"outer.fragments = 5: the model has 4 transformer blocks.*<= 4"):
        Fragments(LLAMA4, 5)


@pytest.mark.parametrize("sets, match", [
    (["outer.fragments=4", "outer.local_steps=10"], r"outer.fragments = 4: must divide outer.local_steps = 10"),
    (["outer.fragments=4", "outer.local_steps=8", "outer.fragment_delay=2"],
     r"outer.fragment_delay = 2: must be below outer.local_steps / outer.fragments = 2"),
    (["outer.fragment_mix=1.5"], r"outer.fragment_mix = 1.5: must be <= 1"),
    (["outer.fragment_mix=-0.1"], r"outer.fragment_mix = -0.1: must be >= 0"),
    (["outer.fragments=2", "outer.local_steps=8", "outer.overlap=eager"], r"outer.overlap = \"eager\": does not "
                                                                          r"combine with streaming DiLoCo"),
    (["outer.fragments=2", "outer.local_steps=8", "outer.local_steps_schedule=[[0, 8], [4, 16]]"],
     r"outer.local_steps_schedule .*not supported with outer.fragments > 1"),
    (["outer.fragments=2", "outer.local_steps=8", "inner.nproc_per_node=2", "inner.total_batch_size=32"],
     r"torchrun workers"),
])
def test_bad_streaming_keys_are_refused(sets, match):
    with pytest.raises(ConfigError, match=match):
        build_config({}, sets)


def test_rounds_are_h_over_p_steps():
    cfg = build_config({}, ["outer.fragments=4", "outer.local_steps=8", "outer.rounds=12", "outer.fragment_delay=1"])
    assert cfg.outer.round_steps_at(5) == 2 and cfg.total_inner_steps == 24 and cfg.outer.streaming
    assert not build_config({}, []).outer.streaming  # the default is DiLoCo


def test_more_fragments_than_blocks_stops_the_run_with_one_line(tmp_path):
    cfg = tiny_config(tmp_path / "runs", outer={"fragments": 3, "local_steps": 6})  # micro-llama: 2 blocks
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, "diloco.py", "--config", str(path)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [x for x in out.stderr.splitlines() if "outer.fragments = 3" in x]
    assert lines and "2 transformer blocks" in lines[0] and "Traceback" not in out.stderr
