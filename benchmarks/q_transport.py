"""What sending the draft distributions q to the target costs per round, by wire format.

    python -m benchmarks.q_transport [--rows 1,4,16] [--rounds 30] [--json-out FILE]

A Ray actor (as the draft worker is) returns `rows` sampled rows of K = 3 distributions
per call; the caller unpacks them into the verifier's [rows, K, vocab] float32 tensor, as
vllm_glue/proposer.py does. Formats: 'float32-vocab' (q as dense float32 rows over the
whole 49152-token vocabulary, what crossed before) and 'uint16-head' (exact counts over
the draft head's 16384 tokens, core/sampling.py, what crosses now) through Ray's reply,
and 'uint16-head-channel': the same counts as one int16 tensor over the 2-rank group of
vllm_saguaro/transport.py (gloo here; NCCL, device to device, on GPUs), Ray carrying only
the shapes. Greedy rows send nothing in any. Medians over --rounds calls of the bytes, the
round trip and the unpack.
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import write_json_out

VOCAB, HEAD, K = 49152, 16384, 3


class _Sender:
    def __init__(self):
        import torch

        from vllm_saguaro.core.sampling import quantize_distribution

        g = torch.Generator().manual_seed(0)
        q = torch.softmax(torch.randn(64 * K, HEAD, generator=g) * 2, -1)
        self.head_q = quantize_distribution(q)
        self.channel = None

    def connect(self, address):
        from vllm_saguaro.transport import TensorChannel

        self.channel = TensorChannel(tuple(address), 1, timeout_s=60)

    def send_channel(self, rows: int):
        from vllm_saguaro.core.sampling import counts_int16

        t = counts_int16(self.head_q[: rows * K])  # as the worker's _send_q: one tensor
        self._works = self.channel.send([t])  # kept until the next call
        return self.channel.describe([t])

    def send(self, fmt: str, rows: int):
        import torch

        from vllm_saguaro.core.sampling import wire_counts

        out = []
        for r in range(rows):
            q = self.head_q[r * K:(r + 1) * K]
            if fmt == "float32-vocab":
                full = torch.zeros(K, VOCAB)
                full[:, :HEAD] = q
                out.append(full.numpy())
            else:
                out.append(wire_counts(q))
        return out


def measure(actor, fmt: str, rows: int, rounds: int, channel=None) -> dict:
    import ray
    import torch

    from vllm_saguaro.core.sampling import unpack_counts

    head_ids = torch.arange(HEAD)
    trips, unpacks, nbytes = [], [], 0
    for _ in range(rounds + 2):
        t0 = time.perf_counter()
        if fmt == "uint16-head-channel":  # split per row, as the proposer's _receive_q
            (counts,) = channel.recv(ray.get(actor.send_channel.remote(rows)))
            qs = [counts[r * K:(r + 1) * K] for r in range(rows)]
        else:
            qs = ray.get(actor.send.remote(fmt, rows))
        t1 = time.perf_counter()
        probs = torch.zeros(rows, K, VOCAB)
        if fmt == "float32-vocab":
            for r, q in enumerate(qs):
                probs[r].numpy()[...] = q
        else:  # as vllm_glue/proposer.py does
            probs[torch.arange(rows)] = unpack_counts(qs, head_ids, VOCAB)
        t2 = time.perf_counter()
        trips.append(t1 - t0)
        unpacks.append(t2 - t1)
        nbytes = sum(q.nbytes for q in qs)
    ms = lambda xs: round(1000 * statistics.median(xs[2:]), 3)  # noqa: E731
    return {"format": fmt, "rows": rows, "kb": round(nbytes / 1024, 1),
            "round_trip_ms": ms(trips), "unpack_ms": ms(unpacks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=512 * 2**20)
    from vllm_saguaro.transport import TensorChannel, free_address

    actor = ray.remote(num_cpus=0)(_Sender).remote()
    address = free_address()
    connected = actor.connect.remote(address)
    channel = TensorChannel(address, 0, timeout_s=60)
    ray.get(connected)
    results = []
    print("| q format | sampled rows | KB per round | round trip ms | unpack ms |")
    print("|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        for fmt in ("float32-vocab", "uint16-head", "uint16-head-channel"):
            r = measure(actor, fmt, rows, args.rounds, channel)
            results.append(r)
            print(f"| {fmt} | {rows} | {r['kb']} | {r['round_trip_ms']} | {r['unpack_ms']} |",
                  flush=True)
    ray.shutdown()
    write_json_out(args.json_out, results)


if __name__ == "__main__":
    main()
