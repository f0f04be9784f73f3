"""Side by side with mergekit-evolve: EvoMerge (`edt_sim.py`, evomerge mode) and mergekit-evolve (mergekit's CMA-ES
search over merge recipes, Ray, lm-eval) on the same parents, the same fitness and the same budget, several seeds.

    python bench/evomerge_peers.py --setup       # once: runs/venv-evolve with mergekit[evolve]==0.1.5 (see below)
    python bench/evomerge_peers.py --quick       # 2 seeds x 12 evaluations per tool (<= 10 min on 2 cores)
    python bench/evomerge_peers.py               # 3 seeds x 24 evaluations per tool
    python bench/evomerge_peers.py --seeds 0 1 2 3 --evals 36 --population 6

The same in both:
  - parents: the offline demo's base + specialists (`python scripts/make_specialists.py`, runs/evomerge-models/;
    --models for another folder with base/ and the specialists). Each is loaded with transformers first; one that
    does not load is named in one line.
  - fitness: lm-evaluation-harness tasks written here over the SAME held-out items (`edt_peer_<task>`: greedy
    generation of the answer to the chat-rendered prompt, exact match; fitness = the sum over tasks, 0..3). Each
    tool scores with its own evaluator (EDT in process, fp32: train/evomerge/lm_eval_fitness.py; mergekit-evolve
    saves each merge and loads it with lm-eval's HF backend, bf16 as it hard-codes).
  - budget: candidate evaluations (EDT: every evaluation a worker made, generation 0 included; an elite or a copy
    of a fine-tune takes the scores already measured for its weights and costs none, so EDT runs as many generations
    as the budget allows; mergekit-evolve: --force-population-size = EDT's population and --max-fevals = budget -
    population, because CMA-ES (cma.fmin2) runs one more generation than max-fevals allows and then scores its mean:
    budget + 1 evaluations). Curves and bests count evaluations up to the budget; wall time on this box beside it.
  - the finalists: each tool's best model (EDT: final/; mergekit-evolve: final_model/, the merge of its
    best_config.yaml) is loaded with transformers and re-scored by ONE evaluator (ours, fp32) on other held-out items
    (`edt_final_<task>`, disjoint from the search items).
What differs, by design: EvoMerge merges pairs by an evolved method and mutates each child by SFT (30 steps on the
DNA's data mix), so it trains; mergekit-evolve searches the parameters of one fixed merge of all models at once
(`ties` with a base, per 2-layer group weights and densities) and never trains.

mergekit-evolve's environment (`--setup`, or its one-line instruction when missing): a virtual environment
runs/venv-evolve made with --system-site-packages (so torch 2.13, transformers and lm-eval 0.4.13 stay the locked
ones) holding `pip install -c requirements/lock.txt 'mergekit[evolve]==0.1.5'` (+ ray, cma, wandb; the `evolve` extra
of pyproject.toml). As shipped, mergekit-evolve 0.1.5 cannot run here, for three reasons that --setup's one .pth hook
fixes when the modules load (nothing else of mergekit, lm-eval or torch changes; SHIM below):
  - its evolve code names `lm_eval.models.vllm_causallms`; since lm-eval 0.4.10 that module loads lazily and imports
    vllm, so without vllm it dies at import (lm-eval 0.4.9.2 does not import with transformers 5, which mergekit
    0.1.5 needs): the module gets a placeholder VLLM class when vllm is absent;
  - its default evaluator calls torch.cpu.empty_cache(), which torch does not have: a no-op;
  - lm-eval's HF backend defaults to device "cuda" and mergekit-evolve passes none: "cpu" where CUDA is absent.
Ray is started here as a one-node cluster with --workers CPUs and as many logical GPUs (mergekit's actors ask for one
GPU each; the work runs on the CPU, --no-merge-cuda), HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1.
--in-memory fails in 0.1.5 (TypeError in mergekit's plan_in_memory); its default strategy (a pool of on-disk
evaluators) is used.

Bytes written: every file that appears under each tool's folder (its run dir / storage path and Ray's session
folder), largest size seen, sampled every 0.5 s (mergekit-evolve deletes each merge after evaluating it).
Writes bench/results/evomerge_peers.json and docs/img/evomerge-peers.png (--plot to put it elsewhere; --replot draws
it again from saved results).
Last line: `evomerge-peers: mergekit-evolve best B_M in N_M evals; edt best B_E in N_E evals` (the median over seeds
of the best fitness each tool found in its own evaluator, and the evaluations it took to first reach it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, save_result, table

VENV = REPO / "runs" / "venv-evolve"
PIN = "mergekit[evolve]==0.1.5"
SETUP = "python bench/evomerge_peers.py --setup"
INSTALL = (f"python -m venv --system-site-packages {VENV.relative_to(REPO)} && {VENV.relative_to(REPO)}/bin/pip "
           f"install -c requirements/lock.txt '{PIN}'")
TASKS = ("addition", "reverse", "sort")
# mergekit-evolve's scheduling (--strategy, --in-memory): pool of on-disk evaluators is its default; in-memory fails in
# 0.1.5 (TypeError: Can't instantiate abstract class Task[Tensor], in mergekit's plan_in_memory)
MK_MODES = {"in-memory": ["--strategy", "pool", "--in-memory"], "buffered": ["--strategy", "buffered"],
            "serial": ["--strategy", "serial"], "pool": ["--strategy", "pool"]}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}

# The .pth hook of --setup (see the module doc): three fixes of mergekit-evolve 0.1.5 on a CPU box without vllm, each
# applied when the module it concerns is imported in the venv's processes (the driver and every Ray worker).
SHIM = '''"""EDT bench/evomerge_peers.py: mergekit-evolve 0.1.5 on a CPU-only machine without vllm. Three fixes, each
when its module is imported; nothing else of mergekit, lm-eval or torch changes:
  lm_eval.models             also load lm_eval.models.vllm_causallms, as lm-eval <= 0.4.9 did (mergekit names it);
                             without vllm that module is a placeholder whose VLLM class refuses to be built
  lm_eval.models.huggingface HFLM's device defaults to "cuda"; mergekit passes none: "cpu" where CUDA is absent
  mergekit.evo.actors        its evaluator calls torch.cpu.empty_cache(), which torch does not have: a no-op
