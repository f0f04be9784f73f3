"""machines.json: the hosts the launcher starts processes on (typed, documented, validated like evolution.json).

A plain list of host strings (the prototype's format) or objects with the fields of `Machine`; mistakes fail with
`ConfigError: machines.json: entry 1: <field> = <value>: <what is allowed>`. Nothing here touches the disk at
import time.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from train.config import ConfigError, bad_value, coerce_value, field_types, doc, read_json_file

@dataclass(kw_only=True)
class Machine:
    host: str = doc("", "Host name or address to SSH to.")
    port: int = doc(22, "SSH port.")
    user: str | None = doc(None, "SSH user; default: your local user / ~/.ssh/config.")
    identity_file: str | None = doc(None, "Private key file; default: ssh-agent and ~/.ssh/id_*.")
    python: str = doc("python3", "Interpreter (or venv python) on that host.")
    workdir: str | None = doc(None, "The project checkout on that host (usually on the shared disk); default: "
                                    "the launcher's own checkout path.")
    env: dict = doc({}, "Extra environment variables for the processes on that host.")
    setup: str | None = doc(None, "A shell line run before the worker, e.g. `source /share/venv/bin/activate`.")
    gpus: int | list | None = doc(None, "Worker processes on that host, one per GPU: N (CUDA_VISIBLE_DEVICES=0..N-1) "
                                        "or a list of device ids such as [0, 2]; default: 1 process, devices as is.")
    procs_per_worker: int | None = doc(None, "Processes per worker on that host (a torchrun group, one per GPU); "
                                              "with `gpus`, each worker gets this many of them; default: "
                                              "inner.nproc_per_node of the run.")
    name: str | None = doc(None, "Label used in logs and status; default: host[:port].")

    @property
    def label(self) -> str:
        return self.name or (self.host if self.port == 22 else f"{self.host}:{self.port}")

    @property
    def gpu_ids(self) -> list[int] | None:
        """The CUDA device ids of this host's worker slots (None: one slot, CUDA_VISIBLE_DEVICES left alone)."""
        if self.gpus is None:
            return None
        return list(range(self.gpus)) if isinstance(self.gpus, int) else list(self.gpus)


# variables that hold credentials: refused in machines.json's env (train/core/objstore.py reads them from the
# environment or the AWS files of each host)
SECRET_ENV = frozenset({"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"})


def load_machines(path: str | os.PathLike) -> list[Machine]:
    """Load machines.json: a list of host strings (the prototype's format) or of objects with Machine fields."""
    p = Path(path)
    raw = read_json_file(p, "no such file (a JSON list of hosts, e.g. [\"gpu1\", \"gpu2\"])")
    if isinstance(raw, dict) and "machines" in raw:
        raw = raw["machines"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{p}: must be a non-empty JSON list of hosts (strings or objects)")
    hints = field_types(Machine)
    known = [f.name for f in dataclasses.fields(Machine)]
    out = []
    for i, entry in enumerate(raw):
        where = f"{p}: entry {i}"
        if isinstance(entry, str):
            entry = {"host": entry}
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} = {json.dumps(entry)}: must be a host string or an object")
        m = Machine()
        for k, v in entry.items():
            if k not in known:
                close = difflib.get_close_matches(k, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f" (allowed: {', '.join(known)})"
                raise ConfigError(f"{where}: unknown key {k!r}{hint}")
            try:
                if k == "gpus" and isinstance(v, list):
                    if not v or any(not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in v) \
                            or len(set(v)) != len(v):
                        raise bad_value(k, v, "must be a count >= 1 or a non-empty list of distinct device ids >= 0")
                    m.gpus = list(v)
                    continue
                setattr(m, k, coerce_value(k, v, hints[k]))
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        if not m.host or any(c.isspace() for c in m.host) or m.host.startswith("-"):
            raise ConfigError(f"{where}: host = {json.dumps(m.host)}: must be a host name or address "
                              "(no spaces, not starting with '-')")
        if not 1 <= m.port <= 65535:
            raise ConfigError(f"{where}: port = {m.port}: must be 1..65535")
        if isinstance(m.gpus, int) and m.gpus < 1:
            raise ConfigError(f"{where}: gpus = {m.gpus}: must be >= 1")
        if m.procs_per_worker is not None:
            if m.procs_per_worker < 1:
                raise ConfigError(f"{where}: procs_per_worker = {m.procs_per_worker}: must be >= 1")
            if m.gpu_ids is not None and len(m.gpu_ids) % m.procs_per_worker:
                raise ConfigError(f"{where}: gpus = {json.dumps(m.gpus)} does not split into workers of "
                                  f"procs_per_worker = {m.procs_per_worker} GPUs: list a multiple of "
                                  f"{m.procs_per_worker} devices")
        if not m.python or m.python.startswith("-"):
            raise ConfigError(f"{where}: python = {json.dumps(m.python)}: must be an interpreter name or path")
        if m.workdir is not None and not m.workdir:
            raise ConfigError(f"{where}: workdir = \"\": must be a folder path (or leave it out)")
        if m.setup is not None and ("\n" in m.setup or "\r" in m.setup):
            raise ConfigError(f"{where}: setup = {json.dumps(m.setup)}: must be one shell line (join commands "
                              "with &&)")
        if m.identity_file is not None:  # a missing key must fail here (--dry-run), not at the first connect
            # as train/launch/ssh.py reads it: ~ expanded, else from cwd
            key = Path(os.path.expanduser(m.identity_file))
            if not key.is_file():
                raise ConfigError(f"{where} (host {m.host}): identity_file = {json.dumps(m.identity_file)}: no such "
                                  f"file ({key.absolute()}); point it at your private key (e.g. ~/.ssh/id_ed25519, "
                                  f"made by ssh-keygen) or leave it out to use ssh-agent and ~/.ssh/id_*")
        if m.name is not None and (not m.name or not m.name.isprintable()):
            raise ConfigError(f"{where}: name = {json.dumps(m.name)}: must be a non-empty printable label")
        for k, v in m.env.items():
            if not isinstance(v, str) or not k.replace("_", "a").isalnum() or k[0].isdigit():
                raise ConfigError(f"{where}: env[{k!r}]: names must be [A-Za-z_][A-Za-z0-9_]* and values strings")
            if k in SECRET_ENV:  # they would sit in this file and on the remote command line
                raise ConfigError(f"{where}: env[{k!r}]: no secrets in machines.json (its env goes on the remote "
                                  f"command line): put them in ~/.aws/credentials on {m.host} and set AWS_PROFILE "
                                  f"here if it is not the default profile (docs/object-store.md)")
        out.append(m)
    labels = [m.label for m in out]
    dup = {x for x in labels if labels.count(x) > 1}
    if dup:
        raise ConfigError(f"{p}: duplicate machine {sorted(dup)[0]!r}: give entries distinct hosts, ports or names")
    return out
