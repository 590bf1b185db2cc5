"""SSD's own figures: cache hit rate, fallback use, how long the target waited, and the
lengths the controller sent (how often a round was plain decoding).

vLLM's spec-decode counters (drafts, accepted tokens) keep working untouched; these add
what vLLM has no path for. They are Prometheus counters in the process that runs the
proposer (so `LLM.get_metrics()` sees them with an in-process engine) and a periodic log
line everywhere.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("vllm_saguaro")

_COUNTERS: dict | None = None


def _counters() -> dict:
    """Created once per process (Prometheus refuses a name twice), and registered again
    when a new vLLM engine has unregistered every "vllm:" collector, as it does at start."""
    global _COUNTERS
    if _COUNTERS is not None:
        from prometheus_client import REGISTRY

        for counter in _COUNTERS.values():
            if counter not in REGISTRY._collector_to_names:
                REGISTRY.register(counter)
    else:
        from prometheus_client import Counter, Gauge

        def c(name: str, doc: str, labels=()) -> Counter:
            return Counter(f"vllm:saguaro_{name}", doc, list(labels))

        def g(name: str, doc: str) -> Gauge:  # the engine process's last value
            return Gauge(f"vllm:saguaro_{name}", doc, multiprocess_mode="mostrecent")

        _COUNTERS = {
            "rounds": c("rounds", "Verification rounds with SSD drafting"),
            "lookups": c("cache_lookups", "Speculation-cache lookups (one per sequence-round)"),
            "hits": c("cache_hits", "Speculation-cache hits"),
            "fallbacks": c("fallback_drafts", "Sequences drafted by the fallback (misses, new, "
                           "resync; not those that sent nothing)"),
            "wait": c("draft_wait_seconds", "Time the target waited on the draft worker"),
            "sent": c("speculation_length", "Sequence-rounds by the number of draft tokens "
                      "the controller sent (0 = plain decoding for that sequence)", ["length"]),
            "plain": c("plain_rounds", "Rounds in which no sequence sent draft tokens"),
            "idle": c("idle_rounds", "Rounds in which the draft was not called at all "
                      "(speculation with it cannot pay at that batch size): plain, or with "
                      "the proposer's own lookup drafts (idle_lookup_rounds)"),
            "idle_lookup": c("idle_lookup_rounds", "Rounds in which the draft was not "
                             "called and the proposer sent prompt lookup drafts of its own "
                             "(controller.idle_lookup)"),
            "drain": c("drain_rounds", "Rounds in which no request waited and the lengths "
                       "were chosen for the batch's span (controller.objective span)"),
            "lent_sd": c("lent_sd_rounds", "Rounds of SD on the lent cores (CPU): the draft "
                         "drafted while the target waited, and the target verified on every "
                         "core, the draft's included"),
            "failures": c("draft_failures", "Draft worker failures (its process died, it "
                          "raised, or it did not answer in time); speculation is off until "
                          "a new worker is up"),
            "restarts": c("draft_restarts", "New draft workers up after a failure"),
            "down": c("draft_down_rounds", "Plain rounds while no draft worker was up"),
            "transfer": c("transfer_bytes", "Payload between target and draft worker: token "
                          "ids (4 bytes), hit flags, q counts (2 bytes per head token)"),
            "held_seqs": g("draft_sequences", "Sequences the draft worker holds state for, "
                           "as of the last time the batch emptied (0 unless requests leak)"),
            "held_blocks": g("draft_kv_blocks_used", "The draft worker's KV blocks in use, "
                             "as of the last time the batch emptied"),
        }
    return _COUNTERS


@dataclass
class SaguaroMetrics:
    log_interval_s: float
    rounds: int = 0
    seqs: int = 0
    lookups: int = 0
    hits: int = 0
    fallbacks: int = 0
    wait_prespec_s: float = 0.0   # waiting for the pre-speculation in flight (draft too slow)
    wait_step_s: float = 0.0      # lookup + fallback drafting + communication
    # The round's profile (benchmarks/run.py --profile): the rest of the draft's reply is
    # transport (Ray, (de)serialisation); the target's side runs from one round's drafts
    # to the next round's call (verification, sampling, vLLM's scheduling).
    draft_step_s: float = 0.0     # the draft worker's own compute in step() (lookup, fallback)
    unpack_s: float = 0.0         # drafts and q into the verifier's tensors
    # What crosses per round (both ways): the payload (token ids at 4 bytes, hit flags, q
    # as uint16 counts over the draft head; Ray's framing not counted), and the time it
    # costs the target: the step call minus the worker's compute, plus the unpacking.
    transfer_bytes: int = 0
    transport_s: float = 0.0
    hit_rounds: int = 0           # rounds in which every sequence hit
    hit_reply_s: float = 0.0      # the target's whole wait on those rounds
    miss_reply_s: float = 0.0     # and on the others (a miss, a new sequence)
    target_rounds: int = 0
    target_s: float = 0.0
    # The controller: sequence-rounds by tokens sent (index = length), rounds in which
    # nothing was sent, those in which the draft was left idle (plain decoding, or the
    # proposer's own lookup drafts: idle_lookup_rounds).
    sent: list[int] = field(default_factory=list)
    plain_rounds: int = 0
    idle_rounds: int = 0
    lent_sd_rounds: int = 0       # rounds of SD on the lent cores (controller.regime)
    idle_lookup_rounds: int = 0   # idle rounds with the proposer's own lookup drafts
    drain_rounds: int = 0         # rounds valued by the batch's span (core/span.py)
    # The draft worker's failures (vllm_glue/supervisor.py), restarts, rounds without it
    draft_failures: int = 0
    draft_restarts: int = 0
    down_rounds: int = 0
    draft_held: dict = field(default_factory=dict)  # DraftWorker.held() when the batch emptied
    _last_done: float | None = None
    _last_log: float = field(default_factory=time.monotonic)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def round_done(self, now: float) -> None:
        self._last_done = now

    def record_round(self, flags: list, wait_prespec: float, wait_step: float,
                     draft_s: float = 0.0, unpack_s: float = 0.0,
                     started: float | None = None, lengths: list[int] = (),
                     transfer_bytes: int = 0, lent_sd: bool = False) -> None:
        if started is not None and self._last_done is not None and started - self._last_done < 5.0:
            self.target_rounds += 1  # not after an idle gap (between requests)
            self.target_s += started - self._last_done
        self.draft_step_s += draft_s
        self.unpack_s += unpack_s
        self.transfer_bytes += transfer_bytes
        self.transport_s += max(0.0, wait_step - draft_s) + unpack_s
        reply = wait_prespec + wait_step + unpack_s
        if flags and all(f is True for f in flags):
            self.hit_rounds += 1
            self.hit_reply_s += reply
        else:
            self.miss_reply_s += reply
        lookups = sum(f is not None for f in flags)
        hits = sum(f is True for f in flags)
        fallbacks = sum(f is not True and n > 0 for f, n in zip(flags, lengths or [1] * len(flags)))
        self.rounds += 1
        self.lent_sd_rounds += lent_sd
        self.seqs += len(flags)
        self.lookups += lookups
        self.hits += hits
        self.fallbacks += fallbacks
        self.wait_prespec_s += wait_prespec
        self.wait_step_s += wait_step
        self._count_lengths(lengths)
        c = _counters()
        c["rounds"].inc()
        c["lookups"].inc(lookups)
        c["hits"].inc(hits)
        c["fallbacks"].inc(fallbacks)
        c["wait"].inc(wait_prespec + wait_step)
        c["transfer"].inc(transfer_bytes)
        if lent_sd:
            c["lent_sd"].inc()
        self._maybe_log()

    def record_idle_round(self, lengths: list[int]) -> None:
        """A round the proposer answered without the draft: the tokens each decoding
        sequence sent, prompt lookup drafts of the proposer's own (core/idle_lookup.py)
        or nothing."""
        self.idle_rounds += 1
        _counters()["idle"].inc()
        if any(lengths):
            self.idle_lookup_rounds += 1
            _counters()["idle_lookup"].inc()
        self._count_lengths(lengths)
        self._maybe_log()

    def record_drain_round(self) -> None:
        """A round in which no request waited, its lengths chosen for the batch's span."""
        self.drain_rounds += 1
        _counters()["drain"].inc()

    def record_down_round(self, seqs: int) -> None:
        """A plain round because no draft worker was up (it failed, a new one starts)."""
        self.down_rounds += 1
        _counters()["down"].inc()
        self._count_lengths([0] * seqs)
        self._maybe_log()

    def record_draft_event(self, event: str) -> None:
        """'failure' or 'restart' of the draft worker (vllm_glue/supervisor.py)."""
        if event == "failure":
            self.draft_failures += 1
            _counters()["failures"].inc()
        elif event == "restart":
            self.draft_restarts += 1
            _counters()["restarts"].inc()

    def record_draft_held(self, held: dict) -> None:
        """What the draft worker still holds after the batch emptied (DraftWorker.held)."""
        self.draft_held = dict(held)
        _counters()["held_seqs"].set(held.get("live_seqs", 0))
        _counters()["held_blocks"].set(held.get("kv_blocks_used", 0))

    def _count_lengths(self, lengths) -> None:
        if not lengths:
            return
        for n in lengths:
            if n >= len(self.sent):
                self.sent.extend([0] * (n + 1 - len(self.sent)))
            self.sent[n] += 1
            _counters()["sent"].labels(length=str(n)).inc()
        if not any(lengths):
            self.plain_rounds += 1
            _counters()["plain"].inc()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.log_interval_s and now - self._last_log >= self.log_interval_s:
            self._last_log = now
            logger.info("Saguaro SSD: %s", self.summary())

    def lengths_summary(self) -> str:
        total = sum(self.sent)
        if not total:
            return "no rounds yet"
        shares = "/".join(f"{100 * n / total:.0f}" for n in self.sent)
        rounds = self.rounds + self.idle_rounds + self.down_rounds
        return (f"lengths sent 0..{len(self.sent) - 1}: {shares}%, plain-decoding rounds "
                f"{100 * self.plain_rounds / max(rounds, 1):.0f}%, draft idle in "
                f"{100 * self.idle_rounds / max(rounds, 1):.0f}% (prompt lookup drafts in "
                f"{100 * self.idle_lookup_rounds / max(rounds, 1):.0f}%), SD on the lent cores in "
                f"{100 * self.lent_sd_rounds / max(rounds, 1):.0f}%"
                + (f", valued by the draining batch's span in "
                   f"{100 * self.drain_rounds / max(rounds, 1):.0f}%" if self.drain_rounds else ""))

    def summary(self) -> str:
        failures = (f", draft worker failures {self.draft_failures} (restarts "
                    f"{self.draft_restarts}, {self.down_rounds} rounds without it)"
                    if self.draft_failures else "")
        return (f"cache hit rate {self.hit_rate:.3f} ({self.hits}/{self.lookups}), "
                f"fallback drafts {self.fallbacks}, rounds {self.rounds}, "
                f"target waited {self.wait_prespec_s + self.wait_step_s:.2f}s "
                f"(pre-speculation {self.wait_prespec_s:.2f}s, lookup/fallback {self.wait_step_s:.2f}s), "
                f"{self.transfer_summary()}, {self.lengths_summary()}{failures}")

    def transfer_summary(self) -> str:
        n = max(self.rounds, 1)
        return (f"transfer {self.transfer_bytes / n / 1024:.1f} KB/round in "
                f"{self.transport_s / n * 1e3:.2f} ms")

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")} | {
            "hit_rate": self.hit_rate}
