"""The two modes of EDT as objects, so the coordinator and the worker never branch on `edt.mode`.

    pretrain   evolutionary pretraining: members are trained from a config or checkpoint; crossover is the
               pairwise outer step (or a linear / slerp merge) and mutation is inner AdamW steps on the member's
               shard; fitness comes from the held-out loss.
    evomerge   post-training (EvoMerge): members are merges of fine-tuned models (train/merge/methods.py);
               mutation is SFT on the DNA's data mix, fitness comes from task scores; a report closes the run.

A mode names what differs between the two: the extra run identity, the coordinator's setup, the breeding strategy
(train/edt_breed.PretrainBreeding, train/evomerge.EvoMergeBreeding), the worker's mutation, the summary line,
what happens after each generation is evaluated (EvoMerge: best_config.yaml) and after the final member is
published (EvoMerge: the report and the final best_config.yaml). Adding a mode means adding a class here and its
name to MODES.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from train.config import RunConfig
    from train.edt.store import EDTPaths


class PretrainMode:
    name = "pretrain"

    def identity(self, cfg: "RunConfig") -> dict:
        return {}  # pretraining runs keep the identity they always had

    def setup(self, coord, latest: int | None) -> None:
        coord._setup_pretrain(latest)

    def breeding(self, cfg: "RunConfig"):
        from train.edt.breed import PretrainBreeding
        return PretrainBreeding(cfg)

    def mutation(self, cfg: "RunConfig", paths: "EDTPaths", device: "torch.device"):
        from train.edt.mutate import PretrainMutation
        return PretrainMutation(cfg, paths, device)

    def evaluated(self, coord, g: int, best_id: str) -> None:
        pass

    def finish(self, coord, final_id: str) -> None:
        pass

    def summary(self, cfg: "RunConfig") -> str:
        from train.edt.breed import population_size, steps_per_mutation
        ec = cfg.edt
        return (f"{cfg.project_name}: EDT population {population_size(cfg)} x {ec.max_generations} generations x "
                f"{steps_per_mutation(cfg)} steps, {cfg.outer.num_workers} workers, crossover {ec.crossover}, "
                f"selection {ec.selection}, genes {sorted(ec.genes) or 'none'}, model {cfg.model.name} -> "
                f"{cfg.run_dir}")


class EvoMergeMode:
    name = "evomerge"

    def identity(self, cfg: "RunConfig") -> dict:
        return {"mode": "evomerge", "base_model": cfg.evomerge.base_model, "tasks": cfg.evomerge.tasks}

    def setup(self, coord, latest: int | None) -> None:
        coord._setup_evomerge(latest)

    def breeding(self, cfg: "RunConfig"):
        from train.evomerge.breeding import EvoMergeBreeding
        return EvoMergeBreeding(cfg)

    def mutation(self, cfg: "RunConfig", paths: "EDTPaths", device: "torch.device"):
        from train.evomerge.mutate import EvoMergeMutation
        return EvoMergeMutation(cfg, device)

    def evaluated(self, coord, g: int, best_id: str) -> None:
        """generations/gXXXXXX/best_config.yaml: the recipe of the generation's fittest member as mergekit YAML."""
        _best_config(coord, best_id, coord.paths.gen_dir(g) / "best_config.yaml", f"best of generation {g}")

    def finish(self, coord, final_id: str) -> None:
        coord.write_report(final_id)
        _best_config(coord, final_id, coord.paths.root / "best_config.yaml", "final model (final/)")

    def summary(self, cfg: "RunConfig") -> str:
        from train.edt.breed import population_size, steps_per_mutation
        ec, em = cfg.edt, cfg.evomerge
        mutation = f"SFT {steps_per_mutation(cfg)} steps on {sorted(em.datasets)}" if em.datasets else "none"
        return (f"{cfg.project_name}: EvoMerge of {len(set(ec.initial_population))} models, population "
                f"{population_size(cfg)} x {ec.max_generations} generations, methods {', '.join(em.merge_methods)}, "
                f"mutation: {mutation}, fitness {[t['name'] for t in em.tasks]}, {cfg.outer.num_workers} workers "
                f"-> {cfg.run_dir}" + (f"; initial recipe {em.initial_recipe}" if em.initial_recipe else ""))


MODES = {m.name: m for m in (PretrainMode(), EvoMergeMode())}


def mode_of(cfg: "RunConfig"):
    """The mode object of a run (edt.mode is validated by the config against MODES' names)."""
    return MODES[cfg.edt.mode]


def _best_config(coord, mid: str, out, what: str) -> None:
    """best_config.yaml of member `mid` (train/evomerge/mergekit_io.py), from the run's lineage."""
    from train.edt.lineage import load_lineage
    from train.evomerge.mergekit_io import write_best_config
    write_best_config(coord.cfg, coord.paths, lambda: load_lineage(coord.paths.root), mid, out, what)
