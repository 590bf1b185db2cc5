"""The draft worker in a child process of its own, without Ray: the CPU draft's runtime.

Why: an idle Ray cluster beside plain vLLM on both cores cost it 2-3% at batch 1 and 16
(benchmarks/ray_idle_cost.py; docs/measurements.md, issue 19's "Seventh round"). On CPU
the draft's cores are lent to the target whenever the draft idles, and Ray's daemons and
its actor's core worker (~530 wake-ups a second in all) share them with the target's
borrowed OpenMP thread. A child process started here has no daemons: it sleeps in
recv() until the target calls, and its two call threads sleep on a queue.

The handle looks like a Ray actor's to the caller (``handle.step.remote(...)`` returns
a pending call), with the same concurrency (two calls at a time: step() must be able to
cut a pre-speculation short, see DraftWorker.step). Calls and replies are pickled over a
socket pair: the round's payload is small (outcomes, drafts, q as uint16 counts; or q
over the TensorChannel with transport 'channel'). A child that dies closes its end:
the next wait raises DraftProcessDied at once; a parent that dies closes the other end
and the child exits. Ray stays the runtime for GPU drafts (draft_runtime 'auto').
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

# How long the child gets to exit after its socket closes, before it is killed.
EXIT_GRACE_S = 2.0
MODULE = "vllm_saguaro.draft.process_actor"
# The child's program: the module's name first (a no-op, so that `ps` and `top` show
# what the process is even where they cut the command line short), then the target's
# sys.path (as multiprocessing's spawn passes it), so that it imports the same
# vllm_saguaro and torch as the target (`python -m` would put the working directory
# first, where another checkout may shadow them), then the module's main under its own
# name (the exceptions it pickles unpickle as this module's in the target).
SYS_PATH_ENV = "SAGUARO_DRAFT_SYS_PATH"
BOOT = (f"{MODULE!r}; import json, os, sys; "
        f"sys.path[:] = json.loads(os.environ.pop({SYS_PATH_ENV!r})); "
        f"from {MODULE} import main; main(sys.argv[1:])")


def is_draft_worker(cmdline: str) -> bool:
    """Whether a process's command line is a draft worker's, in either runtime (tools
    that look for it: the soak's memory figure, the server tests)."""
    return MODULE in cmdline or "ray::DraftWorker" in cmdline


class DraftProcessDied(RuntimeError):
    """The draft's process exited (killed, crashed): no reply will come."""


class DraftCallError(RuntimeError):
    """The draft worker raised in a call; the message carries its type, text and where."""


class PendingCall:
    """A call sent to the draft process; its reply is read by DraftProcess.result."""

    __slots__ = ("process", "id", "method", "__weakref__")

    def __init__(self, process: "DraftProcess", call_id: int, method: str):
        self.process, self.id, self.method = process, call_id, method


class _Method:
    __slots__ = ("process", "name")

    def __init__(self, process: "DraftProcess", name: str):
        self.process, self.name = process, name

    def remote(self, *args, **kwargs) -> PendingCall:
        return self.process.call(self.name, args, kwargs)


class DraftProcess:
    """Start a DraftWorker(config, target_vocab_size) in a child process with `env` added
    to this process's environment, bound to `cores` from its first instruction (it would
    otherwise inherit the affinity of the thread that starts it: the target's)."""

    def __init__(self, config: dict, target_vocab_size: int, env: dict[str, str],
                 cores: list[int] | None = None, worker_kwargs: dict | None = None):
        ours, theirs = socket.socketpair()
        child_env = {**os.environ, **env, SYS_PATH_ENV: json.dumps(sys.path)}
        argv = [sys.executable, "-c", BOOT, str(theirs.fileno()),
                ",".join(str(c) for c in cores or [])]
        try:
            self.proc = subprocess.Popen(argv, env=child_env, pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._replies: dict[int, tuple[bool, object]] = {}
        # the calls someone still holds: a reply to a call dropped unread (a pre-speculation
        # the proposer replaced) is discarded, as Ray frees an object nobody refers to
        self._calls: weakref.WeakValueDictionary[int, PendingCall] = weakref.WeakValueDictionary()
        self._next_id = 0
        self._dead: str | None = None
        # the worker's constructor runs first in the child; every call queues behind it
        self.call("__init__", (config, target_vocab_size), worker_kwargs or {})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def call(self, method: str, args: tuple, kwargs: dict) -> PendingCall:
        with self._lock:
            self._next_id += 1
            call = PendingCall(self, self._next_id, method)
            self._calls[call.id] = call
            if self._dead is None:
                try:  # plain pickle: torch's reductions would pass tensors as shared fds
                    self.conn.send_bytes(pickle.dumps((call.id, method, args, kwargs)))
                except (OSError, EOFError) as error:
                    self._died(f"sending {method}: {error}")
            return call

    def ready(self, call: PendingCall) -> bool:
        """Whether the call's reply (or the process's death) is in, without waiting."""
        with self._lock:
            self._drain(0.0)
            return call.id in self._replies or self._dead is not None

    def result(self, call: PendingCall, timeout: float | None = None):
        """The call's return value; its exception re-raised (DraftCallError), TimeoutError
        after `timeout` seconds, DraftProcessDied if the process exited first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while call.id not in self._replies:
                if self._dead is not None:
                    raise DraftProcessDied(self._dead)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"the draft process did not answer {call.method} "
                                       f"within {timeout:.1f} s")
                self._drain(left)
            ok, value = self._replies.pop(call.id)
        if not ok:
            raise value
        return value

    def _drain(self, wait: float | None) -> None:
        """Read every reply available (waiting up to `wait` s for the first)."""
        try:
            while self.conn.poll(wait):
                call_id, ok, value = self.conn.recv()
                if call_id in self._calls:
                    self._replies[call_id] = (ok, value)
                wait = 0.0
        except (OSError, EOFError):
            self._died("its connection closed")

    def _died(self, why: str) -> None:
        if self._dead is None:
            try:
                code = self.proc.wait(timeout=EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                code = None
            self._dead = (f"the draft process {self.proc.pid} exited with code {code}"
                          if code is not None else f"the draft process {self.proc.pid}: {why}")

    def kill(self) -> None:
        """Stop the child for good (SIGKILL) and reap it."""
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self._dead = self._dead or "killed"


class ProcessRuntime:
    """The supervisor's runtime for a DraftProcess (vllm_glue/supervisor.py)."""

    name = "process"

    @staticmethod
    def start(config: dict, target_vocab_size: int, incarnation: int = 0,
              borrow: list[int] = ()) -> DraftProcess:
        """borrow: the target's cores, which the draft's team may grow onto while the
        target waits for its drafts (draft/team.py); the process starts bound to
        them too, so that OpenMP may bind its added threads there."""
        from vllm_saguaro.draft.worker import worker_env

        cores = config.get("draft_cpu_cores") if config.get("draft_device", "cpu") == "cpu" else None
        borrow = list(borrow) if cores else []
        return DraftProcess(config, target_vocab_size, worker_env(cores, incarnation, borrow),
                            cores and list(cores) + borrow, {"borrow": borrow})

    @staticmethod
    def get(call: PendingCall, timeout: float | None):
        return call.process.result(call, timeout)

    @staticmethod
    def ready(call: PendingCall) -> bool:
        return call.process.ready(call)

    @staticmethod
    def kill(process: DraftProcess) -> None:
        process.kill()


# ------------------------------------------------------------------------ the child side
def _reply(conn: Connection, lock: threading.Lock, call_id: int, ok: bool, value) -> None:
    try:
        data = pickle.dumps((call_id, ok, value))
    except Exception as error:  # an unpicklable exception or value: say what it was
        data = pickle.dumps((call_id, False, DraftCallError(f"reply not picklable: {error!r}")))
    with lock:
        try:
            conn.send_bytes(data)
        except OSError:  # the target is gone; the main loop sees EOF and exits
            pass


def _failure(method: str, error: BaseException) -> DraftCallError:
    where = "".join(traceback.format_exception(type(error), error, error.__traceback__)[-3:])
    return DraftCallError(f"{type(error).__name__} in {method}: {error}\n{where}")


def serve(conn: Connection) -> None:
    """Answer calls until the target closes its end: the constructor on this thread,
    every other call on one of two threads (Ray's max_concurrency=2)."""
    from vllm_saguaro.draft.worker import DraftWorker

    lock = threading.Lock()
    worker, broken = None, None
    pool = ThreadPoolExecutor(2, thread_name_prefix="saguaro-draft-call")

    def run(call_id: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            value = getattr(worker, method)(*args, **kwargs)
        except BaseException as error:
            _reply(conn, lock, call_id, False, _failure(method, error))
        else:
            _reply(conn, lock, call_id, True, value)

    while True:
        try:
            call_id, method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        if method == "__init__":
            try:
                worker = DraftWorker(*args, **kwargs)
                _reply(conn, lock, call_id, True, None)
            except BaseException as error:  # every later call answers with this error
                broken = _failure("the draft worker's start", error)
                _reply(conn, lock, call_id, False, broken)
        elif broken is not None or worker is None:
            _reply(conn, lock, call_id, False,
                   broken or DraftCallError(f"{method} before the draft worker started"))
        else:
            pool.submit(run, call_id, method, args, kwargs)
    os._exit(0)  # a call thread may be stuck (a hang injected by a test): don't wait


def main(argv: list[str]) -> None:
    # Ctrl-C reaches the whole process group: the target's shutdown ends this process
    # (its socket closes), not a KeyboardInterrupt traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, cores = int(argv[0]), argv[1] if len(argv) > 1 else ""
    if cores:  # before torch is imported: its threads start on the draft's cores
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    serve(Connection(fd))
