"""EvoMerge on a worker: mutation by SFT on the DNA's data mix, then fitness by task evaluation.

One job (a merged child, or a fine-tune of generation 0):
  1. SFT: `steps` AdamW steps (full fine-tuning, or LoRA merged back when evomerge.lora is set) on batches drawn
     from evomerge.datasets with the DNA's mix weights, at the DNA's learning rate (warmup + cosine inside the
     mutation); the member slot's sample position continues across generations, so nothing is replayed.
  2. Fitness: every member is scored on the SAME fixed held-out items of each task in evomerge.tasks (greedy
     exact match, held-out SFT loss, or a user function); `eval_loss` is the held-out SFT loss on the answers of
     all tasks' items (what `edt.fitness = inverse_loss` ranks by). With evomerge.lm_eval, the member is also
     scored by lm-evaluation-harness tasks in process (train/evomerge/lm_eval_fitness.py: `lm_eval_fitness`).
Items come from the eval split (disjoint from training by construction, train/evomerge/tasks.py) with the run's seed.

No evaluation is spent twice on the same weights: an elite is carried unchanged (no merge, no SFT), so its weights
are its parent's bit for bit, and generation 0's slots beyond the fine-tunes are copies of them. Scoring is
deterministic on fixed items, so when the job's manifest and an earlier result.json agree on the weights' checksum
the worker takes those scores (`carried_from` in result.json and the lineage). bench/evomerge_peers.py measured the
waste before: at population 6 with 3 fine-tunes, 6 of 24 evaluations went to models already scored (3 copies in
generation 0, one elite per later generation).
"""
from __future__ import annotations

import time

import torch

from train.config import RunConfig
from train.core.store import MANIFEST
from train.evomerge.sft import SFTMixture, ensure_chat_template, train_sft
from train.evomerge.task_eval import TaskSpec, eval_sft_loss, evaluate_tasks, fixed_items
from train.evomerge.tasks import load_items


def load_sft_tokenizer(cfg: RunConfig):
    """model.tokenizer when set, else the first fine-tune's own tokenizer; with a chat template."""
    from transformers import AutoTokenizer

    from train.evomerge.breeding import local_model_dir
    from train.core.model import load_tokenizer

    if cfg.model.tokenizer:
        tok = load_tokenizer(cfg)
    else:
        tok = AutoTokenizer.from_pretrained(str(local_model_dir(cfg, cfg.edt.initial_population[0])),
                                            trust_remote_code=cfg.model.trust_remote_code)
    return ensure_chat_template(tok)


def task_specs(cfg: RunConfig) -> list[TaskSpec]:
    em = cfg.evomerge
    return [TaskSpec(name=t["name"], data=t["data"], metric=t.get("metric", "exact_match"),
                     weight=float(t.get("weight", 1.0)), items=int(t.get("items", 64)),
                     max_new_tokens=em.max_new_tokens, max_length=em.max_length) for t in em.tasks]


