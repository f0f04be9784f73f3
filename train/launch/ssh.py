"""SSH done right, on paramiko: verified host keys, key/agent auth, timeouts everywhere, both streams drained.

    opts = SSHOptions(known_hosts=None, accept_new_host_keys=False, connect_timeout=10)
    conn = connect(machine, opts)                 # raises SSHError with the host, the cause and the fix
    res = conn.run("uname -a", timeout=30)        # Result(rc, out, err); CommandTimeout after 30 s
    conn.close()

Host keys are checked against known_hosts (~/.ssh/known_hosts and /etc/ssh/ssh_known_hosts, or the file given);
an unknown key is refused with its fingerprint and the ways to trust it, a changed key is refused as a possible
man-in-the-middle. `accept_new_host_keys` (the launcher's --accept-new-host-keys) trusts a key never seen before and
appends it to known_hosts, like OpenSSH's StrictHostKeyChecking=accept-new; a changed key is refused even then.
Authentication: the machine's identity_file, the ssh-agent and ~/.ssh/id_* (OpenSSH's defaults). Never a password.
"""
from __future__ import annotations

import base64
import errno
import getpass
import hashlib
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import paramiko

from train.core.errors import UserError
from train.launch.machines import Machine

USER_KNOWN_HOSTS = "~/.ssh/known_hosts"
MAX_CHANNELS = 8  # concurrent commands per connection (OpenSSH's MaxSessions defaults to 10)
SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"


class SSHError(UserError, RuntimeError):
    """Connecting to or running on a host failed; the message says which host, why, and what to do (a user error:
    one line and exit 2 where it ends a command; the launcher reports it per host where it does not)."""


class HostKeyError(SSHError):
    pass


class CommandTimeout(SSHError):
    pass


@dataclass
class SSHOptions:
    known_hosts: str | None = None        # a known_hosts file to use instead of the user's and the system's
    accept_new_host_keys: bool = False    # trust (and record) keys of hosts never seen before
    connect_timeout: float = 10.0         # TCP connect, SSH banner and authentication, each
    ssh_config: str | None = "~/.ssh/config"  # HostName / User / Port / IdentityFile of host aliases


@dataclass
class Result:
    rc: int
    out: str
    err: str


def fingerprint(key: paramiko.PKey) -> str:
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


def known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


class _UnknownHostKey(paramiko.MissingHostKeyPolicy):
    """Refuse (default) or accept-and-record a key that known_hosts does not have."""

    def __init__(self, opts: SSHOptions):
        self.opts = opts

    def missing_host_key(self, client, hostname, key):
        path = os.path.expanduser(self.opts.known_hosts or USER_KNOWN_HOSTS)
        if self.opts.accept_new_host_keys:
            Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            client.get_host_keys().add(hostname, key.get_name(), key)
            return
        host, _, port = hostname.strip("[").partition("]:")
        scan = f"ssh-keyscan {'-p ' + port + ' ' if port else ''}{host} >> {path}"
        raise HostKeyError(
            f"{hostname}: host key {fingerprint(key)} is not in {path}: refusing to connect. Check the fingerprint "
            f"with the machine's admin (on the host: `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`), then "
            f"trust it by connecting once with `ssh {'-p ' + port + ' ' if port else ''}{host}` and answering yes, "
            f"or `{scan}`, or rerun with --accept-new-host-keys (trusts and records keys never seen before).")


def _ssh_config_for(m: Machine, opts: SSHOptions) -> dict:
    path = os.path.expanduser(opts.ssh_config) if opts.ssh_config else None
    if not path or not os.path.isfile(path):
        return {}
    try:
        return paramiko.SSHConfig.from_path(path).lookup(m.host)
    except Exception:  # a config paramiko cannot parse: OpenSSH options still apply to `ssh` itself
        return {}


class Connection:
    def __init__(self, machine: Machine, client: paramiko.SSHClient):
        self.machine, self.client = machine, client
        self.label = machine.label
        self._slots = threading.Semaphore(MAX_CHANNELS)

    def run(self, command: str, timeout: float | None, on_line: Callable[[str], None] | None = None,
            cancel: threading.Event | None = None) -> Result:
        """Run `command` (a shell line) and collect stdout and stderr concurrently until it exits.

        `on_line` receives stdout line by line as it arrives (follow mode); `cancel` ends the command early (the
        channel closes, so the remote side sees EOF on stdin). Raises CommandTimeout after `timeout` seconds."""
        with self._slots:  # sshd allows 10 sessions per connection (MaxSessions)
            return self._run(command, timeout, on_line, cancel)

    def _run(self, command, timeout, on_line, cancel) -> Result:
        t = self.client.get_transport()
        if t is None or not t.is_active():
            raise SSHError(f"{self.label}: the SSH connection was lost")
        chan = t.open_session(timeout=30)
        out, err, partial = bytearray(), bytearray(), bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            chan.exec_command(command)
            while True:
                busy = False
                if chan.recv_ready():
                    data = chan.recv(1 << 16)
                    busy = True
                    out += data
                    if on_line is not None:
                        partial += data
                        *lines, rest = partial.split(b"\n")
                        partial[:] = rest
                        for ln in lines:
                            on_line(ln.decode(errors="replace"))
                if chan.recv_stderr_ready():
                    err += chan.recv_stderr(1 << 16)
                    busy = True
                if not busy:
                    if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                        break
                    if cancel is not None and cancel.is_set():
                        return Result(0, out.decode(errors="replace"), err.decode(errors="replace"))
                    if deadline is not None and time.monotonic() > deadline:
                        raise CommandTimeout(f"{self.label}: no answer within {timeout:.0f}s from: {command[:200]}")
                    time.sleep(0.02)
            if on_line is not None and partial:
                on_line(partial.decode(errors="replace"))
            return Result(chan.recv_exit_status(), out.decode(errors="replace"), err.decode(errors="replace"))
        finally:
            chan.close()

    def close(self) -> None:
        self.client.close()


