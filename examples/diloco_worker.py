"""An ordinary PyTorch training loop made DiLoCo by swapping its optimizer for `DiLoCoOptimizer`.

    python examples/diloco_worker.py --worker 0 --num-workers 2 --base-dir /tmp/diloco-example &
    python examples/diloco_worker.py --worker 1 --num-workers 2 --base-dir /tmp/diloco-example

Each process is one worker: a tiny Llama (configs/micro-llama.json, or --model) on its own half of the embedded
Shakespeare corpus. The workers only share the folder --base-dir (a shared disk across machines); worker 0 also
does the outer step, so nothing else has to run. examples/diloco_optimizer.ipynb starts two of these and evaluates
the global model of every round; the helpers below (model, data, evaluation) are what it imports.
"""
from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build_model(config: str | Path = REPO / "configs" / "micro-llama.json", seed: int = 0) -> torch.nn.Module:
    """A randomly initialised causal LM from a config JSON (every worker gets the same θ_0 from the seed; worker 0's
    copy is the one committed as round 0 anyway)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config)), dtype=torch.float32)


def load_tokens(max_chars: int = 600_000) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids of the embedded corpus: the first `max_chars` characters, the last 5% held out."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(REPO / "data" / "tokenizer"))
    text, n = [], 0
    for f in sorted((REPO / "data" / "corpus").glob("*.txt")):
        text.append(f.read_text(encoding="utf-8"))
        n += len(text[-1])
        if n >= max_chars:
            break
    ids = torch.tensor(tok("\n".join(text)[:max_chars]).input_ids, dtype=torch.long)
    split = int(len(ids) * 0.95)
    return ids[:split], ids[split:]


def batches(tokens: torch.Tensor, worker: int, num_workers: int, batch: int, seq: int, seed: int = 0):
    """Endless random windows of seq + 1 tokens from this worker's contiguous shard (disjoint across workers)."""
    lo = worker * len(tokens) // num_workers
    hi = (worker + 1) * len(tokens) // num_workers - seq - 1
    g = torch.Generator().manual_seed(seed * 1000 + worker)
    while True:
        starts = torch.randint(lo, hi, (batch,), generator=g)
        yield torch.stack([tokens[s: s + seq + 1] for s in starts.tolist()])


def lm_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), windows[:, 1:].reshape(-1))


@torch.no_grad()
def eval_loss(model: torch.nn.Module, heldout: torch.Tensor, seq: int = 64, windows: int = 32) -> float:
    """Mean loss on fixed, evenly spaced held-out windows."""
    model.eval()
    step = max(1, (len(heldout) - seq - 1) // windows)
    w = torch.stack([heldout[i: i + seq + 1] for i in range(0, len(heldout) - seq - 1, step)][:windows])
    out = lm_loss(model, w).item()
    model.train()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--base-dir", required=True, help="the shared folder (BASE_DIR)")
    ap.add_argument("--run-id", default="diloco-example")
    ap.add_argument("--model", default=str(REPO / "configs" / "micro-llama.json"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per round")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-chars", type=int, default=600_000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from transformers import get_cosine_schedule_with_warmup
    from transformers.utils import logging as hf_logging

    from train.diloco.optimizer import DiLoCoOptimizer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model).to(device)
    train_tokens, _ = load_tokens(args.max_chars)
    data = batches(train_tokens, args.worker, args.num_workers, args.batch, args.seq)
    total = args.rounds * args.inner_steps

    # The only DiLoCo-specific lines: this optimizer instead of AdamW, and step(scaler=...).
    opt = DiLoCoOptimizer(
        model, base_dir=args.base_dir, run_id=args.run_id, worker=args.worker, num_workers=args.num_workers,
        num_inner_steps=args.inner_steps, batch_size=args.batch * args.seq,
        inner_optimizer=partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95)),
        outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        scheduler=partial(get_cosine_schedule_with_warmup, num_warmup_steps=min(10, total // 10),
                          num_training_steps=total),
        averaging_timeout=300, keep_rounds=10_000)  # keep every round: the notebook evaluates them all
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")  # fp16 autocast on a GPU
    amp = torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda")

    losses = []
    while opt.total_steps < total:
        with amp:
            loss = lm_loss(model, next(data).to(device))
        scaler.scale(loss).backward()
        scaler.unscale_(opt.inner_optimizer)  # clip the real gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(scaler=scaler, loss=loss.detach())  # every inner_steps: outer round through base_dir
        opt.zero_grad()
        losses.append(loss.item())
        if opt.local_step == 0:
            print(f"worker {args.worker}: round {opt.round} committed, mean train loss of the last round "
                  f"{sum(losses) / len(losses):.3f}", flush=True)
            losses = []
    opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