"""
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

NAME = "lm_eval.models.vllm_causallms"


def _load_vllm_module(module):
    importlib.import_module(NAME)


def _hflm_cpu(module):
    import torch

    init = module.HFLM.__init__

    @functools.wraps(init)
    def __init__(self, *a, **k):
        if not torch.cuda.is_available() and str(k.get("device") or "cuda").startswith("cuda"):
            k["device"] = "cpu"
        init(self, *a, **k)
    module.HFLM.__init__ = __init__


def _cpu_empty_cache(module):
    import torch

    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None


AFTER = {"lm_eval.models": _load_vllm_module, "lm_eval.models.huggingface": _hflm_cpu,
         "mergekit.evo.actors": _cpu_empty_cache}


class _Hooks(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == NAME:
            return importlib.machinery.ModuleSpec(fullname, self) if importlib.util.find_spec("vllm") is None \\
                else None
        hook = AFTER.get(fullname)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            real = spec.loader.exec_module

            def exec_module(module, real=real, hook=hook):
                real(module)
                hook(module)
            spec.loader.exec_module = exec_module
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):  # the placeholder of lm_eval.models.vllm_causallms
        class VLLM:  # mergekit: a type annotation and `VLLM.AUTO_MODEL_CLASS = ...`; --vllm needs the real one
            AUTO_MODEL_CLASS = None

            def __init__(self, *a, **k):
                raise ImportError("vllm is not installed (placeholder of EDT's bench/evomerge_peers.py)")
        module.VLLM = VLLM


sys.meta_path.insert(0, _Hooks())
'''


# -- pure parts (tests/unit/test_evomerge_peers.py) -------------------------------------------------------------------
def task_yaml(name: str, data: Path, max_gen_toks: int = 16) -> str:
    """An lm-eval generate_until task over a JSONL of {"text": chat-rendered prompt, "answer"}: greedy, stop at the
    end of turn or a newline, exact match after stripping whitespace (what EDT's built-in exact_match compares)."""
    return "\n".join([
        f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {data}",
        "test_split: test", "output_type: generate_until", 'doc_to_text: "{{text}}"', 'doc_to_target: "{{answer}}"',
        "generation_kwargs:", '  until: ["<|endoftext|>", "\\n"]', "  do_sample: false", "  temperature: 0.0",
        f"  max_gen_toks: {max_gen_toks}", "metric_list:", "  - metric: exact_match", "    aggregation: mean",
        "    higher_is_better: true", '    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]', "metadata:", "  version: 1.0",
        ""])


def evolve_yaml(models: list[str], base: str, tasks: list[str], method: str, granularity: int) -> str:
    """mergekit-evolve's genome config: one merge of all specialists on the base, parameters per layer group."""
    lines = ["genome:", "  models:", *[f"    - {m}" for m in models], f"  merge_method: {method}",
             f"  base_model: {base}", f"  layer_granularity: {granularity}", "tasks:"]
    lines += [f"  - name: {t}\n    metric: \"exact_match,none\"" for t in tasks]
    lines += ["apply_chat_template: false  # the prompts are already rendered with the tokenizer's chat template",
              "fewshot_as_multiturn: false", ""]
    return "\n".join(lines)


def mergekit_curve(stdout: str) -> list[tuple[int, float]]:
    """(evaluations so far, best score so far) after each CMA-ES generation, from mergekit-evolve's output:
    `Received N genotypes` before a generation is scored, `New best score: X` after it when it improved, and at the
    end `Best cost: -X` (CMA-ES scores its final mean too, after the last generation's callback)."""
    evals, best, points = 0, None, []
    for line in stdout.splitlines():
        m = re.search(r"Received (\d+) genotypes", line)
        if m:
            if evals and best is not None:
                points.append((evals, best))
            evals += int(m.group(1))
            continue
        m = re.search(r"New best score: (-?[\d.]+(?:e-?\d+)?)", line)
        cost = re.search(r"Best cost: (-?[\d.]+(?:e-?\d+)?)", line)
        if m or cost:
            value = float(m.group(1)) if m else -float(cost.group(1))
            best = value if best is None else max(best, value)
    if evals and best is not None:
        points.append((evals, best))
    return points


def edt_curve(lineage: list[dict]) -> list[tuple[int, float]]:
    """(evaluations so far, best fitness so far) after each generation: every member a worker evaluated (generation
    0's copies included); an elite that took its parent's scores (`carried_from`) cost no evaluation."""
    by_gen: dict[int, list[float]] = {}
    spent: dict[int, int] = {}
    for r in lineage:
        if r.get("fitness") is not None:
            by_gen.setdefault(int(r["generation"]), []).append(float(r["fitness"]))
            spent[int(r["generation"])] = spent.get(int(r["generation"]), 0) + (not r.get("carried_from"))
    points, evals, best = [], 0, None
    for g in sorted(by_gen):
        evals += spent[g]
        top = max(by_gen[g])
        best = top if best is None else max(best, top)
        points.append((evals, best))
    return points


def edt_generations(args) -> int:
    """EDT's generations within the budget: generation 0 evaluates the distinct fine-tunes (its copies and every
    elite take scores already measured: train/evomerge/mutate.py), each later one population - elitism children."""
    if args.generations:
        return args.generations
    elitism = json.loads((REPO / "configs" / "evomerge-demo.json").read_text())["edt"]["elitism"]
    return 1 + max(0, args.evals - len(TASKS)) // (args.population - elitism)


def first_reach(curve: list[tuple[int, float]]) -> tuple[float, int]:
    """(best value of a curve, the evaluations it took to first reach it)."""
    best = max(v for _, v in curve)
    return best, next(n for n, v in curve if v >= best)


def best_at(curve: list[tuple[int, float]], n: int) -> float | None:
    """Best value a curve had reached within n evaluations (None before its first point)."""
    vals = [v for k, v in curve if k <= n]
    return max(vals) if vals else None


def spread(xs: list[float]) -> str:
    """'median (min-max)' of a list of numbers."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else f"{xs[0]:.2f}"


class BytesWatch:
    """Largest size seen of every file under some folders, sampled every `every` s (by inode, so a temp file renamed
    into place counts once)."""

    def __init__(self, roots: list[Path], every: float = 0.5):
        self.roots, self.every, self.sizes = roots, every, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for root in self.roots:
            for dirpath, _, files in os.walk(root):
                for f in files:
                    try:
                        st = os.lstat(os.path.join(dirpath, f))
                    except OSError:
                        continue
                    key = (st.st_dev, st.st_ino)
                    self.sizes[key] = max(self.sizes.get(key, 0), st.st_size)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self) -> "BytesWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


# -- setup and checks ------------------------------------------------------------------------------------------------
def setup_venv() -> int:
    """runs/venv-evolve: mergekit[evolve] over this interpreter's packages (torch, transformers, lm-eval stay)."""
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    subprocess.run([str(VENV / "bin" / "pip"), "install", "--disable-pip-version-check", "-c",
                    str(REPO / "requirements" / "lock.txt"), PIN], check=True)
    site = subprocess.run([str(VENV / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "edt_mergekit_cpu_compat.py").write_text(SHIM)
    Path(site, "edt_mergekit_cpu_compat.pth").write_text("import edt_mergekit_cpu_compat\n")
    missing = evolve_missing(VENV / "bin" / "python")
    print(missing or f"mergekit-evolve ready in {VENV}")
    return 2 if missing else 0


def evolve_missing(python: Path) -> str | None:
    """None when `python` runs mergekit-evolve's code (mergekit.scripts.evolve, ray, cma), else the install line."""
    if not python.exists():
        return f"mergekit-evolve is not installed (no {python}): run `{SETUP}` (it does `{INSTALL}` + a .pth hook)"
    p = subprocess.run([str(python), "-c", "import mergekit.scripts.evolve, ray, cma"], capture_output=True,
                       text=True, env={**os.environ, **OFFLINE})
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return f"mergekit-evolve does not import with {python} ({last}): run `{SETUP}`"
    return None


def check_parents(models: dict[str, Path]) -> str | None:
    """None when every parent loads with transformers, else one line naming the first that does not."""
    from transformers import AutoModelForCausalLM
    for name, d in models.items():
        try:
            AutoModelForCausalLM.from_pretrained(str(d))
        except Exception as e:  # noqa: BLE001  (any reason: one line naming the model)
            hint = " (the offline demo's: `python scripts/make_specialists.py`)" if "evomerge-models" in str(d) else ""
            return f"parent {name} ({d}) does not load with transformers: {type(e).__name__}: " \
                   f"{' '.join(str(e).split())[:200]}{hint}"
    return None


# -- the shared fitness ----------------------------------------------------------------------------------------------
def write_tasks(root: Path, models: Path, n_search: int, n_final: int) -> dict[str, list[str]]:
    """JSONL of held-out items + lm-eval task YAMLs: edt_peer_<task> (the search's), edt_final_<task> (re-scoring)."""
    from transformers import AutoTokenizer

    from train.evomerge.sft import ensure_chat_template, render
    from train.evomerge.tasks import prompt_and_answer, task_items

    tok = ensure_chat_template(AutoTokenizer.from_pretrained(str(models / "base")))
    root.mkdir(parents=True, exist_ok=True)
    names: dict[str, list[str]] = {"search": [], "final": []}
    for t in TASKS:
        items = task_items(t, n_search + n_final, "eval", 0)  # one draw: the two sets are disjoint
        for kind, part in (("search", items[:n_search]), ("final", items[n_search:])):
            name = f"edt_{'peer' if kind == 'search' else 'final'}_{t}"
            rows = []
            for it in part:
                msgs, answer = prompt_and_answer(it)
                rows.append({"text": render(tok, msgs, add_generation_prompt=True), "answer": answer})
            (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (root / f"{name}.yaml").write_text(task_yaml(name, root / f"{name}.jsonl"))
            names[kind].append(name)
    return names


def rescore(model_dir: Path, tasks_dir: Path, names: dict[str, list[str]], batch_size: int) -> dict[str, float]:
    """One evaluator for every finalist: our lm-eval fitness (fp32, in process) on the search items and on the
    other held-out items; {"search": fitness, "final": fitness, "scores": {task/metric: value}}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.evomerge.lm_eval_fitness import LMEvalFitness
    from train.evomerge.sft import ensure_chat_template

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = ensure_chat_template(AutoTokenizer.from_pretrained(str(model_dir)))
    fit = LMEvalFitness([{"name": n, "metric": "exact_match"} for kind in ("search", "final") for n in names[kind]],
                        str(tasks_dir), include_defaults=False, batch_size=batch_size)
    scores = fit(model, tok)["scores"]
    return {"scores": scores, **{kind: sum(scores[f"{n}/exact_match"] for n in names[kind]) for kind in names}}


# -- the two tools ---------------------------------------------------------------------------------------------------
def run_edt(tmp: Path, args, seed: int, models: Path, tasks_dir: Path, names: list[str]) -> dict:
    """edt_sim.py on the demo's config, the search tasks as lm-eval fitness, P x G evaluations."""
    cfg = json.loads((REPO / "configs" / "evomerge-demo.json").read_text())
    project = f"edt-s{seed}"
    cfg.update(project_name=project, base_dir=str(tmp / "edt"), seed=seed)
    cfg["outer"]["num_workers"] = args.workers
    cfg["edt"].update(fitness="lm_eval", population_size=args.population, max_generations=edt_generations(args),
                      initial_population=[str(models / t) for t in TASKS])
    cfg["evomerge"]["base_model"] = str(models / "base")
    cfg["evomerge"]["lm_eval"] = {"tasks": [{"name": n, "metric": "exact_match"} for n in names],
                                  "include_path": str(tasks_dir), "include_defaults": False,
                                  "batch_size": args.batch_size}
    # eval_loss needs one built-in task: the held-out answer loss of a few items, weight 0 (not in the fitness)
    cfg["evomerge"]["tasks"] = [{"name": "loss", "data": "task:addition", "metric": "sft_loss", "items": 8,
                                 "weight": 0.0}]
    for k, v in args.edt_set:
        section, key = k.split(".", 1)
        cfg[section][key] = v
    path = tmp / f"{project}.json"
    path.write_text(json.dumps(cfg, indent=1))
    run_dir = tmp / "edt" / project
    run_dir.mkdir(parents=True)
    t0 = time.time()
    with BytesWatch([run_dir]) as watch, open(tmp / f"{project}.log", "w") as log:
        p = subprocess.run([sys.executable, "edt_sim.py", "--config", str(path)], cwd=REPO, stdout=log,
                           stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}, timeout=args.run_timeout)
    wall = time.time() - t0
    if p.returncode:
        raise RuntimeError(f"edt_sim.py failed ({p.returncode}); see {tmp / f'{project}.log'}:\n"
                           + (tmp / f"{project}.log").read_text()[-3000:])
    lineage = [json.loads(line) for line in (run_dir / "lineage.jsonl").read_text().splitlines() if line.strip()]
    return {"tool": "edt", "seed": seed, "wall_s": wall, "bytes": watch.total, "curve": edt_curve(lineage),
            "final": str(run_dir / "final"), "log": str(tmp / f"{project}.log")}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mergekit(tmp: Path, args, seed: int, models: Path, tasks_dir: Path, names: list[str]) -> dict:
    """mergekit-evolve as its users start it: a Ray cluster, its YAML genome config, its CLI."""
    import signal

    storage, ray_dir = tmp / f"mk-s{seed}", tmp / f"ray{seed}"
    storage.mkdir()
    genome = storage.parent / f"mk-s{seed}.yml"
    genome.write_text(evolve_yaml([str(models / t) for t in TASKS], str(models / "base"), names, args.mk_method,
                                  args.mk_granularity))
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    port, bindir = free_port(), VENV / "bin"
    t0 = time.time()
    with BytesWatch([storage, ray_dir]) as watch, open(tmp / f"mk-s{seed}.log", "w") as log:
        head = subprocess.Popen([str(bindir / "ray"), "start", "--head", "--block", f"--port={port}",
                                 f"--num-cpus={args.workers}", f"--num-gpus={args.workers}",
                                 "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={ray_dir}"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            cmd = [str(bindir / "mergekit-evolve"), str(genome), "--storage-path", str(storage),
                   "--max-fevals", str(args.evals - args.population), "--force-population-size", str(args.population),
                   "--random-seed", str(seed), "--num-gpus", str(args.workers), "--no-merge-cuda",
                   *MK_MODES[args.mk_mode], "--task-search-path", str(tasks_dir), "--batch-size", str(args.batch_size)]
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            out = ""
            for _ in range(60):  # the head is up when a driver can connect
                p = subprocess.run(cmd, cwd=storage, capture_output=True, text=True, timeout=args.run_timeout,
                                   env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
                out = p.stdout + p.stderr
                if p.returncode == 0 or "Could not find any running Ray instance" not in out and \
                        "Failed to connect to GCS" not in out:
                    break
                time.sleep(1)
            log.write(out)
        finally:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):  # the head's whole process group
                try:
                    os.killpg(head.pid, sig)
                    head.wait(wait)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
    wall = time.time() - t0
    if p.returncode:
        raise RuntimeError(f"mergekit-evolve failed ({p.returncode}); see {tmp / f'mk-s{seed}.log'}:\n{out[-3000:]}")
    return {"tool": "mergekit-evolve", "seed": seed, "wall_s": wall, "bytes": watch.total,
            "curve": mergekit_curve(out), "final": str(storage / "final_model"),
            "best_config": (storage / "best_config.yaml").read_text() if (storage / "best_config.yaml").exists()
            else None, "log": str(tmp / f"mk-s{seed}.log")}


# -- report ----------------------------------------------------------------------------------------------------------
STYLE = {"edt": ("tab:blue", "-", "EvoMerge (merge + SFT)"),
         "edt-before": ("tab:blue", ":", "EvoMerge before (copies, elites re-scored)"),
         "mergekit-evolve": ("tab:orange", "-", "mergekit-evolve (CMA-ES, ties)")}


def plot(runs: list[dict], out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from train.core.plot import save_figure

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for tool in dict.fromkeys(r["tool"] for r in runs):
        color, ls, label = STYLE.get(tool, ("tab:gray", "--", tool))
        mine = [r for r in runs if r["tool"] == tool and r["curve"]]
        for r in mine:
            xs, ys = zip(*r["curve"])
            ax.step(xs, ys, where="post", color=color, ls=ls, alpha=0.3, lw=1)
        xs = sorted({n for r in mine for n, _ in r["curve"]})
        med = [statistics.median([v for v in (best_at(r["curve"], n) for r in mine) if v is not None]) for n in xs]
        ax.step(xs, med, where="post", color=color, ls=ls, lw=2.4, label=f"{label}: median of {len(mine)} seeds")
    ax.set_xlabel("candidate evaluations")
    ax.set_ylabel("best fitness so far (sum of exact match, 0-3)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    save_figure(fig, out)


def replot(specs: list[str], out: Path) -> int:
    """The picture from saved results: PATH or PATH:TOOL=NAME (that file's runs of TOOL drawn as NAME)."""
    runs = []
    for spec in specs:
        path, _, rename = spec.partition(":")
        old, _, new = rename.partition("=")
        saved = json.loads(Path(path).read_text())
        for r in saved["runs"]:
            curve = [(n, v) for n, v in r["curve"] if n <= saved["args"]["evals"]]  # within that run's budget
            runs.append({**r, "curve": curve, "tool": new if old and r["tool"] == old else r["tool"]})
    plot(runs, out, "same parents, tasks, budget; each seed (thin), median (thick)")
    print(f"written: {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="store_true", help=f"create {VENV.relative_to(REPO)} with {PIN} and exit")
    ap.add_argument("--quick", action="store_true", help="2 seeds x 12 evaluations, 20 search items per task")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--evals", type=int, default=24, help="candidate evaluations per tool and seed")
    ap.add_argument("--generations", type=int, help="EDT's generations (default: as many as the budget allows)")
    ap.add_argument("--population", type=int, default=6, help="EDT's population = mergekit's CMA-ES population")
    ap.add_argument("--items", type=int, default=50, help="held-out search items per task")
    ap.add_argument("--final-items", type=int, default=100, help="other held-out items per task (re-scoring)")
    ap.add_argument("--workers", type=int, default=2, help="EDT workers = Ray actors (1 CPU each)")
    ap.add_argument("--batch-size", type=int, default=64, help="lm-eval batch size (both)")
    ap.add_argument("--mk-method", default="ties", choices=["ties", "dare_ties", "task_arithmetic", "linear"])
    ap.add_argument("--mk-mode", default="pool", choices=sorted(MK_MODES),
                    help="mergekit-evolve's scheduling (pool: its default)")
    ap.add_argument("--mk-granularity", type=int, default=2, help="mergekit-evolve layer_granularity (of 4 layers)")
    ap.add_argument("--edt-set", nargs=2, action="append", default=[], metavar=("SECTION.KEY", "JSON"),
                    type=str, help="one more EDT config value, e.g. --edt-set edt.mutation_steps 15")
    ap.add_argument("--tools", nargs="+", default=["mergekit-evolve", "edt"], choices=["mergekit-evolve", "edt"])
    ap.add_argument("--models", type=Path, default=REPO / "runs" / "evomerge-models")
    ap.add_argument("--python", type=Path, default=VENV / "bin" / "python", help="mergekit-evolve's interpreter")
    ap.add_argument("--keep", type=Path, help="copy both tools' finalists here")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "evomerge-peers.png")
    ap.add_argument("--results", type=Path, help="results JSON (default bench/results/evomerge_peers.json)")
    ap.add_argument("--run-timeout", type=float, default=1800.0)
    ap.add_argument("--replot", nargs="+", metavar="JSON[:TOOL=NAME]", help="only draw --plot from saved results")
    args = ap.parse_args()
    args.edt_set = [(k, json.loads(v)) for k, v in args.edt_set]
    if args.setup:
        return setup_venv()
    if args.replot:
        return replot(args.replot, args.plot)
    if args.quick:
        args.seeds, args.evals, args.population, args.items, args.final_items = args.seeds[:2], 12, 4, 20, 40
    if args.evals % args.population:
        raise SystemExit(f"--evals {args.evals} must be a multiple of --population {args.population} (CMA-ES "
                         f"generations of that size)")
    if "mergekit-evolve" in args.tools:
        missing = evolve_missing(args.python)
        if missing:
            print(missing, file=sys.stderr)
            return 2
    models = {"base": args.models / "base", **{t: args.models / t for t in TASKS}}
    bad = check_parents(models)
    if bad:
        print(bad, file=sys.stderr)
        return 2

    t_all, runs = time.time(), []
    with tempfile.TemporaryDirectory(prefix="edt-bench-evo-") as tmp_s:
        tmp = Path(tmp_s)
        tasks_dir = tmp / "tasks"
        names = write_tasks(tasks_dir, args.models, args.items, args.final_items)
        print(f"{len(args.seeds)} seeds x {args.evals} evaluations per tool (population {args.population}); fitness = "
              f"exact match summed over {', '.join(TASKS)} on {args.items} held-out items each; {args.workers} "
              f"workers / Ray actors", flush=True)
        for seed in args.seeds:
            for tool in args.tools:
                run = (run_mergekit if tool == "mergekit-evolve" else run_edt)(tmp, args, seed, args.models,
                                                                              tasks_dir, names["search"])
                run["curve"] = [(n, v) for n, v in run["curve"] if n <= args.evals]  # within the budget
                best, n = first_reach(run["curve"]) if run["curve"] else (None, None)
                print(f"  seed {seed} {tool}: best {best} in {n} of {run['curve'][-1][0] if run['curve'] else 0} "
                      f"evals, {run['wall_s']:.0f} s, {run['bytes'] / 1e6:.1f} MB written", flush=True)
                run["best"], run["evals_to_best"] = best, n
                run["rescore"] = rescore(Path(run["final"]), tasks_dir, names, args.batch_size)  # loads, or raises
                run["loads"] = True
                if args.keep:
                    shutil.copytree(run["final"], args.keep / f"{tool}-s{seed}", dirs_exist_ok=True)
                runs.append(run)
        parents = {name: rescore(d, tasks_dir, names, args.batch_size) for name, d in models.items()}

    rows = []
    for tool in args.tools:
        mine = [r for r in runs if r["tool"] == tool]
        n_max = max(r["curve"][-1][0] for r in mine)
        rows.append([tool, len(mine), spread([r["best"] for r in mine]), spread([r["evals_to_best"] for r in mine]),
                     spread([best_at(r["curve"], n_max // 2) for r in mine]),
                     spread([r["rescore"]["search"] for r in mine]), spread([r["rescore"]["final"] for r in mine]),
                     spread([r["wall_s"] for r in mine]), spread([r["bytes"] / 1e6 for r in mine]),
                     "yes" if all(r["loads"] for r in mine) else "NO"])
    top = max(parents, key=lambda k: parents[k]["search"])
    rows.append([f"best parent ({top})", "-", "-", "-", "-", f"{parents[top]['search']:.2f}",
                 f"{parents[top]['final']:.2f}", "-", "-", "-"])
    print("\nparents, re-scored (search items / other held-out items): " +
          ", ".join(f"{k} {v['search']:.2f} / {v['final']:.2f}" for k, v in parents.items()))
    print(table(rows, ["tool", "seeds", "best fitness (own eval)", "evals to best", f"best at {n_max // 2} evals",
                       "finalist, search items (one eval)", "finalist, other held-out items", "wall s",
                       "MB written", "finalists load"]))
    record = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": runs,
              "parents_final": parents, "date": time.strftime("%Y-%m-%d"), "total_s": time.time() - t_all}
    path = args.results or None
    if path:
        path.write_text(json.dumps(record, indent=1))
    else:
        path = save_result("evomerge_peers" + ("_quick" if args.quick else ""), record)
    plot(runs, args.plot, "same parents, tasks, budget; each seed (thin), median (thick)")
    print(f"written: {path}, {args.plot}; {time.time() - t_all:.0f} s in all")
    med = {tool: (statistics.median([r["best"] for r in runs if r["tool"] == tool]),
                  statistics.median([r["evals_to_best"] for r in runs if r["tool"] == tool])) for tool in args.tools}
    if len(med) == 2:
        print(f"evomerge-peers: mergekit-evolve best {med['mergekit-evolve'][0]:.2f} in {med['mergekit-evolve'][1]:g} "
              f"evals; edt best {med['edt'][0]:.2f} in {med['edt'][1]:g} evals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
