"""Run a planned mergekit YAML (train.merge.yaml_plan) into an HF model directory, streaming tensor by tensor.

linear, slerp, task_arithmetic, ties and dare_* (with mergekit's default `rescale`) run on the chunked kernels of
train.merge.methods straight from the files (the EvoMerge code path: memory stays near one output tensor); every other
method reads its inputs' tensor whole, as float32, and runs train.merge.kernels. `dtype` rounds every input to that
dtype first (mergekit loads them so); arithmetic is float32. The output has `out_dtype`, else `dtype`, else the first
input's dtype; model.safetensors + config.json (the base model's, else the first model's, with the output layer
count) + the donor's tokenizer files, then MANIFEST.json, then one atomic rename: a failed merge leaves no OUT_DIR.
With tokenizer_source (train.merge.vocab) the embeddings are remapped onto the built tokenizer's vocabulary (whole
tensors) and that tokenizer is written instead of the donor's files.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from train.core.errors import MergeError
from train.core.store import atomic_publish_dir, new_tmp_dir, write_manifest
from train.core.tensorio import StreamingWriter
from train.merge import kernels
from train.merge.methods import Recipe, merge_tensor, tensor_seed
from train.core.threads import intra_op_threads
from train.merge.stream import _all_finite
from train.merge.yaml_plan import GTA, OutTensor, Plan

DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
CHUNKED = ("linear", "slerp", "task_arithmetic", "ties", "dare_linear", "dare_ties")


def _source(files, name: str, dtype: torch.dtype | None):
    src = files.source(name)
    if dtype is None or dtype == torch.float32:
        return src
    return lambda s, e: src(s, e).to(dtype).to(torch.float32)


def _whole(files, name: str, dtype, device) -> torch.Tensor:
    _, _, shape, _, _ = files.info[name]
    numel = torch.Size(shape).numel()
    return _source(files, name, dtype)(0, numel).clone().reshape(shape).to(device)


def _recipe(method: str, ot: OutTensor, seed: int, numel: int) -> Recipe | None:
    """The train.merge.methods Recipe that equals mergekit for this tensor, or None (use the whole-tensor kernels)."""
    sh, nb = ot.shared, [p for i, p in enumerate(ot.per_model) if i != ot.base_index]
    if method == "linear":
        return Recipe("linear", weights=tuple(float(p["weight"]) for p in ot.per_model),
                      normalize=bool(sh["normalize"]))
    if method == "slerp":
        return Recipe("slerp", t_curves={"default": float(sh["t"])})
    sparse, consensus, _, default_rescale = GTA[method]
    if bool(sh["rescale"]) != default_rescale or (method == "ties" and any(int(p["density"] * numel) == 0
                                                                             for p in nb if p["density"] < 1)):
        return None  # mergekit ≥ 0.1.5 keeps max(1, k) entries where train.merge.methods refuses k = 0
    return Recipe(method, weights=tuple(float(p["weight"]) for p in nb),
                  density=tuple(float(p["density"]) for p in nb), normalize=bool(sh["normalize"]),
                  lambda_=float(sh["lambda"]), seed=seed, consensus_method=consensus)


def merge_one(plan: Plan, ot: OutTensor, seed: int, device: str, out_dtype: torch.dtype) -> torch.Tensor:
    method, sh = plan.method_name, ot.shared
    dtype = None if plan.dtype is None else DT[plan.dtype]
    files0, name0 = ot.inputs[0][0].files, ot.inputs[0][1]
    _, _, shape, _, _ = files0.info[name0]
    numel = torch.Size(shape).numel()
    recipe = _recipe(method, ot, seed, numel) if method in CHUNKED and device == "cpu" and not ot.vocab else None
    if recipe is not None:
        srcs = [_source(s.files, n, dtype) for s, n in ot.inputs]
        base = None
        if ot.base_index is not None:
            base = srcs.pop(ot.base_index)
        if method == "slerp":  # mergekit: t = 0 is the base
            srcs = [base, srcs[0]]
        return merge_tensor(recipe, ot.name, srcs, base, numel, shape, out_dtype, plan.num_layers)
    xs = [_whole(s.files, n, dtype, device) for s, n in ot.inputs]
    if ot.vocab:
        xs = plan.vocab.remap(xs, [s.ref for s, _ in ot.inputs], ot.vocab_base)
    base = None if ot.base_index is None else xs[ot.base_index]
    others = [x for i, x in enumerate(xs) if i != ot.base_index]
    nb = [p for i, p in enumerate(ot.per_model) if i != ot.base_index]
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, ot.name))
    if method in GTA:
        sparse, consensus, _, _ = GTA[method]
        out = kernels.gta(base, others, [float(p["weight"]) for p in nb], [float(p["density"]) for p in nb],
                          sparsification=sparse, consensus=consensus, normalize=bool(sh["normalize"]),
                          rescale=bool(sh["rescale"]), lambda_=float(sh["lambda"]),
                          gammas=[float(p.get("gamma", 0.01)) for p in nb],
                          epsilons=[float(p.get("epsilon", 0.15)) for p in nb], generator=gen, name=ot.name)
    elif method == "linear":
        w = torch.tensor([float(p["weight"]) for p in ot.per_model], device=xs[0].device)
        w = w.reshape(-1, *([1] * xs[0].dim()))
        out = (torch.stack(xs) * w).sum(0)
        out = out / w.sum() if sh["normalize"] else out
    elif method == "slerp":
        others_t = [x for x in xs if x is not base]
        from train.merge.crossover import slerp
        out = slerp(float(sh["t"]), base, others_t[0])
    elif method == "nuslerp":
        out = kernels.nuslerp_merge(others, [float(p["weight"]) for p in nb], base, bool(sh["nuslerp_row_wise"]),
                                    bool(sh["nuslerp_flatten"]))
    elif method == "multislerp":
        out = kernels.multislerp(others, [float(p["weight"]) for p in nb], base, bool(sh["normalize_weights"]),
                                 float(sh["eps"]))
    elif method == "karcher":
        out = kernels.karcher(xs, int(sh["max_iter"]), float(sh["tol"]))
    elif method == "model_stock":
        out = kernels.model_stock(base, others, bool(sh["filter_wise"]))
    elif method == "sce":
        out = kernels.sce(base, others, float(sh["select_topk"]))
    elif method == "nearswap":
        out = kernels.nearswap(base, others[0], float(sh["t"]))
    elif method == "arcee_fusion":
        out = kernels.arcee_fusion(base, others[0], generator=gen)
    elif method in ("ram", "ramplus_tl"):
        out = kernels.ram(base, others, float(sh["epsilon"]), float(sh["r"]) if method == "ramplus_tl" else None,
                          float(sh.get("alpha", 0.2)))
    elif method == "passthrough":
        out = kernels.passthrough(xs[0], ot.per_model[0].get("scale"))
    else:  # pragma: no cover — yaml_plan.METHODS and this dispatch list the same names
        raise MergeError(f"merge_method {method!r} has no kernel")
    return out.to("cpu", out_dtype)


def apply_chat_template(plan: Plan, out_dir: Path) -> None:
    """chat_template: `auto` (the most common one of the inputs), one of mergekit's named templates
    (train.merge.chat_templates) or a Jinja template string, written into the output's tokenizer_config.json."""
    from train.merge.chat_templates import named_template
    tpl = plan.chat_template
    if tpl is None:
        return
    tpl = named_template(tpl) or tpl
    if tpl == "auto":
        found = []
        for m in plan.models:
            p = m.dir / "tokenizer_config.json"
            t = json.loads(p.read_text()).get("chat_template") if p.is_file() else None
            if t is None and (m.dir / "chat_template.jinja").is_file():
                t = (m.dir / "chat_template.jinja").read_text()
            if isinstance(t, list):  # named templates: mergekit takes the default one
                t = next((e.get("template") for e in t if isinstance(e, dict) and e.get("name") == "default"), None)
            if isinstance(t, str) and t.strip():
                found.append(t.strip())
        if not found:
            return
        tpl = max(found, key=found.count)
    p = out_dir / "tokenizer_config.json"
    cfg = json.loads(p.read_text()) if p.is_file() else {}
    cfg["chat_template"] = tpl
    p.write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def run_yaml_merge(plan: Plan, out_dir: Path, *, seed: int = 0, device: str = "cpu", copy_tokenizer: bool = True,
                   progress: bool = False, threads: int | None = 1) -> dict:
    """`threads`: torch intra-op threads while merging on the CPU (None: torch's setting). One, as
    merge_model_dirs: a float32 reduction (slerp's angle, DARE's norms) sums in another order with another thread
    count, so one thread is what makes this command rebuild an EvoMerge merge bit for bit (and it is not slower on
    these memory-bound kernels)."""
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    specs = {}
    for ot in plan.tensors:
        files, name = ot.inputs[0][0].files, ot.inputs[0][1]
        dt = files.info[name][1]
        want = plan.out_dtype or plan.dtype
        shape = files.info[name][2]
        if ot.vocab:
            shape = (plan.vocab.size, *shape[1:])
        specs[ot.name] = (DT[want] if want and dt.is_floating_point else dt, shape)
        if not dt.is_floating_point:
            raise MergeError(f"tensor {ot.name}: non-floating tensors ({dt}) are not supported by this command")
    donor = plan.tokenizer_donor()
    tmp = new_tmp_dir(out_dir)
    finite = True
    try:
        (tmp / "config.json").write_text(json.dumps(plan.out_config(), indent=2) + "\n")
        if (donor.dir / "generation_config.json").is_file():
            shutil.copy2(donor.dir / "generation_config.json", tmp / "generation_config.json")
        if plan.vocab is not None:  # a built tokenizer is always written, as mergekit does
            plan.vocab.save(tmp)
            apply_chat_template(plan, tmp)
        elif copy_tokenizer:
            for f in TOKENIZER_FILES:
                if (donor.dir / f).is_file():
                    shutil.copy2(donor.dir / f, tmp / f)
            apply_chat_template(plan, tmp)
        tensors = plan.tensors
        if progress:
            from tqdm import tqdm
            tensors = tqdm(tensors, desc=f"merge ({plan.method_name})", unit="tensor")
        with intra_op_threads(threads if device == "cpu" else None), \
                StreamingWriter(tmp / "model.safetensors", specs, metadata={"format": "pt"}) as w:
            for ot in tensors:
                t = merge_one(plan, ot, seed, device, specs[ot.name][0])
                finite = finite and _all_finite(t)  # chunk by chunk: isfinite(t) would double the peak
                w.write(ot.name, t)
        write_manifest(tmp, hashes={"model.safetensors": w.digest})
        atomic_publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for m in plan.models:
            m.close()
    return {"tensors": len(plan.tensors), "layers": plan.num_layers, "bytes_written": w.nbytes,
            "seconds": time.perf_counter() - t0, "finite": finite}
