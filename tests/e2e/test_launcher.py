"""launch_to_machines.py against a real OpenSSH server (tests/helpers/sshd.py): two "machines" (127.0.0.1 and
127.0.0.2 on one private sshd), a 2-worker DiLoCo run launched, watched, stopped, resumed; host-key refusal;
timeouts; hostile values in machines.json / evolution.json run nothing. Fast tests of the plan and the quoting
need no sshd."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, tiny_config
from tests.helpers.proc import wait_until
from tests.helpers.sshd import HOSTS, free_port, new_key, skip_reason, start_sshd
from train.config import ConfigError
from train.launch.machines import load_machines
from train.launch.launcher import Launcher, shell_line
from train.launch.remote import group_members, records, state_of
from train.launch.ssh import HostKeyError, SSHError, SSHOptions, connect
from train.exchange.store import DiLoCoPaths

pytestmark = pytest.mark.xdist_group("sshd")  # one xdist worker: the module's shared fixture

ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
HOSTILE = ["; touch pwned1", "$(touch pwned2)", "`touch pwned3`", "a b\nc; touch pwned4 #", "'; touch pwned5; '",
           '"; touch pwned6; "', "x && touch pwned7 || touch pwned8", "\\'$(touch pwned9)"]


# -- fast: plan, strategy table, quoting, dry run (no sshd) ---------------------------------------------------------
def _launcher(tmp_path, machines, **sections) -> Launcher:
    (tmp_path / "machines.json").write_text(json.dumps(machines))
    cfg = tmp_path / "evolution.json"
    cfg.write_text(json.dumps(tiny_config(tmp_path / "runs", **sections)))
    return Launcher(load_machines(tmp_path / "machines.json"), str(cfg), ["inner.threads=1"], SSHOptions())


def test_plan_worker_i_on_machine_i_round_robin_over_gpus(tmp_path):
    ln = _launcher(tmp_path, [{"host": "a", "gpus": 2}, "b", {"host": "c", "gpus": [3]}], outer={"num_workers": 6})
    procs = ln.plan()
    assert [(p.role, p.machine.host, p.env.get("CUDA_VISIBLE_DEVICES")) for p in procs] == [
        ("coordinator", "a", None), ("worker-000", "a", "0"), ("worker-001", "b", None), ("worker-002", "c", "3"),
        ("worker-003", "a", "1"), ("worker-004", "a", "0"), ("worker-005", "b", None)]
    assert procs[0].argv[1:4] == ["-m", "diloco", "--config"] and procs[0].argv[-1] == "--no-progress"
    assert procs[1].argv[1:3] == ["-m", "train.diloco.worker"] and procs[1].argv[-4:] == ["--worker", "0", "--set",
                                                                                     "inner.threads=1"]
    edt = ln.plan("edt")
    assert edt[0].argv[1:3] == ["-m", "edt"]  # the coordinator runs as a module (train/config/strategies.py)
    assert edt[1].argv[2] == "train.edt.worker"
    with pytest.raises(ConfigError, match="strategy .nope. is not one of diloco, edt"):
        ln.plan("nope")


@pytest.mark.parametrize("entry, expected", [
    ({"host": "a", "gpus": [0, 0]}, "distinct device ids"), ({"host": "a", "gpus": [-1]}, "distinct device ids"),
    ({"host": "a", "gpus": []}, "non-empty list"), ({"host": "a", "python": "-c"}, "python = \"-c\""),
    ({"host": "a", "setup": "a\nb"}, "one shell line"), ({"host": "a", "name": "x\ty"}, "printable label"),
])
def test_machine_validation(tmp_path, entry, expected):
    (tmp_path / "m.json").write_text(json.dumps([entry]))
    with pytest.raises(ConfigError, match=expected):
        load_machines(tmp_path / "m.json")


def test_every_value_in_a_remote_command_is_quoted(tmp_path):
    evil = "\n".join(HOSTILE)
    ln = _launcher(tmp_path, [{"host": "a", "name": "m1 " + evil.replace("\n", " "), "workdir": "/w " + evil,
                               "python": "py " + evil,
                               "env": {"EVIL": evil}}])
    p = ln.plan()[1]
    line = ln.start_line(p, 1.0)
    words = shlex.split(line)  # what a POSIX shell makes of it: the exact values, nothing executed
    assert words[:3] == ["cd", "/w " + evil, "&&"]
    assert words[3:6] == ["env", "EVIL=" + evil, "py " + evil]
    assert words[words.index("--machine") + 1] == "m1 " + evil.replace("\n", " ")
    assert words[words.index("--") + 1:] == p.argv
    home = shell_line(p.machine, "~/edt", ["~/venv/bin/python", "-V"], {})
    assert home == 'cd "$HOME"/edt && "$HOME"/venv/bin/python -V'


def test_dry_run_prints_exact_commands_and_connects_to_nothing(tmp_path):
    port = free_port()  # nothing listens there: a connection attempt would fail the command
    (tmp_path / "machines.json").write_text(json.dumps([{"host": "127.0.0.1", "port": port, "name": "m1"},
                                                        {"host": "127.0.0.2", "port": port, "name": "m2"}]))
    (tmp_path / "evolution.json").write_text(json.dumps(tiny_config(tmp_path / "runs")))
    for sub in ("launch", "status", "logs", "stop", "preflight"):
        out = subprocess.run([sys.executable, str(REPO / "launch_to_machines.py"), sub, "--dry-run", "--machines",
                              str(tmp_path / "machines.json"), "--config", str(tmp_path / "evolution.json")],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        helper = {"launch": "start"}.get(sub, sub)
        assert f"[m1] 127.0.0.1:{port} $ cd {REPO} && python3 -m train.launch.remote {helper}" in out.stdout, out.stdout
        if sub == "launch":
            assert "--role worker-001 --check 2.0 -- python3 -m train.diloco.worker --config" in out.stdout
            assert not (tmp_path / "runs").exists()


def _config_without(tmp_path, *keys, **sections) -> Path:
    """tiny_config with some keys left out (e.g. outer.num_workers, project_name), as the user did."""
    raw = tiny_config(tmp_path / "runs", **sections)
    for key in keys:
        *parents, leaf = key.split(".")
        d = raw
        for part in parents:
            d = d[part]
        d.pop(leaf)
    (tmp_path / "evolution.json").write_text(json.dumps(raw))
    return tmp_path / "evolution.json"


def test_one_worker_per_machine_when_num_workers_is_not_set(tmp_path, caplog):
    (tmp_path / "machines.json").write_text(json.dumps(["192.168.0.1", "192.168.0.2", "192.168.0.3"]))  # seed 000
    cfg = _config_without(tmp_path, "outer.num_workers")
    with caplog.at_level("INFO", logger="launcher"):
        ln = Launcher(load_machines(tmp_path / "machines.json"), str(cfg), [], SSHOptions())
    procs = ln.plan()
    assert ln.cfg.outer.num_workers == 3 and "outer.num_workers" not in ln.cfg.user_keys
    assert [(p.role, p.machine.host) for p in procs[1:]] == [("worker-000", "192.168.0.1"),
                                                             ("worker-001", "192.168.0.2"),
                                                             ("worker-002", "192.168.0.3")]
    # every remote process gets the derived count, so the coordinator waits for exactly these workers
    assert all(p.argv[p.argv.index("outer.num_workers=3") - 1] == "--set" for p in procs)
    assert "outer.num_workers = 3: one worker per machine of machines.json" in caplog.text
    # machines with `gpus` hold one worker per GPU (group)
    (tmp_path / "machines.json").write_text(json.dumps([{"host": "a", "gpus": 2}, "b"]))
    ln = Launcher(load_machines(tmp_path / "machines.json"), str(cfg), [], SSHOptions())
    assert ln.cfg.outer.num_workers == 3 and [p.machine.host for p in ln.plan()[1:]] == ["a", "b", "a"]
    # the user's count (file, override or prototype NUM_MACHINES) is never replaced
    ln = Launcher(load_machines(tmp_path / "machines.json"), str(cfg), ["outer.num_workers=5"], SSHOptions())
    assert ln.cfg.outer.num_workers == 5 and not any("=5" in o for o in ln.overrides[1:])


def test_machines_left_without_a_worker_are_named(tmp_path, caplog):
    ms = [{"host": "a"}, {"host": "b"}, {"host": "c", "name": "gpu-c"}]
    with caplog.at_level("INFO", logger="launcher"):
        ln = _launcher(tmp_path, ms, outer={"num_workers": 1, "min_workers": 1})
    assert [p.machine.host for p in ln.plan()] == ["a", "a"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["machines.json: 2 of 3 machines get no worker (b, gpu-c): outer.num_workers = 1 is set in "
                        "the config; raise it, or leave it out to run one worker per machine"]
    caplog.clear()
    with caplog.at_level("INFO", logger="launcher"):
        _launcher(tmp_path, ms, outer={"num_workers": 4})  # more workers than machines: round-robin, all used
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_the_strategy_names_the_default_project_of_every_process(tmp_path):
    (tmp_path / "machines.json").write_text(json.dumps(["a", "b"]))
    cfg = _config_without(tmp_path, "project_name")
    ms = load_machines(tmp_path / "machines.json")
    diloco = Launcher(ms, str(cfg), [], SSHOptions())
    edt = Launcher(ms, str(cfg), [], SSHOptions(), strategy="edt")
    assert (diloco.cfg.project_name, edt.cfg.project_name) == ("diloco-shakespeare", "edt-shakespeare")
    for p in edt.plan():
        assert p.argv[p.argv.index("project_name=edt-shakespeare") - 1] == "--set"
    assert "project_name=edt-shakespeare" in edt.helper(ms[0], "status")  # status / logs / stop look there too
    out: list[str] = []
    ln = Launcher(ms, str(cfg), [], SSHOptions(), out=out.append)
    assert ln.launch("edt", dry_run=True) == 0  # `launch --strategy edt` on a launcher made for the default
    assert ln.cfg.project_name == "edt-shakespeare" and all("project_name=edt-shakespeare" in x for x in out)
    assert all("train.edt.worker" in x for x in out[1:])


def test_missing_identity_file_fails_the_dry_run(tmp_path):
    (tmp_path / "machines.json").write_text(json.dumps([{"host": "gpu1", "identity_file": str(tmp_path / "nokey")}]))
    (tmp_path / "evolution.json").write_text(json.dumps(tiny_config(tmp_path / "runs")))
    out = subprocess.run([sys.executable, str(REPO / "launch_to_machines.py"), "launch", "--dry-run", "--machines",
                          str(tmp_path / "machines.json"), "--config", str(tmp_path / "evolution.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert f"error: {tmp_path / 'machines.json'}: entry 0 (host gpu1): identity_file = " in out.stderr
    assert "no such file" in out.stderr and "Traceback" not in out.stderr


# -- a private sshd -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    d = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield d
    d.stop()


class Cluster:
    """machines.json + evolution.json in a temp dir, and the CLI run as a real process."""

    def __init__(self, sshd, tmp: Path, machines: list[dict], cfg: dict):
        self.sshd, self.tmp = sshd, tmp
        self.machines, self.config = tmp / "machines.json", tmp / "evolution.json"
        self.machines.write_text(json.dumps(machines, indent=1))
        self.config.write_text(json.dumps(cfg, indent=1))
        (tmp / "home").mkdir(exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
        self.env["HOME"] = str(tmp / "home")  # the CLI sees no ~/.ssh of the real user

    def cli(self, *args: str, timeout: float = 240, known_hosts: str | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, str(REPO / "launch_to_machines.py"), *args, "--machines",
                              str(self.machines), "--config", str(self.config), "--known-hosts",
                              known_hosts or str(self.sshd.known_hosts), "--connect-timeout", "20", "--timeout",
                              "150"], capture_output=True, text=True, timeout=timeout, cwd=self.tmp, env=self.env)
        print(f"$ launch_to_machines.py {' '.join(args)} -> {out.returncode}\n{out.stdout}{out.stderr}")
        return out

    def status(self) -> dict:
        out = self.cli("status", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)


def kill_leftovers(run_dir: Path) -> None:
    """Safety net for failing tests: SIGKILL every recorded process group still alive (they run on this host)."""
    for rec in records(DiLoCoPaths(run_dir)).values():
        if state_of(rec) == "running":
            os.killpg(rec["pgid"], signal.SIGKILL)


def _machines(sshd, **extra) -> list[dict]:
    return [sshd.machine(HOSTS[0], "m1", python=sys.executable, workdir=str(REPO), env=ENV, **extra),
            sshd.machine(HOSTS[1], "m2", python=sys.executable, workdir=str(REPO), env=ENV, **extra)]


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_launch_status_logs_stop_resume_over_ssh(sshd, tmp_path):
    c = Cluster(sshd, tmp_path, _machines(sshd), tiny_config(tmp_path / "runs", outer={"rounds": 500,
                                                                                          "local_steps": 3}))
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    try:
        out = c.cli("launch", "--set", "inner.threads=1")
        assert out.returncode == 0 and out.stdout.count("started, pid") == 3, out.stdout + out.stderr
        recs = records(paths)
        assert {r: (x["machine"], x["pid"] == x["pgid"]) for r, x in recs.items()} == {
            "coordinator": ("m1", True), "worker-000": ("m1", True), "worker-001": ("m2", True)}
        assert recs["worker-001"]["log"] == str(paths.worker_log(1)) and recs["coordinator"]["command"][1:3] == \
            ["-m", "diloco"]
        # idempotent: a second launch reuses the live processes
        again = c.cli("launch", "--set", "inner.threads=1")
        assert again.returncode == 0 and again.stdout.count("already running, left as is") == 3, again.stdout
        assert {r: x["pid"] for r, x in records(paths).items()} == {r: x["pid"] for r, x in recs.items()}

        wait_until(lambda: (paths.latest_committed() or 0) >= 1, 240, "round 1 committed over SSH")
        st = c.status()
        assert st["run"]["committed"] >= 1 and st["run"]["rounds"] == 500
        procs = {(h, p["role"]): p for h, v in st["hosts"].items() for p in v["processes"]}
        assert set(procs) == {("m1", "coordinator"), ("m1", "worker-000"), ("m2", "worker-001")}
        assert all(p["state"] == "running" and p["pid"] == recs[p["role"]]["pid"] for p in procs.values())
        assert procs[("m2", "worker-001")]["progress"]["round"] >= 0
        # the run's own status view (python -m train.status, read on the first machine) beside the process table
        assert st["view"]["strategy"] == "diloco" and st["view"]["committed"] >= 1, st["view"]
        assert [w["worker"] for w in st["view"]["workers"]] == ["w000", "w001"], st["view"]["workers"]
        text = c.cli("status").stdout
        assert "m2    worker-001   running" in text and "latest committed round" in text, text
        assert "workers:" in text and "coordinator: " in text, text

        logs = c.cli("logs", "-n", "3").stdout
        for prefix in ("[m1 coordinator] ", "[m1 worker-000] ", "[m2 worker-001] "):
            assert prefix in logs, logs
        follow = c.cli("logs", "-f", "--for", "3", "--host", "m2", "-n", "1")
        assert follow.returncode == 0 and "[m2 worker-001] " in follow.stdout and "[m1" not in follow.stdout

        stop = c.cli("stop", "--grace", "20")
        assert stop.returncode == 0 and stop.stdout.count(" (SIG") == 3, stop.stdout
        for rec in records(paths).values():
            assert not group_members(rec["pgid"]) and rec["stopped_by"].startswith(("stopped", "killed"))
        assert all(p["state"] == "stopped" for v in c.status()["hosts"].values() for p in v["processes"])

        # the same launch resumes from the last committed round; with a reachable end the run completes
        done_at = (paths.latest_committed() or 0) + 1
        out = c.cli("launch", "--set", "inner.threads=1", "--rounds", str(done_at))
        assert out.returncode == 0 and out.stdout.count("started, pid") == 3, out.stdout
        wait_until(lambda: (paths.final / "MANIFEST.json").is_file(), 240, "the resumed run completes")
        wait_until(lambda: all(state_of(r) == "stopped" for r in records(paths).values()), 60, "processes exit")
        st = c.status()
        assert st["run"]["committed"] == done_at and st["run"]["final"]
        assert "already stopped" in c.cli("stop").stdout
    finally:
        kill_leftovers(paths.root)


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_a_host_that_fails_to_start_stops_the_others(sshd, tmp_path):
    ms = _machines(sshd)
    ms[1]["python"] = "/nonexistent/python3"
    c = Cluster(sshd, tmp_path, ms, tiny_config(tmp_path / "runs", outer={"rounds": 500}))
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    try:
        out = c.cli("launch", "--check-seconds", "0.5", "--keep-on-failure")
        assert out.returncode == 1 and "m2" in out.stdout and "FAILED" in out.stdout
        assert "is python '/nonexistent/python3' right" in out.stdout, out.stdout
        assert all(state_of(r) == "running" for r in records(paths).values())  # kept, as asked
        stop = c.cli("stop")  # m2 cannot even run the helper: reported, and m1's processes are stopped anyway
        assert stop.returncode == 1 and stop.stdout.count(": stopped (SIGTERM)") == 2, stop.stdout

        out = c.cli("launch", "--check-seconds", "0.5")
        assert out.returncode == 1 and "stopping the ones started now" in out.stdout, out.stdout
        recs = records(paths)
        assert set(recs) == {"coordinator", "worker-000"}
        assert all(state_of(r) == "stopped" and "stopped_by" in r for r in recs.values())
    finally:
        kill_leftovers(paths.root)


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
@pytest.mark.skipif(not (REPO / "edt.py").is_file() or not (REPO / "train" / "edt" / "worker.py").is_file(),
                    reason="the EDT strategy (edt.py, train/edt/worker.py) is not in this checkout")
# the long tier (CI runs it): the launcher over SSH is test_launch_status_logs_stop_resume_over_ssh's (DiLoCo, default
# tier), EDT's processes test_edt_e2e.py's; this is the two together
@pytest.mark.long
def test_edt_run_over_ssh(sshd, tmp_path):
    c = Cluster(sshd, tmp_path, _machines(sshd), tiny_config(tmp_path / "runs", edt={"max_generations": 2}))
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    try:
        out = c.cli("launch", "--strategy", "edt")
        assert out.returncode == 0 and out.stdout.count("started, pid") == 3, out.stdout + out.stderr
        cmds = {r: x["command"] for r, x in records(paths).items()}
        assert cmds["coordinator"][1:3] == ["-m", "edt"] and cmds["worker-001"][1:3] == ["-m", "train.edt.worker"]
        wait_until(lambda: (paths.final / "MANIFEST.json").is_file(), 300, "the EDT run completes over SSH")
        wait_until(lambda: all(state_of(r) == "stopped" for r in records(paths).values()), 60, "processes exit")
        st = c.status()
        assert st["run"]["committed_generation"] is not None and st["run"]["final"]
        assert "latest committed generation" in c.cli("status").stdout
    finally:
        kill_leftovers(paths.root)


# -- host keys and timeouts -------------------------------------------------------------------------------------------
def _fp(pub_line: str) -> str:
    blob = base64.b64decode(pub_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_unknown_and_changed_host_keys_are_refused(sshd, tmp_path):
    m = load_machines_from(tmp_path, [sshd.machine(HOSTS[0], "m1")])[0]
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyError) as e:
        connect(m, SSHOptions(known_hosts=str(empty), connect_timeout=10))
    msg = str(e.value)
    assert f"[127.0.0.1]:{sshd.port}" in msg and _fp(sshd.host_pub) in msg and "not in" in msg
    assert "--accept-new-host-keys" in msg and "ssh-keyscan" in msg
    assert empty.read_text() == ""  # nothing recorded without the opt-in

    other = tmp_path / "other_known_hosts"
    fake = new_key(tmp_path / "another_host_key")  # the known_hosts entry names another key: a changed host key
    other.write_text(f"[127.0.0.1]:{sshd.port} {fake}\n")
    with pytest.raises(HostKeyError, match="HOST KEY MISMATCH") as e:
        connect(m, SSHOptions(known_hosts=str(other), connect_timeout=10))
    assert "ssh-keygen -R" in str(e.value)
    with pytest.raises(HostKeyError, match="HOST KEY MISMATCH"):  # opting in to new keys never accepts a changed one
        connect(m, SSHOptions(known_hosts=str(other), accept_new_host_keys=True, connect_timeout=10))

    conn = connect(m, SSHOptions(known_hosts=str(empty), accept_new_host_keys=True, connect_timeout=10))
    assert conn.run("echo ok", 30).out.strip() == "ok"
    conn.close()
    assert sshd.host_pub.split()[1] in empty.read_text()
    connect(m, SSHOptions(known_hosts=str(empty), connect_timeout=10)).close()  # now known: no opt-in needed

    c = Cluster(sshd, tmp_path, _machines(sshd), tiny_config(tmp_path / "runs"))
    out = c.cli("launch", known_hosts=str(tmp_path / "missing_known_hosts"))
    assert out.returncode == 1 and "not started" in out.stdout and "refusing to connect" in out.stdout
    assert not (tmp_path / "runs").exists()  # nothing ran anywhere


def load_machines_from(tmp_path: Path, entries: list) -> list:
    (tmp_path / "m.json").write_text(json.dumps(entries))
    return load_machines(tmp_path / "m.json")


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_closed_port_and_silent_server_fail_within_the_timeout(sshd, tmp_path):
    opts = SSHOptions(known_hosts=str(sshd.known_hosts), connect_timeout=2)
    closed = free_port()
    m = load_machines_from(tmp_path, [{"host": "127.0.0.1", "port": closed}])[0]
    t0 = time.monotonic()
    with pytest.raises(SSHError, match="connection refused"):
        connect(m, opts)
    assert time.monotonic() - t0 < 5

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    held = []
    th = threading.Thread(target=lambda: held.append(srv.accept()), daemon=True)  # accepts, never speaks
    th.start()
    m = load_machines_from(tmp_path, [{"host": "127.0.0.1", "port": srv.getsockname()[1]}])[0]
    t0 = time.monotonic()
    with pytest.raises(SSHError) as e:
        connect(m, opts)
    assert time.monotonic() - t0 < 10 and "banner" in str(e.value).lower()
    srv.close()

    c = Cluster(sshd, tmp_path, [{"host": "127.0.0.1", "port": closed, "name": "dead"}, *_machines(sshd)[1:]],
                tiny_config(tmp_path / "runs"))
    t0 = time.monotonic()
    out = c.cli("status", timeout=60)
    assert out.returncode == 1 and "UNREACHABLE" in out.stdout and "connection refused" in out.stdout
    assert "m2" in out.stdout and time.monotonic() - t0 < 45


# -- injection -------------------------------------------------------------------------------------------------------
@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_hostile_values_in_machines_and_config_run_nothing(sshd, tmp_path):
    evil = "".join(HOSTILE)
    work = tmp_path / ("work " + evil.replace("/", "_"))  # the checkout on "both hosts", with a hostile path
    work.mkdir()
    for name in ("train", "diloco.py"):
        (work / name).symlink_to(REPO / name)
    home_before = {p.name for p in Path.home().iterdir()}
    label = evil.replace("\n", " ")  # labels are one printable line; everything else may hold a newline
    ms = [sshd.machine(h, f"{n} {label}", python=sys.executable, workdir=str(work), env={**ENV, "EVIL": evil})
          for h, n in zip(HOSTS, ("m1", "m2"))]
    project = "p " + evil.replace("/", "_")
    c = Cluster(sshd, tmp_path, ms, tiny_config(tmp_path / ("base " + evil.replace("/", "_")),
                                                project_name=project, outer={"rounds": 500, "local_steps": 2}))
    paths = DiLoCoPaths(tmp_path / ("base " + evil.replace("/", "_")) / project)
    try:
        pre = c.cli("preflight", "--set", f"data.text_field={evil}")
        assert pre.returncode == 0 and "shared (sees the token" in pre.stdout, pre.stdout
        out = c.cli("launch", "--set", f"data.text_field={evil}")
        assert out.returncode == 0, out.stdout + out.stderr
        recs = records(paths)
        assert {r["machine"] for r in recs.values()} == {f"m1 {label}", f"m2 {label}"}
        for rec in recs.values():  # the values arrived verbatim: as data, never as code
            environ = Path(f"/proc/{rec['pid']}/environ").read_bytes().split(b"\0")
            assert ("EVIL=" + evil).encode() in environ
            assert f"data.text_field={evil}" in rec["command"] and rec["cwd"] == str(work)
        st = c.status()
        assert all(p["state"] == "running" for v in st["hosts"].values() for p in v["processes"])
        assert f"[m2 {label} worker-001]" in c.cli("logs", "-n", "2").stdout
        assert c.cli("stop").returncode == 0
        assert all(state_of(r) == "stopped" for r in records(paths).values())
    finally:
        kill_leftovers(paths.root)
    found = [str(p) for root in (tmp_path, REPO) for p in root.rglob("pwned*")]
    found += [n for n in {p.name for p in Path.home().iterdir()} - home_before if n.startswith("pwned")]
    assert not found, f"a hostile value was executed: {found}"


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_preflight_catches_a_base_dir_that_is_not_shared(sshd, tmp_path):
    ms = _machines(sshd)
    for m, h in zip(ms, ("home1", "home2")):  # base_dir "~/runs": each "host" has its own home
        (tmp_path / h).mkdir()
        m["env"] = {**ENV, "HOME": str(tmp_path / h)}
    ms[1]["gpus"] = 1  # and a GPU that this CPU machine does not have
    c = Cluster(sshd, tmp_path, ms, {**tiny_config(tmp_path), "base_dir": "~/runs"})
    out = c.cli("preflight")
    assert out.returncode == 1, out.stdout
    m1, m2 = out.stdout.split("\n  m2")
    assert "m1        ok" in m1 and "torch " in m1 and "transformers " in m1 and "token written" in m1
    assert "FAILED" in m2 and f"BASE_DIR {tmp_path / 'home2' / 'runs'}: NOT the directory m1 wrote to" in m2
    assert "gpus = 1 needs 1 devices, torch sees 0" in m2
    assert not list((tmp_path / "home1" / "runs").glob(".edt-preflight-*"))  # the token is cleaned up
