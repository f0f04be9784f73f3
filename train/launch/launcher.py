"""Multi-machine runs over SSH: plan which process runs where, build the exact remote commands, run them on every
host in parallel, and summarise per host. The CLI is launch_to_machines.py; the remote side is train/launch/remote.py.

Plan: the coordinator on the first machine; worker i on slot i mod #slots, where the slots go round-robin over the
machines (and over the GPUs of machines with `gpus`): worker i runs on machine i while there are machines. A worker
of N processes (`procs_per_worker` of the machine, else inner.nproc_per_node) is a torchrun group on N of the GPUs.
Every value put into a remote command goes through shlex.quote (a leading ~/ becomes "$HOME"/); the only text sent
verbatim is a machine's own `setup` line, which is shell code by definition.
"""
from __future__ import annotations

import json
import logging
import shlex
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from train.config import REPO_ROOT, ConfigError, load_config
from train.launch.machines import Machine
from train.launch.procs import worker_argv
from train.launch.remote import MARK, code_fingerprint
from train.launch.ssh import CommandTimeout, Connection, SSHError, SSHOptions, connect, parallel
from train.core.store import sha256_file
from train.config.strategies import strategy as get_strategy

log = logging.getLogger("launcher")



@dataclass
class Proc:
    role: str                     # "coordinator" or "worker-007": names logs/<role>.log and launch/<role>.json
    machine: Machine
    argv: list[str]
    env: dict = field(default_factory=dict)


def q_path(p: str) -> str:
    """shlex.quote, except that a leading ~ / ~/ still means the remote user's home."""
    if p == "~":
        return '"$HOME"'
    if p.startswith("~/"):
        return '"$HOME"/' + shlex.quote(p[2:])
    return shlex.quote(p)


def shell_line(m: Machine, workdir: str, argv: list[str], env: dict) -> str:
    """`cd WORKDIR && [setup &&] [env K=V ...] ARGV`, every word quoted."""
    words = [q_path(a) if i == 0 or (i > 0 and argv[i - 1] == "--") else shlex.quote(a) for i, a in enumerate(argv)]
    if env:
        words = ["env", *(shlex.quote(f"{k}={v}") for k, v in env.items()), *words]
    return " && ".join([f"cd {q_path(workdir)}", *([m.setup] if m.setup else []), " ".join(words)])