class EvoMergeMutation:
    """The worker's mutation + evaluation in evomerge mode (the counterpart of edt_worker.PretrainMutation)."""

    def __init__(self, cfg: RunConfig, device: torch.device):
        em = cfg.evomerge
        self.cfg, self.device = cfg, device
        self.tokenizer = load_sft_tokenizer(cfg)
        self.sources = {name: load_items(src, em.sft_items, "train", cfg.seed) for name, src in em.datasets.items()}
        self.specs = task_specs(cfg)
        self.items = fixed_items(self.specs, cfg.seed)  # the same held-out items for every member, loaded once
        # eval_loss: the answers of every task's held-out items (what edt.fitness = inverse_loss ranks by)
        self.loss_items = [it for s in self.specs for it in self.items[s.name]]
        self.lm_eval = None  # evomerge.lm_eval: lm-evaluation-harness tasks, names and metrics checked here
        if em.lm_eval:
            from train.evomerge.lm_eval_fitness import LMEvalFitness
            self.lm_eval = LMEvalFitness.from_config(cfg)

    def carried(self, job: dict, g: int, m: int) -> dict | None:
        """An evaluation of these very weights, when one exists, else None: an elite's parent's, or (generation 0,
        whose extra slots are copies of the fine-tunes) a member of generation 0 already scored; checksums agree."""
        from train.core.model import WEIGHTS
        from train.core.store import read_json
        from train.edt.store import EDTPaths

        genome = job.get("genome") or {}
        if int(job["steps"]) or not (genome.get("elite") and genome.get("parents") or g == 0):
            return None
        paths = EDTPaths(self.cfg.run_dir)
        try:
            mine = read_json(paths.job_dir(g, m) / MANIFEST)["files"][WEIGHTS]["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if g == 0:  # the members of generation 0 published so far (a copy's twin may still be running: evaluate)
            found = [(f"g000000/m{k:03d}", paths.result(0, k)) for k in range(m)]
        else:
            parent = genome["parents"][0]
            found = [(parent["id"], paths.root / parent["path"] / "result.json")]
        for pid, path in found:
            try:
                prev = read_json(path)
            except (OSError, ValueError):
                continue  # not published, or gone: evaluate
            if prev.get("weights_sha256") == mine and prev.get("scores") is not None:
                keep = ("eval_loss", "scores", "task_fitness", "lm_eval_fitness")
                return {**{k: prev[k] for k in keep if k in prev}, "carried_from": pid}
        return None

    def __call__(self, model, job: dict, g: int, m: int, on_step, tmp) -> dict:
        cfg, em = self.cfg, self.cfg.evomerge
        steps, hyper = int(job["steps"]), job["hyper"]
        same = self.carried(job, g, m)
        if same is not None:  # an elite: the parent's scores, no evaluation spent
            return {"train_loss": None, "tokens": 0, "position": {"sft": int(job["position"].get("sft", 0))},
                    **same, "train_seconds": 0.0, "eval_seconds": 0.0, "bytes_read": 0, "bytes_written": 0}
        position = int(job["position"].get("sft", 0))
        stats = {"train_loss": None, "tokens": 0, "seconds": 0.0, "position": position}
        if steps:
            mixture = SFTMixture(self.sources, hyper["mix"], self.tokenizer, em.max_length,
                                 seed=cfg.seed * 1_000_003 + m, position=position)
            stats = train_sft(model, mixture, steps, float(hyper["inner_lr"]),
                              batch_size=cfg.inner.per_device_batch_size,
                              warmup=min(cfg.inner.warmup_steps, steps // 5), min_lr_ratio=cfg.inner.min_lr_ratio,
                              weight_decay=cfg.inner.weight_decay, grad_clip=cfg.inner.grad_clip, device=self.device,
                              precision=cfg.inner.precision, lora=em.lora or None, on_step=on_step)
        t0 = time.perf_counter()
        model.eval()
        ev = evaluate_tasks(model, self.tokenizer, self.specs, seed=cfg.seed, batch_size=cfg.eval.batch_size,
                            items=self.items)
        eval_loss = eval_sft_loss(model, self.tokenizer, self.loss_items, batch_size=cfg.eval.batch_size,
                                  max_length=em.max_length)
        scores, extra = dict(ev["scores"]), {}
        if self.lm_eval is not None:  # scores gain task/metric keys; edt.fitness = lm_eval reads lm_eval_fitness
            le = self.lm_eval(model, self.tokenizer)
            scores.update(le["scores"])
            extra = {"lm_eval_fitness": le["fitness"], "lm_eval_seconds": le["seconds"]}
        return {"eval_loss": eval_loss, "train_loss": stats["train_loss"], "tokens": stats["tokens"],
                "position": {"sft": stats["position"]}, "scores": scores, "task_fitness": ev["fitness"], **extra,
                "train_seconds": stats["seconds"], "eval_seconds": time.perf_counter() - t0,
                "bytes_read": 0, "bytes_written": 0}
