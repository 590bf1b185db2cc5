"""The server under load, short (issue 20, requirement 3): 32 concurrent clients against
`vllm-saguaro serve` on the tiny pair for SOAK_S seconds: chat and completions, streaming
or not, greedy and sampled, disconnects mid-stream and requests given up on. 0 errors,
greedy outputs identical to plain decoding, the draft worker back to 0 sequences and 0 KV
blocks, /metrics consistent. The long run: `python -m benchmarks.soak --minutes 5`."""
import random

from benchmarks.soak import make_jobs, plain_reference, serve, soak

SOAK_S = 45


def test_32_streams_no_errors_no_diffs_nothing_leaked(tiny_target, tiny_draft, tmp_path):
    rng = random.Random(0)
    words = [f"w{i}" for i in range(10, 500)]
    completions = [" ".join(rng.choices(words, k=rng.randrange(2, 40))) for _ in range(30)]
    chats = [" ".join(rng.choices(words, k=rng.randrange(2, 20))) for _ in range(30)]
    jobs = make_jobs(completions, chats, 120, max_tokens=64)
    reference = plain_reference(str(tiny_target), jobs, max_model_len=512, enforce_eager=True,
                                seed=0, max_num_seqs=16)
    spec = {"method": "saguaro", "draft_model": str(tiny_draft), "num_speculative_tokens": 3,
            "draft_dtype": "float32", "log_stats_interval_s": 5,
            "controller": {"policy": "fixed"}}  # speculate every round: the path under test
    with serve(str(tiny_target), spec, tmp_path, ["--max-model-len", "512", "--enforce-eager",
                                                  "--seed", "0"],
               env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as (url, proc):
        report = soak(url, proc, jobs, reference, clients=32, seconds=SOAK_S)
    print({k: v for k, v in report.items() if k != "metrics"})
    assert not report["errors"], report["errors"][:5]
    assert not report["diffs"], report["diffs"][:3]
    assert not report["problems"], report["problems"]
    assert report["greedy_checked"] > 30 and report["disconnected"] > 0 and report["given_up"] > 0
    assert report["metrics"]["vllm:spec_decode_num_drafts_total"] > 0, "SSD did not speculate"
