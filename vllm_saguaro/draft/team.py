"""The draft's OpenMP team on a CPU: its own cores, and the target's while the target waits.

On a CPU machine the draft's "device" is a core taken from the target (core/placement.py).
In SSD's rounds both work at once, each on its own cores. In rounds of SD on the lent
cores (controller.regime lent_sd) they take turns: the draft drafts while the target
waits, then the target verifies on every core (vllm_glue/lending.py lends it the
draft's). So for its turn the draft borrows the target's cores. Measured at batch 1
(K = 1, the reference pair, 2 cores, T = 0, three engine starts each,
benchmarks/results/lent_sd_probe): SD on the lent cores ran 28.4-29.6 tok/s with the
draft on both cores against 25.1-27.6 on its own; vLLM's draft_model at K = 1 on both
cores 27.1-28.4, plain vLLM on both 25.2-26.0.

The process starts bound to both sides' cores, its OpenMP list the draft's first (thread
i of a team goes to the i-th; draft/worker.py worker_env), a team of the draft's count.
"""
from __future__ import annotations

import os
import threading

import torch

from vllm_saguaro.core.placement import bind_process, process_threads


class DraftTeam:
    """The draft process's threads: `cores` its own, `borrow` the target's it may grow
    onto. Borrowing needs the draft on one core of its own: every thread a team adds is
    then a borrowed one (bind_added)."""

    def __init__(self, cores: list[int], borrow: list[int] = ()):
        self.cores = list(cores)
        self.borrow = list(borrow) if len(self.cores) == 1 else []
        self._task_ids: set[str] = set()  # the process's threads when last bound

    @property
    def borrows(self) -> bool:
        return bool(self.borrow)

    def bind(self) -> None:
        """Give the draft a 'device' of its own: every thread of the process is moved to
        its cores (Ray's own threads too: they are started before this runs, and a process
        started from the target's worker inherits its binding); OpenMP's pool was bound by
        the environment worker_env gave the process. With cores to borrow, OpenMP sets up
        its binding first, while the process may still use them: Intel's takes the cores it
        may bind to from the process's mask at that moment."""
        if self.borrow:
            torch.get_num_threads()  # OpenMP's initialisation, its affinity included
        bind_process(self.cores)
        torch.set_num_threads(len(self.cores))

    def use(self, borrowed: bool) -> None:
        """The team of the thread about to compute: its own cores, or with the borrowed
        ones too (a lent_sd step). Set on every entry, since a team's size is the calling
        thread's own and step() and prespeculate() may run on either of two threads; the
        caller is put back on the draft's cores, where Intel OpenMP may have placed a
        thread that starts a team of its own (a call thread) anywhere on its list."""
        if self.borrow:
            torch._C.set_num_threads(len(self.cores) + (len(self.borrow) if borrowed else 0))
            os.sched_setaffinity(0, self.cores)

    def bind_added(self) -> None:
        """Bind each thread OpenMP added to a team (every thread but Python's: the main
        and the call threads, which use() keeps on the draft's core) to one borrowed core.
        Neither OpenMP does it for a team whose master it did not start (a call thread):
        measured, Intel's put the added thread on the draft's core, GNU's left it free on
        both, and moved the team's master (this thread) onto both too. Looked at when the
        process's threads change (one listdir otherwise)."""
        if not self.borrow:
            return
        os.sched_setaffinity(0, self.cores)
        tids = set(os.listdir("/proc/self/task"))
        if tids == self._task_ids:
            return
        self._task_ids = tids
        python = {t.native_id for t in threading.enumerate()}
        n = 0
        for t in process_threads():
            if t.tid in python:
                continue
            core = self.borrow[n % len(self.borrow)]
            n += 1
            if t.cores != (core,):
                try:
                    os.sched_setaffinity(t.tid, {core})
                except OSError:  # the thread ended meanwhile
                    pass
