"""One error contract for every entry point.

Every error a user can cause and fix (a config value, a missing file, an unreachable hub, a device that is not
there, a package that is not installed) is a `UserError`: its message names the file / field / host, the value and
what to do, and `run_main` prints it as one line and exits 2. Anything else is a bug and keeps its traceback.

    from train.core.errors import run_main
    if __name__ == "__main__":
        run_main(main, "diloco_sim")               # a command (the launcher, scripts/): cli=True, `error: ...`

Set `EDT_TRACEBACK=1` to see the traceback of a user error too (e.g. when reporting a bug in a message).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

EXIT_USER_ERROR = 2
EXIT_WORKER_DIED = 1
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Base of every error the user can fix; printed as one line, exit 2.

    The subclasses also derive from the builtin a library caller would catch (`ValueError` for a bad value,
    `FileNotFoundError`, `TimeoutError`, ...), so `except ValueError` around our code keeps working. The other way
    round, a handler that catches such a builtin around code that can raise a `UserError` lets it through
    (`except UserError: raise` first) unless swallowing it is the point, said in a comment there."""


class ConfigError(UserError, ValueError):
    """A bad value in evolution.json / machines.json / an override / a command-line flag (names the file and the
    field)."""


class ProtocolError(UserError, RuntimeError):
    """BASE_DIR holds something this run cannot use (another protocol version, another run's identity, a bad file,
    too few valid deltas)."""


class ModelError(UserError, ValueError):
    """A model that cannot be built, loaded or merged: unreachable hub, a directory without weights, mismatched
    tensors, architectures / shapes / names / vocabularies that differ, a merge recipe that cannot be applied."""


MergeError = ModelError  # the merge code's name for it (train.merge.methods re-exports it): one class, two names


class NotFound(UserError, FileNotFoundError):
    """A file, folder, model or dataset that the config names does not exist."""


class DataError(UserError, ValueError):
    """A dataset or tokenizer that cannot be used: unreachable hub, unsupported files, too little text."""


class EnvironmentProblem(UserError, RuntimeError):
    """The machine lacks what the config asks for: a CUDA device, an optional package, a writable directory, a
    program to run."""


class TimedOut(UserError, TimeoutError):
    """Waited the configured time for another process's file (a peer's delta, the reducer's round, the coordinator's
    data) and it did not come: names what, where, the timeout and what to start or raise."""


class WorkerDied(RuntimeError):
    """A worker process exited before the run finished (exit 1: rerun the same command to resume)."""


def missing_package(package: str, purpose: str, extra: str | None = None) -> EnvironmentProblem:
    """The error for an optional dependency that is not installed, with the command that installs it."""
    how = f"pip install 'edt[{extra}]'" if extra else f"pip install {package}"
    return EnvironmentProblem(f"{purpose} needs the package {package!r}, which is not installed: {how}")


def setup_logging(name: str, level: int = logging.INFO, background: bool = False) -> logging.Logger:
    """One stderr handler for the process (the simulator and the launcher send each process's stderr to its log).

    `background` (the workers): the lines are written by a listener thread, so a training thread never blocks on
    a log file on a slow shared disk (a worker's stderr is BASE_DIR/logs/worker-NNN.log; on a busy NFS link one
    small write waits behind the deltas in flight). The queue is flushed at exit."""
    root = logging.getLogger()
    if not any(getattr(h, "_edt", False) for h in root.handlers):
        h = _StderrHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        if background:
            import atexit
            import queue
            from logging.handlers import QueueHandler, QueueListener

            q: queue.SimpleQueue = queue.SimpleQueue()
            global _listener
            _listener = QueueListener(q, h)
            _listener.start()
            atexit.register(flush_logs)
            h = QueueHandler(q)
        h._edt = True  # type: ignore[attr-defined]
        root.addHandler(h)
        root.setLevel(level)
    return logging.getLogger(name)


_listener = None  # the background log writer of setup_logging(background=True)


class _StderrHandler(logging.StreamHandler):
    """stderr, which the simulators and the launcher point at the run's logs/ on BASE_DIR: a line that meets a full
    disk there (ENOSPC, EDQUOT) is kept (up to HOLD lines) and written before the next line once there is space, so
    the lines a process logs while it waits for space (train/core/sharedfs.py) reach its log afterwards, whole and
    in order, instead of being lost or torn. Writes go to the file descriptor (a partial write goes on from where
    it stopped); a stream without one (a test's capture) is written as logging always does."""

    HOLD = 10000

    def __init__(self, stream) -> None:
        super().__init__(stream)
        import collections
        self._held: collections.deque = collections.deque()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):
            fd = None
        if fd is None:
            return super().emit(record)
        try:
            data = (self.format(record) + self.terminator).encode("utf-8", "replace")
        except Exception:  # noqa: BLE001  (logging's own contract: a bad record is reported, not raised)
            self.handleError(record)
            return
        import errno
        with self.lock:
            if len(self._held) < self.HOLD:
                self._held.append(data)
            try:
                self.stream.flush()  # what print() left in the stream's buffer goes first
            except (OSError, ValueError):
                pass
            while self._held:
                head = self._held[0]
                try:
                    n = os.write(fd, head)
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT):
                        return  # kept: written with the next line once there is space
                    self._held.popleft()
                    self.handleError(record)
                    return
                if n < len(head):
                    self._held[0] = head[n:]
                else:
                    self._held.popleft()


