"""The draft worker's keeper on the target's side: every call has a deadline, a failure
turns speculation off, and a new worker starts in the background.

The proposer reaches the draft only through `get` (and `ready` for a call it does not
wait on); the runtime (draft/process_actor.py's ProcessRuntime on CPU, draft/ray_actor.py's
RayRuntime) starts the worker and carries the calls. A worker that died (its process
killed), raised, or did not answer within the deadline (core/supervision.py: derived from
its recent replies) is killed for good and counted; until a new one has started, the
proposer decodes plainly: the round in progress sends no draft tokens, so nothing already
verified is touched and nothing unverified reaches the output. When the new worker is up
the proposer resynchronises it (every sequence re-prefills, as after a preemption).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from vllm_saguaro.core.supervision import RestartPolicy, describe

logger = logging.getLogger("vllm_saguaro")


class DraftUnavailable(RuntimeError):
    """The draft worker cannot answer now: decode this round without it."""


class DraftSupervisor:
    def __init__(self, start: Callable[[int], object], runtime, policy: RestartPolicy,
                 on_event: Callable[[str], None] = lambda event: None,
                 startup_timeout_s: float = 300.0):
        self._start = start            # start(incarnation) -> a new worker's handle
        self.runtime = runtime         # get / ready / kill for the handles start() makes
        self.policy = policy
        self.on_event = on_event       # "failure" / "restart": for the metrics
        self.startup_timeout_s = startup_timeout_s
        self.actor = None
        self._ready = None             # a restarting worker's first ping
        self._starting_since = 0.0
        self.last_cause: str | None = None
        self.resync = False            # a new worker came up: the proposer resynchronises

    @property
    def up(self) -> bool:
        return self.policy.state == "up" and self.actor is not None

    def start(self) -> None:
        """The first worker, waited for (at most startup_timeout_s): a bad checkpoint or
        config fails the engine's start with the worker's own error, not a silent fallback."""
        self.actor = self._start(0)
        self.runtime.get(self.actor.ping.remote(), self.startup_timeout_s)
        self.policy.started(time.monotonic())

    def get(self, ref, what: str, prefill_tokens: int = 0):
        """The call's reply within the deadline (longer for a reply that prefills that many
        tokens). On failure: the worker is down, DraftUnavailable."""
        t0 = time.perf_counter()
        try:
            value = self.runtime.get(ref, self.policy.deadline(prefill_tokens))
        except Exception as error:  # died, raised, timed out: all end in a plain round
            self.failed(f"{what}: {describe(error)}", error)
            raise DraftUnavailable(self.last_cause) from error
        self.policy.replied(time.perf_counter() - t0)
        return value

    def ready(self, ref) -> bool:
        """Whether a call's reply (or its failure) is in, without waiting."""
        return self.runtime.ready(ref)

    def failed(self, cause: str, error: BaseException | None = None) -> None:
        """The worker is down (cause: one line for the warning). The error itself, with
        where the worker raised it (process_actor._failure), goes to the log below it."""
        delay = self.policy.fail(time.monotonic())
        self.last_cause = cause
        self.on_event("failure")
        logger.warning("Saguaro: the draft worker failed (%s); decoding without speculation, "
                       "a new worker starts in %.1f s (failure %d in a row)",
                       cause, delay, self.policy.failures)
        if error is not None:
            logger.info("Saguaro: the draft worker's error in full: %s", error)
        self._kill()

    def available(self) -> bool:
        """Whether the worker can be called this round; moves a restart along (never waits)."""
        if self.up:
            return True
        now = time.monotonic()
        if self.policy.restart_due(now):
            self.policy.starting()
            self._starting_since = now
            try:
                self.actor = self._start(self.policy.restarts)
                self._ready = self.actor.ping.remote()
            except Exception as error:  # Ray itself refused: try again later
                self.failed(f"restart: {describe(error)}", error)
                return False
        if self.policy.state != "starting":
            return False
        if not self.runtime.ready(self._ready):
            if now - self._starting_since > self.startup_timeout_s:
                self.failed(f"restart: no answer within {self.startup_timeout_s:.0f} s")
            return False
        try:
            self.runtime.get(self._ready, 0)
        except Exception as error:
            self.failed(f"restart: {describe(error)}", error)
            return False
        self.policy.started(now)
        self.resync = True
        self.on_event("restart")
        logger.warning("Saguaro: a new draft worker is up (restart %d); speculation resumes",
                       self.policy.restarts)
        return True

    def _kill(self) -> None:
        actor, self.actor, self._ready = self.actor, None, None
        if actor is not None:
            try:
                self.runtime.kill(actor)
            except Exception:  # interpreter shutdown: Ray may already be gone
                pass

    def shutdown(self) -> None:
        self._kill()

