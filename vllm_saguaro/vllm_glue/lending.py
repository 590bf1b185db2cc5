"""Lend the draft's cores to the target while the draft idles (CPU only).

On a CPU machine the draft's "device" is a core taken from the target. While the
controller finds that speculation cannot pay at the batch size running, the draft is not
called at all (proposer.py); its core would then sit idle, and the target would decode
on fewer cores than plain vLLM has. So the target's OpenMP team grows onto the draft's
cores for that time and shrinks back before the draft is called again.

The target starts lent: vLLM starts its worker exactly as plain vLLM bound to all the
cores, with an affinity list of the target's cores and then the draft's and a team of all
of them (patches.patch_omp_binding; the target's own count in TARGET_THREADS_ENV), so the
rounds in which the draft idles, most of them wherever speculation cannot pay, run the
same kernels set up the same way as plain vLLM's. The team shrinks to the target's cores,
the first of the list, before the draft runs, and grows back with torch's
set_num_threads (vLLM's CPU worker stubs the torch.set_num_threads wrapper): the binding
is OpenMP's own, so the threads it adds are on the draft's cores. They stay parked while
the team is shrunk. vLLM's oneDNN matmuls keep the team size they were created with when
the team grows, so in the team size the target did not start with its linear layers run
under oneDNN keys of their own, a zero bias (`rekey_bias`) or a padded row stride
(`rekey_input`): primitives made for that team (patches.patch_lent_gemms).
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

# The target's own thread count, exported to its worker process by patches.patch_omp_binding
# (OMP_NUM_THREADS there is the whole team's, the draft's cores included).
TARGET_THREADS_ENV = "SAGUARO_TARGET_THREADS"

# Extra row stride (elements) of a linear layer's input while rekeyed (CoreLending): 16
# floats keep rows 64-byte aligned, and no vLLM caller passes that stride, so that team's
# oneDNN primitives get keys of their own (patches.patch_lent_gemms).
REKEY_ROW_PAD = 16


def rekey_input(x: torch.Tensor) -> torch.Tensor:
    """The same values as the 2-D `x`, in rows REKEY_ROW_PAD elements longer than x's."""
    rows, cols = x.shape
    padded = torch.empty((rows, cols + REKEY_ROW_PAD), dtype=x.dtype, device=x.device)
    padded[:, :cols].copy_(x)
    return padded[:, :cols]


@lru_cache(maxsize=None)
def rekey_bias(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero bias of n outputs: adding it changes no value, and a bias is part of vLLM's
    oneDNN primitive key, so a layer without one gets primitives of its own while rekeyed.
    One tensor per width and dtype, never written."""
    return torch.zeros(n, dtype=dtype)


def onednn_handler(cpu_linear):
    """The oneDNN matmul handler (vLLM's CPUDNNLGEMMHandler) a layer's cpu_linear closes
    over (layers/utils.py dispatch_cpu_unquantized_gemm makes it a lambda over it), or
    None for the other GEMMs (sgl-kernel, torch's linear)."""
    from vllm._custom_ops import CPUDNNLGEMMHandler

    for cell in getattr(cpu_linear, "__closure__", None) or ():
        if isinstance(cell.cell_contents, CPUDNNLGEMMHandler):
            return cell.cell_contents
    return None


def binding_order() -> list[int]:
    """The cores of this worker's OpenMP affinity list, in order: Intel OpenMP's
    KMP_AFFINITY proclist or GNU OpenMP's GOMP_CPU_AFFINITY ([] if neither)."""
    kmp = os.environ.get("KMP_AFFINITY", "")
    if "proclist=[" in kmp:
        listed = kmp.split("proclist=[", 1)[1].split("]", 1)[0].replace(" ", "")
    else:
        listed = ",".join(os.environ.get("GOMP_CPU_AFFINITY", "").split())
    return [int(c) for c in listed.split(",") if c.isdigit()]


def lending_binding(draft_cores: list[int]) -> bool:
    """Whether this worker was started so that its OpenMP team can grow onto the draft's
    cores: its affinity list ends with them (patches.patch_omp_binding)."""
    order = binding_order()
    n = len(draft_cores)
    return n > 0 and order[-n:] == sorted(draft_cores) and len(order) > n


class CoreLending:
    """The target's team: `lent` while it has the draft's cores too. `own` is the target's
    own count (TARGET_THREADS_ENV, else the team it started with)."""

    def __init__(self, draft_cores: list[int], own: int | None = None):
        self.draft_cores = sorted(draft_cores)
        # the target's own cores, which the draft borrows in turn in lent_sd rounds,
        # while the target waits for its drafts (draft/team.py)
        self.target_cores = [c for c in binding_order() if c not in self.draft_cores]
        team = torch.get_num_threads()
        self.own = own or target_threads() or team  # the target's team on its own cores
        self.lent = team >= self.own + len(self.draft_cores)  # started with the whole team
        self.native = self.lent  # the team size the target's kernels were set up with

    @property
    def rekeyed(self) -> bool:
        """The team is not the size it started with: the target's oneDNN GEMMs go in under
        keys of their own (patches.patch_lent_gemms)."""
        return self.lent != self.native

    def lend(self) -> None:
        """Grow the target's team onto the draft's cores (idempotent)."""
        if not self.lent:
            torch._C.set_num_threads(self.own + len(self.draft_cores))
            self.lent = True

    def give_back(self) -> None:
        """Shrink the team to the target's own cores before the draft runs again."""
        if self.lent:
            torch._C.set_num_threads(self.own)
            self.lent = False


def target_threads() -> int:
    """The target's own thread count patches.patch_omp_binding exported (0: not set)."""
    return int(os.environ.get(TARGET_THREADS_ENV, 0))


def keep_off_the_draft_cores() -> None:
    """No lending after all (patches.patch_omp_binding started the team whole, but this
    worker cannot lend): the team keeps to the target's own cores for good."""
    own = target_threads()
    if own and torch.get_num_threads() > own:
        torch._C.set_num_threads(own)
