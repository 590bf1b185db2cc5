"""When the draft worker fails: how long the target waits for it, and when it restarts.

SSD is an optimisation: a draft worker that dies, raises or hangs may cost the target one
bounded wait, never a request. The target then decodes plainly (sends no draft tokens)
while a new worker starts in the background; speculation resumes once it answers. A
worker that keeps failing is restarted later each time (no restart loop eating the
draft's device), and the count starts over once a worker has stayed up for a while.
Pure logic; vllm_glue/supervisor.py applies it to the Ray actor.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


# A reply that prefills sequences on the draft (new ones, a resync) may take this much
# longer per token: generous for a small draft on one CPU core (~0.2 ms a token measured
# for the reference draft), so only a real hang passes the deadline.
PREFILL_S_PER_TOKEN = 0.005


def describe(error: BaseException) -> str:
    """One line for a log or an error: the error's type and its message's first line."""
    text = str(error).strip().splitlines()
    return type(error).__name__ + (f": {text[0][:200]}" if text else "")


def reply_deadline(recent_replies_s, floor_s: float, factor: float,
                   prefill_tokens: int = 0) -> float:
    """How long to wait for one reply before the draft counts as hung: `factor` times the
    slowest recent reply, never less than `floor_s`, plus time for the tokens the reply
    must prefill (a batch of long prompts, or every sequence after a restart)."""
    slowest = max(recent_replies_s, default=0.0)
    return max(floor_s, factor * slowest) + PREFILL_S_PER_TOKEN * prefill_tokens


def restart_delay(failures: int, base_s: float, max_s: float) -> float:
    """Seconds from the `failures`-th failure in a row to the next start: base_s, doubled
    for each further failure, at most max_s."""
    if failures <= 0:
        return 0.0
    return min(max_s, base_s * 2.0 ** (failures - 1))


@dataclass
class RestartPolicy:
    """The worker's life as the target sees it: up, down (waiting to restart) or starting.

    `failures` counts failures in a row; a worker that stayed up `healthy_s` resets it.
    Times are the caller's clock (time.monotonic in the proposer)."""

    floor_s: float = 10.0
    factor: float = 20.0
    base_s: float = 5.0
    max_s: float = 300.0
    healthy_s: float = 120.0
    state: str = "up"
    failures: int = 0
    restarts: int = 0
    restart_at: float = 0.0
    up_since: float = 0.0
    replies: deque = field(default_factory=lambda: deque(maxlen=32))

    def deadline(self, prefill_tokens: int = 0) -> float:
        return reply_deadline(self.replies, self.floor_s, self.factor, prefill_tokens)

    def replied(self, seconds: float) -> None:
        self.replies.append(seconds)

    def fail(self, now: float) -> float:
        """The worker failed: down until the returned delay has passed."""
        if self.state == "up" and now - self.up_since >= self.healthy_s:
            self.failures = 0  # it had recovered: this is a new failure, not a loop
        self.failures += 1
        self.state = "down"
        delay = restart_delay(self.failures, self.base_s, self.max_s)
        self.restart_at = now + delay
        self.replies.clear()  # a new worker's replies start a new window
        return delay

    def restart_due(self, now: float) -> bool:
        return self.state == "down" and now >= self.restart_at

    def starting(self) -> None:
        self.state = "starting"
        self.restarts += 1

    def started(self, now: float) -> None:
        self.state = "up"
        self.up_since = now
