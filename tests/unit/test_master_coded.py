"""The outer step with a dense codec taken segment by segment (OuterMaster._step_coded, issue #38) against the
whole-tensor way (_step, the update written after, θ + decode(u), θ's checksum): the same update file bytes, the
same commit fields, θ_{r+1}, momentum and residual bit for bit, over rounds that start, carry and checkpoint the
state — with segments far smaller than the tensors (so a tensor spans many, and a partial last block ends one) —
and a resume that replays those rounds from the deltas accepts every update as its own."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_config
from tests.helpers.master import master_at_round_0, two_deltas
from train.config import build_config
from train.core.tensorio import load_tensors
from train.exchange import master as master_mod
from train.exchange.master import OuterMaster
from train.exchange.protocol import commit
from train.exchange.store import DiLoCoPaths

ROUNDS = 4  # checkpoints at rounds 2 and 4 (checkpoint_every 2, the last)


def _run(root, codec: str, streamed: bool, monkeypatch, block: int = 128) -> tuple[list, OuterMaster, DiLoCoPaths]:
    cfg = build_config(tiny_config(root, outer={"compression": codec, "checkpoint_every": 2, "rounds": ROUNDS,
                                                "num_workers": 2, "block_size": block}))
    if streamed:  # segments of 256 values (two int8 blocks; fewer, whole pairs of blocks, for a block that does not
        # divide it): every tensor of the micro model spans several
        monkeypatch.setattr(master_mod, "CODED_SEGMENT", 256)
    else:
        monkeypatch.setattr(OuterMaster, "streams_coded", lambda self, r: False)
    m, paths, names = master_at_round_0(cfg, ROUNDS)
    out = []
    for r in range(ROUNDS):
        acc = two_deltas(m, paths, r, names)
        fields = m.step(r, acc)
        commit(paths, r + 1, {"workers": [0, 1], **{k: fields[k] for k in ("update_sha256", "theta_sha256", "codec",
                                                                           "checkpoint")}})
        state = paths.outer_state(r + 1)
        out.append({"fields": fields, "update": paths.update_file(r + 1).read_bytes(),
                    "theta": {k: v.clone() for k, v in m.theta.tensors.items()},
                    "momentum": {k: v.clone() for k, v in m.momentum.items()},
                    "residual": {k: v.clone() for k, v in m.residual.error.items()},
                    "state": state.read_bytes() if state.is_file() else None})
    return out, m, paths


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch-ops"])
@pytest.mark.parametrize("codec,block", [("int8", 128), ("int4", 128), ("bfloat16", 128), ("int8", 12), ("int4", 10)])
def test_segments_equal_the_whole_tensor_step(tmp_path, monkeypatch, caplog, codec, block, fused):
    """The segments with the fused kernel (train/exchange/fused.py, a block codec; a cast always takes torch's ops)
    and with torch's ops (EDT_FUSED=0) against the whole-tensor way."""
    if fused:
        pytest.importorskip("numba")
    with monkeypatch.context() as mp:
        whole, _, _ = _run(tmp_path / "whole", codec, False, mp, block)
    with monkeypatch.context() as mp:
        if not fused:
            mp.setenv("EDT_FUSED", "0")
        seg, m, paths = _run(tmp_path / "seg", codec, True, mp, block)
        assert m.streams_coded(0)
        if m.codec.quantised:  # 256 values, or the most whole pairs of blocks under it (240 for both)
            assert m.coded_segment() == 256 // (2 * block) * 2 * block
    sizes = [v.numel() for v in seg[0]["theta"].values()]
    assert max(sizes) > 3 * 256 and any(n % block for n in sizes)  # many segments; a partial last block
    for r, (a, b) in enumerate(zip(whole, seg)):
        assert a["fields"] == b["fields"], r
        assert a["update"] == b["update"], r
        assert a["state"] == b["state"], r  # checkpoint rounds (2, the last): momentum + residual, the same bytes
        for key in ("theta", "momentum", "residual"):
            assert a[key].keys() == b[key].keys()
            for k in a[key]:
                assert torch.equal(a[key][k], b[key][k]), (r, key, k)
                assert a[key][k].shape == b[key][k].shape, (r, key, k)
    assert [o["fields"]["checkpoint"] for o in whole] == [False, True, False, True]
    # the global model written at the last round is θ_{r+1} as computed
    g = load_tensors(paths.global_dir(ROUNDS) / "model.safetensors")
    assert all(torch.equal(g[k], seg[-1]["theta"][k]) for k in g)
    # a restart at round 3 replays round 2 from checkpoint 2's files and its deltas: the update it re-encodes the
    # whole-tensor way is the committed one (a differing checksum is logged and the committed update taken instead)
    again = OuterMaster(paths, m.oc, ROUNDS)
    with caplog.at_level("WARNING", logger="coordinator"):
        again.resume(3)
    assert "different update" not in caplog.text
    for key, mine in (("theta", again.theta.tensors), ("momentum", again.momentum), ("residual", again.residual.error)):
        assert all(torch.equal(mine[k], seg[2][key][k]) for k in seg[2][key]), key
