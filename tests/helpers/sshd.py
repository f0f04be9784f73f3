"""A private OpenSSH server for the launcher tests: a child process on a free loopback port, listening on 127.0.0.1
and 127.0.0.2 (two "machines"), with a generated host key, a generated user key and its own sshd_config, all in
the test's temp dir. No system sshd, no system config, no ~/.ssh is touched.

The one thing outside the temp dir: when running as root, sshd insists on its privilege-separation directory
/run/sshd (the Debian service creates it at start); it is created if missing. Without an sshd binary the tests
skip with the reason (`apt-get install openssh-server`; .ci/run installs it).
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

HOSTS = ("127.0.0.1", "127.0.0.2")


def find_sshd() -> str | None:
    for cand in (shutil.which("sshd"), "/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if cand and os.access(cand, os.X_OK):
            return os.path.abspath(cand)  # sshd re-execs itself: it needs an absolute path
    return None


def skip_reason() -> str | None:
    if find_sshd() is None:
        return "no sshd binary: `apt-get install openssh-server` (.ci/run does) to run the SSH launcher tests"
    if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
        try:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        except OSError as e:
            return f"sshd needs /run/sshd and it cannot be created: {e}"
    return None


def new_key(path: Path) -> str:
    """Write an ed25519 private key (OpenSSH format, mode 600); return the public key line."""
    k = ed25519.Ed25519PrivateKey.generate()
    path.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                     serialization.NoEncryption()))
    path.chmod(0o600)
    pub = k.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    Path(str(path) + ".pub").write_text(pub + "\n")
    return pub


def free_port() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.2", port))
            return port
        except OSError:
            continue
    raise RuntimeError("no free loopback port")


@dataclass
class SSHD:
    dir: Path
    port: int
    identity: Path
    known_hosts: Path
    host_pub: str
    user: str
    proc: subprocess.Popen

    def machine(self, host: str, name: str, **extra) -> dict:
        return {"host": host, "port": self.port, "user": self.user, "identity_file": str(self.identity),
                "name": name, **extra}

    def log(self) -> str:
        return (self.dir / "sshd.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # our own child's group (started with its own session)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_sshd(folder: Path) -> SSHD:
    folder.mkdir(parents=True, exist_ok=True)
    host_pub = new_key(folder / "host_ed25519")
    user_pub = new_key(folder / "id_ed25519")
    (folder / "authorized_keys").write_text(user_pub + "\n")
    port = free_port()
    cfg = folder / "sshd_config"
    cfg.write_text("\n".join([
        f"Port {port}", *(f"ListenAddress {h}" for h in HOSTS), f"HostKey {folder / 'host_ed25519'}",
        f"PidFile {folder / 'sshd.pid'}", f"AuthorizedKeysFile {folder / 'authorized_keys'}",
        "PermitRootLogin prohibit-password", "PubkeyAuthentication yes", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "X11Forwarding no",
        "AllowTcpForwarding no", "PermitTTY no", "MaxStartups 50", "LogLevel VERBOSE", ""]))
    (folder / "known_hosts").write_text("".join(f"[{h}]:{port} {host_pub}\n" for h in HOSTS))
    log = open(folder / "sshd.log", "ab")
    proc = subprocess.Popen([find_sshd(), "-D", "-e", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    d = SSHD(folder, port, folder / "id_ed25519", folder / "known_hosts", host_pub, getpass.getuser(), proc)
    deadline = time.monotonic() + 15
    pending = list(HOSTS)
    while pending:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with status {proc.returncode}:\n{d.log()}")
        if time.monotonic() > deadline:
            d.stop()
            raise RuntimeError(f"sshd did not listen on {pending} within 15s:\n{d.log()}")
        try:
            socket.create_connection((pending[0], port), timeout=1).close()
            pending.pop(0)
        except OSError:
            time.sleep(0.1)
    return d