class Launcher:
    def __init__(self, machines: list[Machine], config_path: str, overrides: list[str], opts: SSHOptions,
                 timeout: float = 180.0, out: Callable[[str], None] = print, strategy: str = "diloco"):
        self.machines, self.opts, self.timeout, self.out = machines, opts, timeout, out
        self.config_path, self.user_overrides = config_path, list(overrides)
        self.root = REPO_ROOT  # this checkout; a machine's workdir is its counterpart there (default: same path)
        self.local_config = Path(config_path).resolve()
        # The config as the remote sees it: relative to the workdir when it lies in our checkout, else this path.
        self.config_arg = str(self.local_config.relative_to(self.root)) \
            if self.local_config.is_relative_to(self.root) else str(self.local_config)
        self._print_lock = threading.Lock()
        self.configure(strategy)

    def configure(self, strategy: str) -> None:
        """Load and validate the config for `strategy`, before anything runs anywhere. Values derived here rather
        than given by the user (outer.num_workers when not set: one worker per machine slot, the prototype's rule;
        the strategy's default project) become overrides of every remote process, so all of them agree."""
        get_strategy(strategy)  # a ConfigError naming the strategies when it is none of them
        self.strategy, n = strategy, len(self.machines)
        load = lambda n: load_config(self.config_path, self.user_overrides, strategy=strategy,  # noqa: E731
                                     defaults={"outer.num_workers": n})
        self.cfg, derived = load(n), []
        if "outer.num_workers" not in self.cfg.user_keys:
            if len(self.slots()) != n:  # machines with `gpus` hold several workers
                n = len(self.slots())
                self.cfg = load(n)
            derived = [f"outer.num_workers={n}"]
            log.info("outer.num_workers = %d: one worker per machine of machines.json (per GPU group where `gpus` is "
                     "set), as the prototype ran; set outer.num_workers to choose another number", n)
        else:
            slots = self.slots()
            used = {slots[i % len(slots)][0].label for i in range(self.cfg.outer.num_workers)}
            unused = [m.label for m in self.machines if m.label not in used]
            if unused:
                log.warning("machines.json: %d of %d machines get no worker (%s): outer.num_workers = %d is set in "
                            "the config; raise it, or leave it out to run one worker per machine", len(unused),
                            len(self.machines), ", ".join(unused), self.cfg.outer.num_workers)
        self.overrides = [*self.user_overrides, *derived, *self.cfg.default_overrides()]

    # -- plan and commands ------------------------------------------------------------------------------------------
    def workdir(self, m: Machine) -> str:
        return m.workdir or str(self.root)

    def sets(self) -> list[str]:
        return [x for ov in self.overrides for x in ("--set", ov)]

    def slots(self, strategy: str | None = None) -> list[tuple[Machine, list[int] | None]]:
        """Worker slots: round-robin over machines first, then over each machine's GPUs (or GPU groups)."""
        ms = self.machines
        groups = {m.label: self.device_groups(m, strategy or self.strategy) for m in ms}
        slots, depth = [], max(len(g) for g in groups.values())
        for k in range(depth):
            slots += [(m, groups[m.label][k]) for m in ms if k < len(groups[m.label])]
        return slots

    def plan(self, strategy: str | None = None) -> list[Proc]:
        strategy = strategy or self.strategy
        s, ms, slots = get_strategy(strategy), self.machines, self.slots(strategy)
        conf = ["--config", self.config_arg, *self.sets()]
        coordinator = [ms[0].python, "-m", s.coordinator_module, *conf, "--no-progress"]
        procs = [Proc("coordinator", ms[0], coordinator, dict(ms[0].env))]
        for i in range(self.cfg.outer.num_workers):
            m, gpus = slots[i % len(slots)]
            n = self.procs_per_worker(m)
            env = {**m.env, **({} if gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))})}
            # the group size goes into the config too, so the worker checks that the batch splits over it
            sets = [] if n == self.cfg.inner.nproc_per_node else ["--set", f"inner.nproc_per_node={n}"]
            procs.append(Proc(f"worker-{i:03d}", m, [*worker_argv(m.python, s.worker_module, n), *conf[:2], "--worker",
                                                     str(i), *conf[2:], *sets], env))
        return procs

    def procs_per_worker(self, m: Machine) -> int:
        return m.procs_per_worker or self.cfg.inner.nproc_per_node

    def device_groups(self, m: Machine, strategy: str) -> list[list[int] | None]:
        """The worker slots of a machine: groups of procs_per_worker of its GPUs (None: devices left as is)."""
        n = self.procs_per_worker(m)
        if n > 1 and not get_strategy(strategy).multi_process:
            raise ConfigError(f"{m.label}: {strategy} workers run as one process each, but this machine asks for "
                              f"{n} per worker (procs_per_worker / inner.nproc_per_node): set them to 1")
        if m.gpu_ids is None:
            return [None]
        if len(m.gpu_ids) % n:
            raise ConfigError(f"{m.label}: gpus = {m.gpus} does not split into workers of {n} processes "
                              f"(inner.nproc_per_node): list a multiple of {n} devices or set procs_per_worker")
        return [m.gpu_ids[k: k + n] for k in range(0, len(m.gpu_ids), n)]

    def roles(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {m.label: [] for m in self.machines}
        for p in self.plan():
            out[p.machine.label].append(p.role)
        return out

    def helper(self, m: Machine, command: str, *extra: str, env: dict | None = None) -> str:
        argv = [m.python, "-m", "train.launch.remote", command, "--config", self.config_arg, *self.sets(), *extra]
        return shell_line(m, self.workdir(m), argv, m.env if env is None else env)

    def start_line(self, p: Proc, check: float) -> str:
        return self.helper(p.machine, "start", "--machine", p.machine.label, "--role", p.role, "--check",
                           str(check), "--", *p.argv, env=p.env)

    # -- plumbing ---------------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        with self._print_lock:
            self.out(text)

    def connect_all(self, machines: list[Machine]) -> tuple[dict[str, Connection], dict[str, str]]:
        res = parallel(machines, lambda m: connect(m, self.opts))
        conns = {m.label: c for m, (c, e) in zip(machines, res) if e is None}
        errors = {m.label: str(e) for m, (c, e) in zip(machines, res) if e is not None}
        return conns, errors

    def call(self, conn: Connection, line: str, timeout: float | None = None) -> dict:
        """Run a train.launch.remote command; its JSON answer (or SSHError with what the remote printed)."""
        r = conn.run(line, timeout or self.timeout)
        for ln in reversed(r.out.splitlines()):
            if ln.startswith(MARK):
                ans = json.loads(ln[len(MARK):])
                if "error" in ans and "state" not in ans:
                    raise SSHError(f"{conn.label}: {ans['error']}")
                return ans
        detail = (r.err.strip() or r.out.strip() or "(no output)").splitlines()[-6:]
        hint = ""
        if "No module named train" in r.err or "No module named 'train'" in r.err:
            hint = f" (is workdir {self.workdir(conn.machine)!r} the project checkout on that host?)"
        elif r.rc == 127:
            hint = f" (is python {conn.machine.python!r} right, and does `setup` work?)"
        raise SSHError(f"{conn.label}: exit status {r.rc}{hint}: " + " | ".join(detail))

    def summary(self, title: str, rows: dict[str, tuple[bool, str]]) -> bool:
        width = max([len(k) for k in rows] + [8])
        self.say(title)
        for label, (ok, text) in rows.items():
            lines = text.splitlines() or [""]
            self.say(f"  {label:<{width}}  {'ok    ' if ok else 'FAILED'}  {lines[0]}")
            for ln in lines[1:]:
                self.say(f"  {'':<{width}}          {ln}")
        return all(ok for ok, _ in rows.values())

    def _dry(self, lines: list[tuple[Machine, str]]) -> int:
        for m, line in lines:
            self.say(f"[{m.label}] {(m.user + '@') if m.user else ''}{m.host}:{m.port} $ {line}")
        return 0

    # -- launch -----------------------------------------------------------------------------------------------------
    def launch(self, strategy: str | None = None, dry_run: bool = False, keep_on_failure: bool = False,
               check: float = 2.0) -> int:
        if strategy and strategy != self.strategy:
            self.configure(strategy)  # its default project and checks
        strategy = self.strategy
        procs = self.plan()
        if dry_run:
            return self._dry([(p.machine, self.start_line(p, check)) for p in procs])
        used = list({p.machine.label: p.machine for p in procs}.values())
        conns, errors = self.connect_all(used)
        try:
            if errors:
                self.summary("launch: not started (cannot reach every host):",
                             {m.label: (m.label in conns, errors.get(m.label, "reachable")) for m in used})
                return 1
            res = parallel(procs, lambda p: self.call(conns[p.machine.label], self.start_line(p, check),
                                                      self.timeout + check))
            rows: dict[str, tuple[bool, str]] = {}
            started, failed = [], False
            for p, (ans, err) in zip(procs, res):
                ok = err is None and ans.get("state") == "running"
                if err is not None:
                    text = f"{p.role}: {err}"
                    if isinstance(err, CommandTimeout):
                        started.append(p)  # it may have started after all: include it when cleaning up
                elif ok:
                    text = f"{p.role}: {'already running, left as is' if ans['reused'] else 'started'}, pid " \
                           f"{ans['pid']}, log {ans['log']}"
                    if not ans["reused"]:
                        started.append(p)
                else:
                    text = f"{p.role}: {ans.get('error')}" + "".join(f"\n  | {x}" for x in ans.get("log_tail", []))
                failed |= not ok
                prev_ok, prev = rows.get(p.machine.label, (True, ""))
                rows[p.machine.label] = (prev_ok and ok, (prev + "\n" if prev else "") + text)
            self.summary(f"launch ({strategy}, run {self.cfg.run_dir}):", rows)
            if failed and started and not keep_on_failure:
                self.say("some processes failed to start: stopping the ones started now (--keep-on-failure keeps "
                         "them)")
                by_host: dict[str, list[str]] = {}
                for p in started:
                    by_host.setdefault(p.machine.label, []).append(p.role)
                self._stop(conns, by_host, grace=10.0)
            if not failed:
                self.say("next: `python launch_to_machines.py status`, `... logs -f`, `... stop` (same options)")
            return 1 if failed else 0
        finally:
            for c in conns.values():
                c.close()

    # -- stop -------------------------------------------------------------------------------------------------------
    def _stop(self, conns: dict[str, Connection], roles: dict[str, list[str]] | None, grace: float) -> bool:
        labels = list(conns) if roles is None else [lb for lb in roles if lb in conns and roles[lb]]

        def one(label):
            extra = [x for r in (roles or {}).get(label, []) for x in ("--role", r)]
            m = conns[label].machine
            return self.call(conns[label], self.helper(m, "stop", "--machine", label, "--grace", str(grace), *extra),
                             self.timeout + grace + 10)

        res = parallel(labels, one)
        rows = {lb: (e is None, str(e) if e else "\n".join(f"{r}: {t}" for r, t in a["stopped"].items())
                     or "nothing recorded on this host") for lb, (a, e) in zip(labels, res)}
        return self.summary("stop:", rows)

    def stop(self, dry_run: bool = False, grace: float = 10.0) -> int:
        if dry_run:
            return self._dry([(m, self.helper(m, "stop", "--machine", m.label, "--grace", str(grace)))
                              for m in self.machines])
        conns, errors = self.connect_all(self.machines)
        try:
            ok = self._stop(conns, None, grace)
            if errors:
                self.summary("unreachable (their processes were NOT stopped):",
                             {k: (False, v) for k, v in errors.items()})
            return 0 if ok and not errors else 1
        finally:
            for c in conns.values():
                c.close()

    # -- status -----------------------------------------------------------------------------------------------------
    def status(self, dry_run: bool = False, as_json: bool = False) -> int:
        roles = self.roles()
        lines = {m.label: self.helper(m, "status", "--machine", m.label, *[x for r in roles[m.label]
                                                                               for x in ("--role", r)])
                 for m in self.machines}
        if dry_run:
            return self._dry([(m, lines[m.label]) for m in self.machines])
        conns, errors = self.connect_all(self.machines)
        try:
            res = dict(zip(conns, parallel(list(conns), lambda lb: self.call(conns[lb], lines[lb]))))
            view = self.run_view(conns)
        finally:
            for c in conns.values():
                c.close()
        hosts = {lb: ({"error": errors[lb], "unreachable": True} if lb in errors else
                      {"error": str(res[lb][1])} if res[lb][1] else res[lb][0]) for lb in roles}
        run = next((h["run"] for h in hosts.values() if "run" in h), None)
        if as_json:
            self.say(json.dumps({"hosts": hosts, "run": run, "view": view}, indent=1, sort_keys=True))
        else:
            self._print_status(hosts, run)
            from train.status.view import render
            self.say(render(view) if "workers" in view else f"run status: {view.get('error')}")
        return 0 if not any("error" in h for h in hosts.values()) else 1

    def run_view(self, conns: dict[str, Connection]) -> dict:
        """The run's status view (`python -m train.status RUN_DIR --json`, docs/status.md), read on the first reachable
        machine (every machine mounts BASE_DIR): {"error": why} when none could."""
        for m in self.machines:
            if m.label not in conns:
                continue
            line = shell_line(m, self.workdir(m), [m.python, "-m", "train.status", str(self.cfg.run_dir), "--json"],
                              m.env)
            try:
                r = conns[m.label].run(line, self.timeout)
            except (SSHError, CommandTimeout) as e:
                return {"error": f"{m.label}: {e}"}
            if r.rc == 0 and r.out.strip():
                return json.loads(r.out.strip().splitlines()[-1])
            return {"error": f"{m.label}: " + ((r.err.strip() or r.out.strip() or f"exit status {r.rc}")
                                               .splitlines()[-1])}
        return {"error": "no machine reachable"}

    def _print_status(self, hosts: dict, run: dict | None) -> None:
        rows = []
        for label, h in hosts.items():
            if "error" in h:
                rows.append((label, "-", "UNREACHABLE" if h.get("unreachable") else "ERROR", "", "", h["error"]))
                continue
            for p in h["processes"]:
                pr = p.get("progress") or {}
                where = ""
                if p["role"] == "coordinator":  # the run's commits, then what its lease says it does, and when
                    if run and run.get("committed_generation") is not None:
                        where = f"gen committed {run['committed_generation']}/{run['generations']}"
                    elif run:
                        where = f"committed {run['committed']}/{run['rounds']}"
                    if pr.get("status"):
                        at = next((f" {k} {pr[k]}" for k in ("round", "generation") if k in pr), "")
                        where += f", {pr['status']}{at}"
                    if "beat_age_s" in pr and p["state"] == "running":
                        where += f", beat {pr['beat_age_s']:g} s ago"
                elif "generation" in pr or "round" in pr:
                    where = f"gen {pr['generation']}" if "generation" in pr else f"round {pr['round']}"
                    where += f" {pr.get('status', '')}" + (f" {pr['step']}/{pr['steps']}" if "steps" in pr else "")
                elif pr.get("status"):
                    where = pr["status"]
                last = p.get("log_last", "")
                rows.append((label, p["role"], p.get("summary") or p["state"], str(p.get("pid") or ""),
                             where.strip(", "), last if len(last) <= 120 else last[:117] + "..."))
        head = ("host", "process", "state", "pid", "round/generation", "last log line")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
        for r in [head, *rows]:
            self.say("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
        if any(r[2].startswith("stopped: died") for r in rows):
            self.say("a process that died (killed, or its supervisor was) is started again by `launch` (idempotent): "
                     "it resumes from its state, the coordinator from its last commit")
        if run:
            last = run.get("last") or {}
            what = f"generation {run['committed_generation']} of {run['generations']}" \
                if run.get("committed_generation") is not None else f"round {run['committed']} of {run['rounds']}"
            self.say(f"run {run['run_dir']}: latest committed {what}"
                     + (f", eval loss {last['eval_loss']:.4f}" if isinstance(last.get("eval_loss"), float) else "")
                     + (", final model written" if run.get("final") else ""))

    # -- logs -------------------------------------------------------------------------------------------------------
    def logs(self, host: str | None = None, lines: int = 20, follow: bool = False, for_s: float = 0.0,
             dry_run: bool = False) -> int:
        roles = self.roles()
        ms = [m for m in self.machines if host in (None, m.label, m.host, m.name)]
        if not ms:
            raise ConfigError(f"--host {host}: not in machines.json (labels: {', '.join(roles)})")
        ms = [m for m in ms if roles[m.label]]
        cmd = {m.label: self.helper(m, "logs", "--lines", str(lines), *(["--follow"] if follow else []),
                                    *(["--for", str(for_s)] if for_s else []),
                                    *[x for r in roles[m.label] for x in ("--role", r)]) for m in ms}
        if dry_run:
            return self._dry([(m, cmd[m.label]) for m in ms])
        conns, errors = self.connect_all(ms)
        cancel = threading.Event()

        def show(label):
            def line(text):
                role, _, rest = text.partition("\t")
                self.say(f"[{label} {role}] {rest}")
            return line

        def one(label):
            to = None if follow and not for_s else (for_s + self.timeout)
            return conns[label].run(cmd[label], to, on_line=show(label) if follow else None, cancel=cancel)

        try:
            if follow:
                box: list = []
                t = threading.Thread(target=lambda: box.append(parallel(list(conns), one)), daemon=True)
                t.start()
                try:
                    while t.is_alive():
                        t.join(0.2)
                except KeyboardInterrupt:
                    cancel.set()  # closes the channels: the remote `logs --follow` sees EOF and exits
                    t.join(10)
                res = box[0] if box else []
            else:
                res = parallel(list(conns), one)
                for label, (r, e) in zip(conns, res):
                    for ln in (r.out.splitlines() if r else []):
                        show(label)(ln)
            bad = {lb: str(e) for lb, (r, e) in zip(conns, res) if e is not None}
            bad.update({lb: f"exit status {r.rc}: {r.err.strip()[-300:]}" for lb, (r, e) in zip(conns, res)
                        if r is not None and r.rc})
            bad.update(errors)
            if bad:
                self.summary("logs: some hosts failed:", {k: (False, v) for k, v in bad.items()})
            return 1 if bad else 0
        finally:
            for c in conns.values():
                c.close()

    # -- preflight --------------------------------------------------------------------------------------------------
    def preflight(self, dry_run: bool = False) -> int:
        token = uuid.uuid4().hex[:12]
        first = self.machines[0]
        if dry_run:
            return self._dry([(m, self.helper(m, "preflight", *(("--write-token", token) if m is first else
                                                                   ("--read-token", token))))
                              for m in self.machines])
        conns, errors = self.connect_all(self.machines)
        rows = {lb: (False, f"ssh: {e}") for lb, e in errors.items()}
        try:
            writer = next((m for m in self.machines if m.label in conns), None)
            if writer is None:
                return 0 if self.summary("preflight:", rows) else 1
            info = {writer.label: self._try(conns[writer.label], self.helper(writer, "preflight", "--write-token",
                                                                              token))}
            others = [lb for lb in conns if lb != writer.label]
            for lb in others:  # in parallel, after the writer: do they see its token?
                info[lb] = {}
            got = parallel(others, lambda lb: self._try(conns[lb], self.helper(conns[lb].machine, "preflight",
                                                                                "--read-token", token)))
            info.update({lb: a for lb, (a, _) in zip(others, got)})
            self._try(conns[writer.label], self.helper(writer, "preflight", "--remove-token", token))
            local_cfg, local_code = sha256_file(self.local_config), code_fingerprint(self.root)
            for m in self.machines:
                if m.label in info:
                    rows[m.label] = self._judge(m, info[m.label], writer, local_cfg, local_code)
            ok = self.summary("preflight:", rows)
            self.say("preflight: all hosts ready" if ok else "preflight: fix the FAILED hosts above, then rerun")
            return 0 if ok else 1
        finally:
            for c in conns.values():
                c.close()

    def _try(self, conn: Connection, line: str) -> dict:
        try:
            return self.call(conn, line)
        except SSHError as e:
            return {"error": str(e)}

    def _judge(self, m: Machine, i: dict, writer: Machine, local_cfg: str, local_code: str) -> tuple[bool, str]:
        if "error" in i:
            return False, f"ssh ok; cannot run the project there: {i['error']}"
        ok, notes = True, [f"ssh ok, {i['hostname']}, python {i['python_version']} ({i['python']})"]
        for mod in ("torch", "transformers"):
            if mod in i:
                notes.append(f"{mod} {i[mod]}")
            else:
                ok = False
                notes.append(f"{mod}: NOT importable ({i.get(mod + '_error')}): install it for {m.python!r}")
        if "cuda_devices" in i:
            need = max(m.gpu_ids) + 1 if m.gpu_ids else 0
            notes.append(f"{i['cuda_devices']} CUDA device(s)")
            if need > i["cuda_devices"]:
                ok = False
                notes.append(f"machines.json gpus = {m.gpus} needs {need} devices, torch sees {i['cuda_devices']}")
        if i["config_sha256"] != local_cfg:
            ok = False
            notes.append(f"config {self.config_arg} differs from the local {self.local_config}: the workers "
                         f"would train with other settings (is workdir on the shared disk?)")
        if i["code"] != local_code:
            notes.append(f"warning: code in {i['cwd']} differs from the local checkout {self.root}")
        tok = i.get("token")
        if m is writer:
            ok &= tok == "written"
            notes.append(f"BASE_DIR {i['base_dir']}: token written" if tok == "written" else
                         f"BASE_DIR {i['base_dir']}: cannot write ({tok})")
        elif tok == "seen":
            notes.append(f"BASE_DIR {i['base_dir']}: shared (sees the token written by {writer.label})")
        else:
            ok = False
            notes.append(f"BASE_DIR {i['base_dir']}: NOT the directory {writer.label} wrote to (token {tok}): "
                         f"mount the shared disk at the same path everywhere, or set an absolute base_dir on it")
        return ok, "\n".join(notes)
