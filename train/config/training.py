"""The schema of the two training loops: `inner` (each worker's AdamW / Muon steps) and `outer` (the DiLoCo round:
the outer step, the exchange over BASE_DIR, elastic membership). Part of RunConfig (train/config/schema.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from train.config.fields import bad_value, check_choice, check_range, doc


PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
PRECISION_ALIASES = {"fp32": "fp32", "32": "fp32", "float32": "fp32", "bf16": "bf16-mixed",
                     "bf16-mixed": "bf16-mixed", "bfloat16": "bf16-mixed", "fp16": "fp16-mixed",
                     "fp16-mixed": "fp16-mixed", "16-mixed": "fp16-mixed", "float16": "fp16-mixed"}


@dataclass(kw_only=True)
class InnerConfig:
    lr: float = doc(4e-4, "Peak AdamW learning rate of the inner loop (OpenDiLoCo default).")
    beta1: float = doc(0.9, "AdamW beta1.")
    beta2: float = doc(0.95, "AdamW beta2.")
    eps: float = doc(1e-8, "AdamW epsilon.")
    weight_decay: float = doc(0.1, "AdamW decoupled weight decay λ (each step θ ← θ − lr_t·λ·θ); also Muon's.")
    weight_decay_mode: Literal["fixed", "inverse_steps"] = doc(
        "fixed", "fixed (`weight_decay` as given) or inverse_steps (Charles et al. 2025: "
        "independent weight decay 1/T, i.e. λ = 1 / (T·lr) with T = the schedule's "
        "total inner steps, so each step at the peak lr decays by 1/T; "
        "`weight_decay` is then unused). EvoMerge's SFT mutation always uses "
        "`weight_decay`.")
    warmup_steps: int = doc(20, "Linear warmup steps of the inner schedule.")
    total_steps: int = doc(0, "Length of the cosine schedule in inner steps; 0 = rounds x local_steps (the sum of "
                              "the rounds' H with outer.local_steps_schedule; rounds x local_steps / fragments "
                              "with outer.fragments).")
    min_lr_ratio: float = doc(0.1, "Cosine floor as a fraction of `lr`.")
    per_device_batch_size: int = doc(16, "Windows per forward/backward pass.")
    total_batch_size: int = doc(16, "Windows per optimizer step (per worker); a multiple of per_device_batch_size "
                                    "(the ratio is the gradient accumulation).")
    grad_clip: float = doc(1.0, "Clip the global gradient norm to this; 0 = off.")
    precision: str = doc("auto", "auto (bf16-mixed on a CUDA device with bf16, else fp32), fp32, bf16-mixed or "
                                 "fp16-mixed (autocast; fp16 uses a grad scaler). Master weights stay fp32.")
    compile: Any = doc("auto", "torch.compile the model and the loss for the inner loop: true, false or auto (on "
                               "CUDA, off on CPU).")
    loss_chunk: Any = doc("auto", "Memory-lean loss: the cross entropy over this many tokens at a time, each "
                                  "chunk recomputed in the backward pass, so no fp32 copy of the logits and no "
                                  "full log-probabilities are kept; 0 = in one piece; auto = 4096 on CUDA without "
                                  "compile (compiled, the loss is fused instead), 0 on CPU.")
    log_every: int = doc(10, "Read the training loss back from the device every this many steps (for the "
                             "heartbeat); no step waits for the device in between. Round statistics are exact "
                             "whatever the value.")
    optimizer: Literal["adamw", "muon"] = doc(
        "adamw", "adamw, or muon (torch.optim.Muon for the 2-D weight matrices of the hidden "
        "layers; embeddings, output head, norms and biases stay on AdamW, as in MuLoCo).")
    muon_lr: float = doc(0.02, "Peak Muon learning rate (same warmup + cosine as `lr`; Keller Jordan's scaling "
                               "by sqrt(max(1, rows/cols))).")
    muon_momentum: float = doc(0.95, "Muon momentum (Nesterov).")
    reset_state: bool = doc(False, "Reset the inner optimizer state (AdamW moments, Muon momentum) at the start "
                                   "of every round; false keeps it across rounds, as DiLoCo does.")
    device: str = doc("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N.")
    threads: int = doc(0, "torch CPU threads per worker process; 0 = let torch decide.")
    nproc_per_node: int = doc(1, "Processes per worker: > 1 starts each worker as a torchrun group (one process per "
                                 "GPU; gloo on CPU) that splits total_batch_size over its processes.")
    parallel: Literal["ddp", "fsdp"] = doc(
        "ddp", "How a multi-process worker holds the model: ddp (a copy per process) or fsdp (FSDP2 "
        "fully_shard: parameters, gradients and AdamW state sharded over the processes).")

    def validate(self, p: str) -> None:
        check_range(self, p, "lr", 0.0, lo_open=True)
        for b in ("beta1", "beta2"):
            check_range(self, p, b, 0.0, 1.0)
        check_range(self, p, "weight_decay", 0.0)
        check_choice(self, p, "weight_decay_mode")
        check_range(self, p, "warmup_steps", 0)
        check_range(self, p, "total_steps", 0)
        check_range(self, p, "min_lr_ratio", 0.0, 1.0)
        check_range(self, p, "per_device_batch_size", 1)
        check_range(self, p, "total_batch_size", 1)
        check_range(self, p, "grad_clip", 0.0)
        check_range(self, p, "threads", 0)
        check_range(self, p, "nproc_per_node", 1)
        check_choice(self, p, "parallel")
        if self.total_batch_size % self.per_device_batch_size:
            raise bad_value(p + "total_batch_size", self.total_batch_size,
                            f"must be a multiple of {p}per_device_batch_size ({self.per_device_batch_size})")
        if self.total_batch_size % (self.per_device_batch_size * self.nproc_per_node):
            raise bad_value(p + "total_batch_size", self.total_batch_size,
                            f"must split over {p}nproc_per_node = {self.nproc_per_node} processes: a multiple of "
                            f"{self.per_device_batch_size * self.nproc_per_node} ({p}per_device_batch_size x nproc)")
        if str(self.precision) not in PRECISION_ALIASES and self.precision != "auto":
            raise bad_value(p + "precision", self.precision, f"must be one of {', '.join(PRECISIONS)} or auto")
        self.precision = PRECISION_ALIASES.get(str(self.precision), self.precision)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise bad_value(p + "device", self.device, "must be auto, cpu, cuda or cuda:N")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise bad_value(p + "compile", self.compile, "must be true, false or \"auto\"")
        lc = self.loss_chunk
        if lc != "auto" and (isinstance(lc, bool) or not isinstance(lc, int) or lc < 0):
            raise bad_value(p + "loss_chunk", lc, "must be a number of tokens >= 0 (0 = the loss in one piece) or "
                                                  "\"auto\"")
        check_range(self, p, "log_every", 1)
        check_choice(self, p, "optimizer")
        check_range(self, p, "muon_lr", 0.0, lo_open=True)
        check_range(self, p, "muon_momentum", 0.0, 1.0)
        if self.optimizer == "muon" and self.nproc_per_node > 1 and self.parallel == "fsdp":
            raise bad_value(p + "optimizer", "muon", f"does not work with {p}parallel = \"fsdp\": Muon "
                                                     f"orthogonalises whole weight matrices and FSDP2 holds shards; "
                                                     f"use {p}parallel = \"ddp\" or {p}optimizer = \"adamw\"")
        if self.device == "cpu":  # `auto` settles here when it can; on auto / cuda devices the trainer settles it
            self.precision = "fp32" if self.precision == "auto" else self.precision
            self.compile = False if self.compile == "auto" else self.compile
            self.loss_chunk = 0 if self.loss_chunk == "auto" else self.loss_chunk

    @property
    def grad_accum(self) -> int:
        return self.total_batch_size // self.per_device_batch_size


@dataclass(kw_only=True)
class OuterConfig:
    num_workers: int = doc(2, "Workers (DiLoCo replicas); the prototype's NUM_MACHINES.")
    rounds: int = doc(10, "Outer rounds (DiLoCo) to run.")
    local_steps: int = doc(50, "H: inner optimizer steps per worker between outer steps.")
    local_steps_schedule: list = doc([], "An H schedule: [[from_round, H], ...] with increasing from_round; H of "
                                         "round r is that of the last entry with from_round <= r (local_steps "
                                         "before the first). E.g. [[0, 10], [10, 30]]: H = 10 for rounds 0-9, then "
                                         "30. The DiLoCo file protocol (diloco.py, diloco_sim.py, the launcher); "
                                         "EDT and DiLoCoOptimizer use local_steps.")
    lr: float = doc(1.0, "Outer SGD learning rate. The default, 1 with momentum 0, is parameter averaging: DiLoCo's "
                         "Nesterov outer step at lr 1, momentum 0. Why: in the paper's regime (bench/scaling.py: 90 "
                         "outer steps at H = 30, each row's inner lr tuned, 3 seeds) it beat the paper's step "
                         "(Nesterov 0.9, best lr of 0.4-1.0) at M = 2 (+1.8% against DP vs +4.6%) and M = 4 (+4.1% "
                         "vs +6.2%) on every seed (docs/scaling.md). The DiLoCo paper uses 0.7 with momentum 0.9 at "
                         "150M+ parameters and H = 500: set both for its recipe.")
    momentum: float = doc(0.0, "Outer SGD momentum (Nesterov when `nesterov`). 0 by default: with 90 outer steps "
                               "momentum 0.9 still lost to averaging at every M > 1, and heavy-ball 0.9 was the "
                               "worst outer step measured (docs/scaling.md); the DiLoCo paper uses 0.9.")
    nesterov: bool = doc(True, "Nesterov momentum for the outer step.")
    min_workers: int = doc(1, "After `round_timeout_s`, commit the round if at least this many deltas arrived.")
    round_timeout_s: float = doc(1800.0, "Seconds the reducer waits for all deltas before going on without the "
                                         "missing workers.")
    dead_after_s: float = doc(10.0, "A worker whose heartbeat lease (rewritten every second) has not changed for "
                                    "this long is dead: the round goes on without it (at once when it exited or "
                                    "left, or its process is gone on the coordinator's host). docs/elastic.md.")
    startup_grace_s: float = doc(120.0, "Extra seconds, on top of dead_after_s, that a worker without a fresh "
                                        "heartbeat gets when the coordinator starts or resumes (workers import "
                                        "torch, read the data and load the model first).")
    straggler_factor: float = doc(3.0, "Once a quorum (max(min_workers, half the workers)) arrived, wait at most "
                                       "this x the median recent time-to-quorum (never less than dead_after_s) for "
                                       "the rest (a worker whose process (re)started less than dead_after_s + "
                                       "startup_grace_s ago and has delivered no delta yet is waited for that "
                                       "long); 0 = off (wait for every live worker).")
    max_restarts: int = doc(3, "Restarts of a worker process that dies (simulators and the launcher's hosts; "
                               "backoff 1 s, 2 s, 4 s, ...); the simulators' --max-restarts overrides it.")
    poll_interval_s: float = doc(0.2, "How often processes look at BASE_DIR for new files (by listing folders, "
                                      "so an NFS client's lookup cache never delays a round: docs/protocol.md).")
    io_retry_s: float = doc(120.0, "How long one call on BASE_DIR (read, write, fsync, rename, listing, stat) is "
                                   "retried after a transient error (EIO, ESTALE, ETIMEDOUT, EAGAIN, ENOLCK: a soft "
                                   "NFS mount) before the process stops with a one-line error (exit 2; its "
                                   "supervisor restarts it).")
    disk_full_wait_s: float = doc(3600.0, "How long a process waits when a write on BASE_DIR finds the disk full "
                                          "(ENOSPC) or the quota spent (EDQUOT): one line when it starts, one a "
                                          "minute, one when space is back; no restart is spent. Past it: one line, "
                                          "exit 2, no restart; the same command resumes once there is space.")
    screen: bool = doc(True, "Screen each round's deltas before averaging (rounds with at least 3): a delta whose "
                             "norm is over screen_norm_ratio x or under 1 / screen_norm_ratio x the round's median, "
                             "or whose cosine with the mean of the others is below screen_min_cosine, is rejected "
                             "with its reason in metrics.jsonl and never averaged (docs/protocol.md).")
    screen_norm_ratio: float = doc(5.0, "The screen's norm bound: a delta whose L2 norm is over this x, or under "
                                        "1 / this x, the median norm of the round's deltas is rejected.")
    screen_min_cosine: float = doc(-0.5, "The screen's direction bound: a delta whose cosine with the mean of the "
                                         "round's other deltas is below this is rejected (healthy rounds measured "
                                         "0.63-0.87 with fp32 / int8 deltas, 0.18-0.53 with topk, where -0.1 "
                                         "catches a flipped delta: docs/protocol.md).")
    screen_loss: Literal["auto", "on", "off"] = doc(
        "auto", "The loss screen (with `screen`): each delta judged by the loss of θ_r − Δ against θ_r's on a few "
        "held-out windows drawn each round (none a worker trains on, none of the reported eval's); a delta that "
        "makes it worse by more than screen_loss_margin while the round's others improve it, gains less than a "
        "quarter of what they gain, or is far worse than they are, is rejected, also with 1 or 2 workers "
        "(docs/protocol.md). auto: on where one evaluation takes at most 0.25 s on the coordinator's device "
        "(the log says which, and why).")
    screen_loss_windows: int = doc(16, "Held-out windows (of data.seq_length tokens) the loss screen evaluates "
                                       "each delta on (16: docs/protocol.md).")
    screen_loss_margin: float = doc(0.03, "The loss screen's margin, in nats of mean token loss (0 healthy deltas "
                                          "rejected in the measured runs and soaks: docs/protocol.md).")
    delta_dtype: Literal["float32", "bfloat16", "float16"] = doc(
        "float32", "dtype of published pseudo-gradients: float32, bfloat16 or float16.")
    keep_rounds: int = doc(2, "Committed rounds kept on disk (older global models and deltas are deleted).")
    token_weighted: bool = doc(True, "Weight each delta by its tokens (equal weights when off).")
    compression: Literal["none", "int8", "int4", "bfloat16", "float16", "topk"] = doc(
        "none", "Codec of the exchange, both ways (docs/compression.md): none (fp32 deltas in "
        "`delta_dtype`, the full global model every round), int8 or int4 (block-wise "
        "absmax), bfloat16 or float16; with a codec, workers send encoded deltas with "
        "error feedback and the coordinator publishes the encoded update θ_{r+1} − θ_r "
        "(with its own error feedback) that every copy of θ applies; topk: each "
        "worker sends its top `density` of (Δ + β·residual) per chunk at 2 bits "
        "(SparseLoCo) and every copy of θ sums the sparse deltas itself.")
    overlap: Literal["none", "delayed", "eager"] = doc(
        "none", "none (a worker waits for θ_{r+1} after publishing), delayed or eager (it goes on "
        "training at once and folds θ_{r+1} in one round late; the next segment starts from "
        "θ_r + its own progress since its delta (delayed), or θ_r + that progress at the "
        "weight the outer step gives one worker, η (1 + μ) / M (eager, Kale et al. 2025); "
        "docs/overlap.md). Not with torchrun workers.")
    overlap_steps: int = doc(0, "With overlap: when a segment folds the new global model in (docs/overlap.md): "
                                "0 = adaptive, at the first step boundary after θ_{r+1} is committed and read (never "
                                "waits; runs are not bit-reproducible run to run, a restart still replays exactly); "
                                "τ = after τ steps, waiting there for the commit if needed (Streaming DiLoCo's τ; "
                                "reproducible); >= local_steps: at the segment's end (one round late). The worker "
                                "keeps the progress since the segment's start and takes its delta against θ_{r+1}.")
    fragments: int = doc(1, "Streaming DiLoCo (docs/streaming.md): split the model into P fragments (the paper's "
                            "strided split of the transformer blocks; the embeddings split by rows), one synced per "
                            "round, so a round is H / P inner steps, fragment p is synced every H steps (the first "
                            "time after (p + 1)·H/P) and no round moves more than 1/P of the model. outer.rounds "
                            "counts these syncs: "
                            "R·P rounds train the tokens of R DiLoCo rounds. 1 = DiLoCo. local_steps must be a "
                            "multiple of P.")
    fragment_delay: int = doc(0, "Streaming DiLoCo's τ: inner steps a worker trains on after publishing a "
                                 "fragment's delta before it takes the fragment's outer result in (waiting there "
                                 "for the commit if needed); 0 = it waits for the commit before training on. Below "
                                 "local_steps / fragments.")
    fragment_mix: float = doc(0.0, "Streaming DiLoCo's α: when a fragment's outer result arrives the worker's copy of "
                                   "that fragment becomes α·local + (1 − α)·global (torch.lerp, as torchft's "
                                   "fragment_update_alpha). 0 = replaced by the global one, as DiLoCo does; the paper "
                                   "mixes in part of the local progress made during the τ overlapped steps.")
    block_size: int = doc(128, "Values per scale of the int8 / int4 codecs (bench/compression.py measures the "
                               "error against block size).")
    density: float = doc(0.015625, "topk: the fraction of each chunk's values a worker sends per round "
                                   "(SparseLoCo's 64 of 4096 = 1.56%).")
    chunk_size: int = doc(4096, "topk: values per chunk; each chunk sends its own top k = density x chunk_size, "
                                "offsets in ceil(log2 chunk_size) bits, one scale per chunk. 4096 with outer.lr 1 "
                                "(SparseLoCo's recipe) by evidence: chunk 128 with lr 4 won runs of 15-40 rounds "
                                "but was +31.5% against DP over 90 outer steps, where 4096 / lr 1 was +8.2% "
                                "(bench/scaling.py, M = 4, 2 seeds: docs/scaling.md).")
    sparse_values: Literal["2bit", "int4", "int8"] = doc(
        "2bit", "topk: codec of the sent values: 2bit (levels ±s, ±3s), int4 or int8.")
    ef_decay: float = doc(0.95, "topk: β, the decay of each worker's error feedback (e <- β e + Δ before the top-k; "
                                "it replaces the outer momentum, which topk does not use).")
    checkpoint_every: int = doc(20, "With compression: an fp32 global model directory (HF-loadable) and the outer "
                                    "state every this many rounds (and after the last); processes that start or "
                                    "restart load the last one and apply the logged updates since.")
    state_dir: str = doc("", "Where each worker keeps its private resume state (inner optimizer moments, error-"
                             "feedback residual): empty = its directory on BASE_DIR (a restart on any host resumes "
                             "exactly); a host-local path (`~` and {worker} allowed) keeps it off the shared disk (a "
                             "restart on the same host resumes exactly; on another host it resumes with fresh "
                             "moments and no residual, and logs that).")
    lr_schedule: Literal["constant", "warmup"] = doc(
        "constant", "Outer learning rate over the rounds (train/exchange/outer.py outer_lr_at): "
        "constant (`lr` every round) or warmup (linear from lr / W to lr over the "
        "first W = `lr_warmup_rounds` rounds, then `lr`).")
    lr_warmup_rounds: int = doc(0, "W: rounds of outer-lr warmup when lr_schedule = warmup.")
    late_weight: float = doc(0.5, "A delta of round r that arrives after round r closed (a straggler past its "
                                  "deadline): 0 = dropped; w > 0 = folded into round r + 1 with w x its tokens as "
                                  "its weight (a staleness weight; 0.5 was best in bench/elastic.py --late).")

    round_time_s: float = doc(0.0, "Rounds by time (docs/hetero.md): 0 = off (every worker runs H = local_steps "
                                   "inner steps a round). > 0: the coordinator gives each worker the H it can "
                                   "train in this many seconds, from its measured speed (the median steps / second of "
                                   "its last 3 rounds; the first round, and a joiner's first, calibrate for "
                                   "local_steps / 4 steps or half this), capped at local_steps; a worker stops "
                                   "once the others have published and this much time has passed (or at 1.5 x "
                                   "this), and reads what it left first in its next round. One outer step per "
                                   "round. Not with fragments or local_steps_schedule.")
    step_rates: dict = doc({}, "Rounds by time with given speeds instead of measured ones: {\"worker id\": inner "
                               "steps per second}, e.g. {\"0\": 20, \"1\": 10} (every worker of the run listed). "
                               "The plan is then fixed and the workers run exactly their H (no deadline), so a run "
                               "reproduces bit for bit; for tests and for machines whose speeds are known.")
    weighting: Literal["tokens", "equal", "per_step"] = doc(
        "tokens", "How the outer step weighs unequal deltas (rounds by time): tokens (each delta by its tokens), equal "
        "(plain mean) or per_step (each delta scaled to a common H, the harmonic mean of the round's: weights "
        "1 / tokens). tokens by evidence: bench/hetero.py, docs/hetero.md. token_weighted = false means equal.")

    @property
    def paced(self) -> bool:
        """Rounds by time (round_time_s > 0): each worker's H comes from its speed (train/diloco/pace.py)."""
        return self.round_time_s > 0

    @property
    def delta_weighting(self) -> str:
        """tokens / equal / per_step: `weighting`, or equal when token_weighted is off."""
        return self.weighting if self.token_weighted else "equal"

    def validate_pace(self, p: str) -> None:
        check_range(self, p, "round_time_s", 0.0)
        check_choice(self, p, "weighting")
        if not self.token_weighted and self.weighting != "tokens":
            raise bad_value(p + "weighting", self.weighting, f"conflicts with {p}token_weighted = false (equal "
                                                             f"weights): drop one of the two")
        rates = self.step_rates
        if not isinstance(rates, dict) or not all(
                str(k).isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in rates.items()):
            raise bad_value(p + "step_rates", rates, "must map worker ids to inner steps per second > 0, e.g. "
                                                     "{\"0\": 20, \"1\": 10}")
        if rates and not self.paced:
            raise bad_value(p + "step_rates", rates, f"is only used with rounds by time: set {p}round_time_s > 0")
        if rates and (missing := [w for w in range(self.num_workers) if str(w) not in {str(k) for k in rates}]):
            raise bad_value(p + "step_rates", rates, f"has no rate for worker(s) {missing}: list every one of the "
                                                     f"{self.num_workers} workers ({p}num_workers)")
        if not self.paced:
            return
        if self.fragments > 1:
            raise bad_value(p + "round_time_s", self.round_time_s, f"does not combine with {p}fragments > 1 "
                                                                   f"(streaming DiLoCo syncs fragments on a fixed "
                                                                   f"step clock): set one of them back (0 / 1)")
        if self.local_steps_schedule:
            raise bad_value(p + "round_time_s", self.round_time_s, f"does not combine with {p}local_steps_schedule "
                                                                   f"(the H of each round comes from the workers' "
                                                                   f"speeds): drop the schedule; {p}local_steps is "
                                                                   f"the cap")

    def local_steps_at(self, r: int) -> int:
        """H of round r (local_steps_schedule, else local_steps)."""
        H = self.local_steps
        for start, h in self.local_steps_schedule:
            if start <= r:
                H = h
        return H

    @property
    def streaming(self) -> bool:
        """Streaming DiLoCo's worker loop (train/diloco/streaming.py): fragments, an overlap τ or a mix α."""
        return self.fragments > 1 or self.fragment_delay > 0 or self.fragment_mix > 0

    def round_steps_at(self, r: int) -> int:
        """Inner steps of round r: H, or H / P with fragments (a round syncs one fragment)."""
        return self.local_steps_at(r) // max(1, self.fragments)

    def validate(self, p: str) -> None:
        check_range(self, p, "num_workers", 1)
        sched = self.local_steps_schedule
        if not isinstance(sched, list) or not all(
                isinstance(e, list) and len(e) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in e)
                and e[0] >= 0 and e[1] >= 1 for e in sched):
            raise bad_value(p + "local_steps_schedule", sched, "must be a list of [from_round, H] pairs of integers "
                                                               "(from_round >= 0, H >= 1), e.g. [[0, 10], [10, 30]]")
        if any(b[0] <= a[0] for a, b in zip(sched, sched[1:])):
            raise bad_value(p + "local_steps_schedule", sched, "from_round must increase from entry to entry")
        check_choice(self, p, "lr_schedule")
        check_range(self, p, "lr_warmup_rounds", 0)
        if self.lr_schedule == "warmup" and self.lr_warmup_rounds < 1:
            raise bad_value(p + "lr_warmup_rounds", self.lr_warmup_rounds,
                            f"must be >= 1 with {p}lr_schedule = \"warmup\" (or use \"constant\")")
        check_range(self, p, "rounds", 1)
        check_range(self, p, "local_steps", 1)
        check_range(self, p, "lr", 0.0, lo_open=True)
        check_range(self, p, "momentum", 0.0, 1.0)
        check_range(self, p, "min_workers", 1, self.num_workers)
        check_range(self, p, "round_timeout_s", 0.0, lo_open=True)
        check_range(self, p, "dead_after_s", 2.0)  # > 1 s: at least two lease periods (train/core/heartbeat.py)
        check_range(self, p, "startup_grace_s", 0.0)
        check_range(self, p, "straggler_factor", 0.0)
        check_range(self, p, "late_weight", 0.0, 1.0)
        check_range(self, p, "max_restarts", 0)
        check_range(self, p, "poll_interval_s", 0.0, lo_open=True)
        check_range(self, p, "io_retry_s", 0.0)
        check_range(self, p, "disk_full_wait_s", 0.0)
        check_range(self, p, "screen_norm_ratio", 1.0, lo_open=True)
        check_range(self, p, "screen_min_cosine", -1.0, 1.0)
        check_choice(self, p, "screen_loss")
        check_range(self, p, "screen_loss_windows", 1)
        check_range(self, p, "screen_loss_margin", 0.0)
        check_range(self, p, "keep_rounds", 1)
        check_choice(self, p, "delta_dtype")
        check_choice(self, p, "compression")
        check_range(self, p, "density", 0.0, 1.0, lo_open=True)
        check_range(self, p, "chunk_size", 2, 1 << 20)
        check_choice(self, p, "sparse_values")
        check_range(self, p, "ef_decay", 0.0, 1.0)
        check_choice(self, p, "overlap")
        check_range(self, p, "overlap_steps", 0)
        check_range(self, p, "fragments", 1)
        check_range(self, p, "fragment_delay", 0)
        check_range(self, p, "fragment_mix", 0.0, 1.0)
        if self.fragments > 1:
            if self.local_steps_schedule:
                raise bad_value(p + "local_steps_schedule", self.local_steps_schedule,
                                f"is not supported with {p}fragments > 1 (each fragment is synced every H steps): "
                                f"use one {p}local_steps")
            if self.local_steps % self.fragments:
                raise bad_value(p + "fragments", self.fragments,
                                f"must divide {p}local_steps = {self.local_steps} (a round is H / P inner steps): "
                                f"e.g. local_steps = {self.fragments * max(1, self.local_steps // self.fragments)}")
        if self.fragment_delay and self.fragment_delay >= self.round_steps_at(0):
            raise bad_value(p + "fragment_delay", self.fragment_delay,
                            f"must be below {p}local_steps / {p}fragments = {self.round_steps_at(0)} (τ < H/P: a "
                            f"fragment's outer result is taken in before the next round's sync)")
        if self.streaming and self.overlap != "none":
            raise bad_value(p + "overlap", self.overlap,
                            f"does not combine with streaming DiLoCo ({p}fragments / fragment_delay / "
                            f"fragment_mix): {p}fragment_delay is its overlap; set {p}overlap = \"none\"")
        self.validate_pace(p)
        check_range(self, p, "block_size", 8, 1 << 20)
        check_range(self, p, "checkpoint_every", 1)
        if self.block_size % 2:
            raise bad_value(p + "block_size", self.block_size, "must be even (int4 packs two codes per byte)")