def flush_logs() -> None:
    """Write every queued line of the background log writer and stop it (later lines go straight to stderr)."""
    global _listener
    if _listener is None:
        return
    listener, _listener = _listener, None
    listener.stop()  # drains the queue
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_edt", False)]:
        root.removeHandler(h)
        root.addHandler(listener.handlers[0])


def _is_secondary_rank() -> bool:
    """Inside a torchrun group, ranks > 0 stay quiet about errors rank 0 reports too (same config, same message)."""
    try:
        return int(os.environ.get("RANK", "0")) > 0
    except ValueError:
        return False


def run_main(fn: Callable[[], int | None], name: str, level: int = logging.INFO,
             background_log: bool = False, cli: bool = False, fast_exit: bool = False) -> None:
    """Run an entry point's body: a `UserError` prints one line (exit 2), a dead worker exit 1, Ctrl-C exit 130.

    An `OSError` naming a path (a `base_dir` under a file, a read-only disk, no space left) is the user's
    machine, not a bug: one line too. In a torchrun group, ranks > 0 print nothing for an error rank 0 also
    reports, and a rank that loses its peers because another rank exited says so in one line.

    `cli`: a command that runs and returns (the SSH launcher, scripts/, `python -m train.config`) rather than a
    process of a run: its one line is `error: <message>` as argparse writes its own, without the log prefix.
    `fast_exit`: a process of a run that imported torch and transformers (coordinators, workers, simulators) ends
    by `exit_now`, without the interpreter's teardown of their modules (1.5-2 s of CPU per process, measured).
    """
    secondary = _is_secondary_rank()
    log = setup_logging(name, logging.ERROR if secondary else level, background_log)
    if secondary:
        import warnings
        warnings.simplefilter("ignore")  # rank 0 prints each warning once for the whole group
    show_tb = os.environ.get("EDT_TRACEBACK", "") not in ("", "0")

    def say(message: str) -> None:
        if cli:
            print(f"error: {message}", file=sys.stderr, flush=True)
        else:
            log.error("%s", message)

    try:  # the background log writer is flushed before a traceback is printed or the process exits
        try:
            code = fn() or 0
        except UserError as e:
            if show_tb:
                raise
            if not secondary:
                say(" ".join(str(e).split("\n")))
            code = EXIT_USER_ERROR
            if getattr(e, "retryable", False):
                note_retryable_exit()
        except OSError as e:
            if show_tb or not getattr(e, "filename", None):
                raise
            say(f"{e.filename}: {e.strerror or e} (check that the path exists, is a directory where one is expected, "
                f"is writable and the disk has space)")
            code = EXIT_USER_ERROR
        except WorkerDied as e:
            log.error("%s", e)
            code = EXIT_WORKER_DIED
        except KeyboardInterrupt:
            if not cli:  # a command's Ctrl-C is the user's own doing; a run's stops its children (and resumes)
                log.warning("interrupted: every child process was stopped; run the same command to resume")
            code = EXIT_INTERRUPTED
        except Exception as e:  # noqa: BLE001  (a peer rank's exit is not this rank's bug)
            if secondary and _is_lost_peer(e):
                log.error("rank %s: lost its process group (another rank exited; its log has the reason)",
                          os.environ.get("RANK"))
                code = EXIT_WORKER_DIED
            else:
                raise
    finally:
        flush_logs()
    if fast_exit:
        exit_now(code)
    sys.exit(code)


def exit_now(code: int) -> None:
    """End the process as the interpreter does (threads joined, atexit handlers run, streams flushed), then
    os._exit: without the teardown of every module and object that follows, which for torch + transformers costs
    1.5-2 s of CPU at every exit (a run starts and ends many processes; every file a run writes is complete by
    now: atomic renames, no buffered writer is left open)."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first: executors told to stop, the
    if shutdown is not None:                          # non-daemon threads joined
        shutdown()
    else:  # pragma: no cover  (every supported Python has it)
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


EXIT_NOTE_ENV = "EDT_EXIT_NOTE"  # a file the supervisor names: "retryable" there makes an exit 2 worth a restart


def note_retryable_exit() -> None:
    """Tell our supervisor (train/launch/procs.py) that this exit 2 is not the user's to fix (the shared disk kept
    failing: train/core/sharedfs.py), so it restarts us like a crash."""
    note = os.environ.get(EXIT_NOTE_ENV)
    if note:
        try:
            with open(note, "w") as f:
                f.write("retryable\n")
        except OSError:
            pass


def _is_lost_peer(e: BaseException) -> bool:
    """A collective failed because a peer went away (gloo/NCCL report this as RuntimeError subclasses)."""
    text = f"{type(e).__name__}: {e}".lower()
    return any(s in text for s in ("distbackenderror", "connection closed by peer", "connection reset by peer",
                                   "broken pipe", "nccl", "gloo", "socket timeout", "timed out"))