def connect(m: Machine, opts: SSHOptions) -> Connection:
    """Open an authenticated SSH connection to `m`, or raise SSHError naming the host, the cause and the fix."""
    sc = _ssh_config_for(m, opts)
    host = sc.get("hostname", m.host)
    port = m.port if m.port != 22 or "port" not in sc else int(sc["port"])
    user = m.user or sc.get("user") or getpass.getuser()
    keys = [os.path.expanduser(m.identity_file)] if m.identity_file else \
        [os.path.expanduser(k) for k in sc.get("identityfile", []) if os.path.isfile(os.path.expanduser(k))]
    where = f"{m.label} ({user}@{known_hosts_name(host, port)})"
    client = paramiko.SSHClient()
    if opts.known_hosts:
        kh = os.path.expanduser(opts.known_hosts)
        if os.path.isfile(kh):
            client.load_host_keys(kh)
    else:
        for kh in (SYSTEM_KNOWN_HOSTS, USER_KNOWN_HOSTS):
            if os.path.isfile(os.path.expanduser(kh)):
                client.load_system_host_keys(os.path.expanduser(kh))
    client.set_missing_host_key_policy(_UnknownHostKey(opts))
    to = opts.connect_timeout
    try:
        client.connect(host, port=port, username=user, key_filename=keys or None, timeout=to, banner_timeout=to,
                       auth_timeout=to, channel_timeout=to, allow_agent=True, look_for_keys=not keys,
                       password=None, passphrase=None)
    except HostKeyError:
        client.close()
        raise
    except paramiko.BadHostKeyException as e:
        client.close()
        kh = opts.known_hosts or USER_KNOWN_HOSTS
        raise HostKeyError(
            f"{where}: HOST KEY MISMATCH: the server presents {fingerprint(e.key)} but {kh} expects "
            f"{fingerprint(e.expected_key)}. Someone may be intercepting the connection, or the machine was "
            f"reinstalled. Refusing to connect. If the admin confirms the new key: "
            f"`ssh-keygen -R '{known_hosts_name(host, port)}' -f {kh}`, then trust the new key "
            f"(`ssh -p {port} {user}@{host}` once).") from None
    except paramiko.PasswordRequiredException:
        client.close()
        raise SSHError(f"{where}: the private key {keys[0] if keys else ''} is encrypted: load it into ssh-agent "
                       f"(`ssh-add {keys[0] if keys else '~/.ssh/id_ed25519'}`); passwords are not read") from None
    except paramiko.AuthenticationException as e:
        client.close()
        tried = f"identity_file {keys[0]}" if keys else "ssh-agent and ~/.ssh/id_*"
        raise SSHError(f"{where}: authentication failed ({e}); tried {tried}. Install your public key on that host "
                       f"(`ssh-copy-id -p {port} {user}@{host}`) or set identity_file in machines.json. Password "
                       f"login is not supported.") from None
    except (socket.timeout, TimeoutError) as e:
        client.close()
        raise SSHError(f"{where}: no connection within {to:.0f}s ({e or 'timed out'}): is the host up and the "
                       f"port right?") from None
    except ConnectionRefusedError:
        client.close()
        raise SSHError(f"{where}: connection refused: no SSH server listens on port {port}") from None
    except paramiko.ssh_exception.NoValidConnectionsError as e:  # every address of the host failed
        client.close()
        refused = all(isinstance(x, ConnectionRefusedError) or getattr(x, "errno", None) == errno.ECONNREFUSED
                      for x in e.errors.values())
        raise SSHError(f"{where}: connection refused: no SSH server listens on port {port}" if refused else
                       f"{where}: cannot connect: {e}") from None
    except socket.gaierror as e:
        client.close()
        raise SSHError(f"{where}: unknown host ({e.strerror}): check the name in machines.json") from None
    except (paramiko.SSHException, OSError, EOFError) as e:
        t = client.get_transport()
        cause = getattr(t, "saved_exception", None) or e  # the transport thread's own error says more
        client.close()
        if "banner" in str(cause).lower() or str(cause) in ("No existing session", "Negotiation failed."):
            raise SSHError(f"{where}: no SSH handshake within {to:.0f}s (no banner or key exchange): is this port "
                           f"an SSH server, and is the host responsive?") from None
        raise SSHError(f"{where}: {type(cause).__name__}: {cause}") from None
    t = client.get_transport()
    if t is not None:
        t.set_keepalive(15)
    return Connection(m, client)


def parallel(items: list, fn: Callable, max_workers: int = 32) -> list[tuple[object, BaseException | None]]:
    """fn(item) for every item at once; [(result, None) or (None, exception)] in the items' order."""
    if not items:
        return []

    def safe(it):
        try:
            return fn(it), None
        except Exception as e:  # reported per host by the caller
            return None, e

    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as ex:
        return list(ex.map(safe, items))
