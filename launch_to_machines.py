"""Run DiLoCo / EDT on several machines that share BASE_DIR on one disk: over SSH (machines.json) or as a Slurm job.

    python launch_to_machines.py preflight          # SSH, python, torch, transformers, GPUs, shared BASE_DIR
    python launch_to_machines.py                    # = launch: coordinator on the first machine, worker i on machine i
    python launch_to_machines.py launch --strategy edt --rounds 20 --set outer.lr=0.5
    python launch_to_machines.py status             # per host: running/stopped, pid, round, last log line
    python launch_to_machines.py logs -f [--host gpu2]
    python launch_to_machines.py stop               # stops exactly the recorded process groups
    python launch_to_machines.py launch --backend slurm --nodes 2 --time 4:00:00   # one sbatch job (docs/slurm.md)
Every subcommand takes --dry-run (print the exact remote commands, connect to nothing). Host keys are verified
against ~/.ssh/known_hosts; authentication is by key or ssh-agent, never by password. See docs/multi-machine.md.
"""
from __future__ import annotations

try:  # first: `train` is this project's package even beside a user's train.py (_edt_bootstrap.py)
    import _edt_bootstrap  # noqa: F401
except ModuleNotFoundError:  # an editable install older than it (pip install -e . again): no guard
    pass

import argparse
import sys

COMMANDS = ("launch", "status", "logs", "stop", "preflight")

EPILOG = """backends (--backend, on every subcommand):
  ssh    the default: the hosts of machines.json over SSH, coordinator on the first (docs/multi-machine.md)
           python launch_to_machines.py launch --rounds 20 --set outer.lr=0.5
  slurm  one sbatch job on a Slurm cluster, its nodes from the allocation (docs/slurm.md)
           python launch_to_machines.py launch --backend slurm --nodes 2 --time 4:00:00

Without a subcommand: launch (the prototype's behaviour). Every subcommand takes --dry-run (print the exact
commands, run nothing) and --help (its options: python launch_to_machines.py launch --help)."""


def build_parser() -> argparse.ArgumentParser:
    from train.launch.cli import add_config_args
    from train.config.strategies import STRATEGIES
    from train.launch.slurm import add_slurm_args

    common = argparse.ArgumentParser(add_help=False)
    add_config_args(common)
    g = common.add_argument_group("machines and SSH")
    g.add_argument("--machines", default="machines.json", help="hosts file (default: %(default)s)")
    g.add_argument("--known-hosts", help="known_hosts file to check host keys against (default: ~/.ssh/known_hosts "
                                         "and /etc/ssh/ssh_known_hosts)")
    g.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust and record the keys of hosts never seen before (a CHANGED key is still refused)")
    g.add_argument("--connect-timeout", type=float, default=10.0, help="seconds for TCP connect, SSH banner and "
                                                                        "authentication, each (default: %(default)s)")
    g.add_argument("--timeout", type=float, default=180.0, help="seconds a remote command may take (default: "
                                                                "%(default)s)")
    g.add_argument("--dry-run", action="store_true", help="print the exact remote commands; connect to nothing")
    g.add_argument("--strategy", choices=sorted(STRATEGIES), default="diloco",
                   help="diloco or edt: which run (and its default project) the subcommand is about")
    g.add_argument("--backend", choices=("ssh", "slurm"), default="ssh",
                   help="ssh: the hosts of machines.json; slurm: one batch job (sbatch), see docs/slurm.md")
    add_slurm_args(common)

    ap = argparse.ArgumentParser(prog="launch_to_machines.py", description=__doc__.split("\n")[0], epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", parents=[common], help="start the coordinator and the workers")
    p.add_argument("--keep-on-failure", action="store_true",
                   help="when a host fails to start, keep the processes started on the others")
    p.add_argument("--check-seconds", type=float, default=2.0,
                   help="a process that exits within this many seconds counts as failed to start")
    p = sub.add_parser("status", parents=[common], help="per host: processes, pids, round, last log line")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("logs", parents=[common], help="tail the logs, lines prefixed by host and process")
    p.add_argument("--host", help="only this machine (label or host); with --backend slurm: this process "
                                   "(worker-001, coordinator, or slurm: the job script's output)")
    p.add_argument("-n", "--lines", type=int, default=20)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C ends)")
    p.add_argument("--for", dest="for_s", type=float, default=0.0, help="with -f: stop following after N seconds")
    p = sub.add_parser("stop", parents=[common], help="stop the run's processes on every host")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    sub.add_parser("preflight", parents=[common], help="check every host before a run")
    return ap


def main(argv: list[str] | None = None) -> int:
    """The subcommand's exit status: 0 done, 1 some host failed (its summary says which). A user error (a bad
    config or machines.json, an unreachable host where it ends the command: SSHError) goes up to run_main."""
    import logging

    from train.launch.cli import overrides_from
    from train.launch.launcher import Launcher
    from train.launch.machines import load_machines
    from train.launch.ssh import SSHOptions

    logging.getLogger("paramiko").setLevel(logging.CRITICAL)  # its errors reach us as SSHError, with the fix
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = next((x for x in argv if x in COMMANDS), None)
    if cmd is not None:  # options may come before the subcommand
        argv.remove(cmd)
    elif argv[:1] in (["-h"], ["--help"]):
        cmd = None
    else:
        cmd = "launch"  # the prototype's `python launch_to_machines.py`
    argv = ([cmd] if cmd else []) + argv
    a = build_parser().parse_args(argv)
    if a.backend == "slurm":  # one batch job instead of machines.json (train/launch/slurm.py)
        from train.launch.slurm_ops import run_command
        return run_command(a)
    machines = load_machines(a.machines)
    opts = SSHOptions(known_hosts=a.known_hosts, accept_new_host_keys=a.accept_new_host_keys,
                      connect_timeout=a.connect_timeout)
    ln = Launcher(machines, a.config, overrides_from(a), opts, timeout=a.timeout, strategy=a.strategy)
    if a.command == "launch":
        return ln.launch(a.strategy, a.dry_run, a.keep_on_failure, a.check_seconds)
    if a.command == "status":
        return ln.status(a.dry_run, a.json)
    if a.command == "logs":
        return ln.logs(a.host, a.lines, a.follow, a.for_s, a.dry_run)
    if a.command == "stop":
        return ln.stop(a.dry_run, a.grace)
    return ln.preflight(a.dry_run)


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "launcher", cli=True)  # info lines (the derived worker count, config notes) on stderr
