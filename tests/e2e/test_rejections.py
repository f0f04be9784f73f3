"""Every bad delta is rejected with its reason and never touches the global model."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import tiny_config
from train.config import build_config
from train.diloco.coordinator import Coordinator
from train.exchange.layout import Layout
from train.exchange.outer import diloco_round
from train.core.store import PROTOCOL_VERSION, atomic_write_json, read_json
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import load_tensors, save_streaming


def _publish(paths: DiLoCoPaths, r: int, w: int, tensors: dict, **meta_over):
    f = paths.delta_file(r, w)
    sha = save_streaming(f, tensors)
    off, n = Layout.load(paths).slice(r, w)  # the slice of the data layout this delta says it was trained on
    meta = {"protocol": PROTOCOL_VERSION, "round": r, "worker": w, "inner_steps": 5, "tokens": 1000, "loss": 3.0,
            "sha256": sha, "bytes": f.stat().st_size, "dtype": "float32",
            "data": {"segment": 0, "offset": off, "windows": n, "read": n}}
    meta.update(meta_over)
    atomic_write_json(paths.delta_meta(r, w), meta)


def _good_delta(theta, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in theta.items()}


def _corrupt(case, theta, paths):
    d = _good_delta(theta, 99)
    name = next(iter(d))
    if case == "wrong_round":
        return d, {"round": 5}, "sidecar says round 5, expected 0"
    if case == "wrong_worker":
        return d, {"worker": 0}, "sidecar says worker 0, file belongs to worker 2"
    if case == "wrong_shape":
        d[name] = torch.zeros(3, 3)
        return d, {}, f"{name}: shape [3, 3]"
    if case == "wrong_dtype":
        d[name] = d[name].to(torch.float16)
        return d, {}, f"{name}: dtype F16, expected F32"
    if case == "nan":
        d[name][0] = float("nan")
        return d, {}, "non-finite values"
    if case == "missing_tensor":
        d.pop(name)
        return d, {}, "tensor names differ"
    if case == "zero_tokens":
        return d, {"tokens": 0}, "tokens = 0"
    raise AssertionError(case)


CASES = ["wrong_round", "wrong_worker", "wrong_shape", "wrong_dtype", "nan", "missing_tensor", "zero_tokens",
         "checksum", "size"]


@pytest.mark.parametrize("case", CASES)
def test_rejected_delta_never_touches_the_global_model(tmp_path, case, caplog):
    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000},
                                   outer={"num_workers": 3, "min_workers": 2}, logging={"progress": False}))
    co = Coordinator(cfg, progress=False)
    co.setup()
    paths = co.paths
    theta = load_tensors(paths.global_dir(0) / "model.safetensors")
    good = [_good_delta(theta, 0), _good_delta(theta, 1)]
    _publish(paths, 0, 0, good[0])
    _publish(paths, 0, 1, good[1], tokens=3000)
    if case in ("checksum", "size"):
        bad = _good_delta(theta, 7)
        _publish(paths, 0, 2, bad)
        f = paths.delta_file(0, 2)
        raw = bytearray(f.read_bytes())
        if case == "checksum":
            raw[-3] ^= 0xFF  # same size, one flipped byte: only the sha256 can tell
            reason = "checksum of the file differs"
        else:
            raw += b"\0" * 8
            reason = "bytes, sidecar says"
        f.write_bytes(bytes(raw))
    else:
        bad, over, reason = _corrupt(case, theta, paths)
        _publish(paths, 0, 2, bad, **over)

    with caplog.at_level("ERROR"):
        rec = co.run_round(0)
    assert rec["workers_used"] == [0, 1]
    assert reason in rec["rejected"]["w002"]
    assert reason in caplog.text
    committed = read_json(paths.committed(1))
    assert reason in committed["rejected"]["w002"]
    # θ_1 is exactly the outer step over the two valid deltas (token-weighted 1000:3000)
    want, _ = diloco_round(theta, good, [1000, 3000], None, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov)
    got = load_tensors(paths.global_dir(1) / "model.safetensors")
    for k in theta:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_too_few_valid_deltas_stops_with_a_clear_error(tmp_path):
    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000},
                                   outer={"num_workers": 2, "min_workers": 2}))
    co = Coordinator(cfg, progress=False)
    co.setup()
    theta = load_tensors(co.paths.global_dir(0) / "model.safetensors")
    _publish(co.paths, 0, 0, _good_delta(theta, 0))
    _publish(co.paths, 0, 1, _good_delta(theta, 1), round=3)
    with pytest.raises(RuntimeError, match=r"only 1 valid deltas \(min_workers = 2\).*resumes here"):
        co.run_round(0)
    assert co.paths.latest_committed() == 0


def test_timeout_goes_on_with_min_workers_and_names_the_missing(tmp_path, caplog):
    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000},
                                   outer={"num_workers": 3, "min_workers": 2, "round_timeout_s": 0.5}))
    co = Coordinator(cfg, progress=False)
    co.setup()
    theta = load_tensors(co.paths.global_dir(0) / "model.safetensors")
    _publish(co.paths, 0, 0, _good_delta(theta, 0))
    _publish(co.paths, 0, 2, _good_delta(theta, 2))
    with caplog.at_level("WARNING"):
        rec = co.run_round(0)
    assert rec["missing"] == [1] and rec["workers_used"] == [0, 2]
    assert "missing workers [1]" in caplog.text
    assert json.loads(co.paths.committed(1).read_text())["missing"] == [1]


# -- the sparse exchange (outer.compression = topk): bad index blocks, another density --------------------------------
def _sparse_coordinator(tmp_path):
    outer = {"num_workers": 3, "min_workers": 2, "compression": "topk", "density": 0.05, "chunk_size": 100,
             "round_timeout_s": 0.5}
    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000}, outer=outer,
                                   logging={"progress": False}))
    co = Coordinator(cfg, progress=False)
    co.setup()
    return co


def _publish_sparse(co, w, seed, corrupt=None):
    import hashlib

    from train.exchange.protocol import delta_sidecar, publish_sidecar, write_delta
    from train.exchange.sparse import IDX, SparseCodec, pack_bits, unpack_bits

    paths, theta, codec = co.paths, co.master.theta.tensors, co.master.delta_codec
    g = torch.Generator().manual_seed(seed)
    params = {k: v - torch.randn(v.shape, generator=g) * 1e-3 for k, v in theta.items()}
    f = paths.delta_file(0, w)
    if corrupt == "wrong_density":
        codec = SparseCodec(density=0.1, chunk=100)
    file = write_delta(f, co.names, theta, params, codec, 0, w)
    if corrupt in ("out_of_range", "repeated", "truncated_index"):
        from safetensors.torch import load_file, save_file
        t = load_file(str(f))
        name = co.names[0]
        K = codec.count(theta[name].numel())[0]
        off = unpack_bits(t[name + IDX].numpy(), codec.ibits, K)
        if corrupt == "out_of_range":
            off[2] = 120  # 7 bits hold up to 127; the chunk has 100 values
        elif corrupt == "repeated":
            off[1] = off[0]
        t[name + IDX] = torch.from_numpy(pack_bits(off, codec.ibits))
        if corrupt == "truncated_index":
            t[name + IDX] = t[name + IDX][:-2]
        save_file(t, str(f), metadata=codec.metadata())
        file.update(sha256=hashlib.sha256(f.read_bytes()).hexdigest(), bytes=f.stat().st_size)
    side = delta_sidecar(0, w, file, inner_steps=5, tokens=1000 * (w + 1), loss=3.0)
    off, n = co.layout.slice(0, w)
    side["data"] = {"segment": 0, "offset": off, "windows": n, "read": n}
    publish_sidecar(paths, side)


@pytest.mark.parametrize("case,reason", [("out_of_range", "index is out of range"),
                                         ("repeated", "indices repeat or are out of order"),
                                         ("wrong_density", "declares density 0.1, the run uses 0.05"),
                                         ("truncated_index", "index block of shape")])
def test_bad_sparse_delta_is_rejected_and_every_copy_of_theta_untouched(tmp_path, case, reason):
    from train.exchange.sparse import sparse_step
    from train.exchange.theta import GlobalTheta, theta_checksum

    co = _sparse_coordinator(tmp_path)
    theta0 = {k: v.clone() for k, v in co.master.theta.tensors.items()}
    _publish_sparse(co, 0, 0)
    _publish_sparse(co, 1, 1)
    _publish_sparse(co, 2, 2, corrupt=case)
    rec = co.run_round(0)
    assert rec["workers_used"] == [0, 1] and reason in rec["rejected"]["w002"], rec["rejected"]
    # θ_1 = θ_0 − lr · the token-weighted (1000 : 2000) mean of the two good sparse deltas, decoded from their files
    acc = co.master.new_accumulator(0)
    for w in (0, 1):
        from train.exchange.protocol import check_sidecar
        acc.add(w, check_sidecar(co.paths, 0, w, co.master.delta_codec))
    want = {n: sparse_step(theta0[n], acc.mean(n), co.cfg.outer.lr) for n in co.names}
    assert all(torch.equal(co.master.theta.tensors[n], want[n]) for n in co.names)
    committed = read_json(co.paths.committed(1))
    assert committed["theta_sha256"] == theta_checksum(want, co.names) and "update_sha256" not in committed
    # a worker's copy, built from the files alone (θ_0 + the accepted sparse deltas), has the same bits
    copy = GlobalTheta(co.paths, co.master.codec)
    copy.advance_to(1)
    assert all(torch.equal(copy.tensors[n], want[n]) for n in co.names)
