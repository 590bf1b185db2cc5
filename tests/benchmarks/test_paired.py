"""benchmarks/paired.py's pure parts: the pairs' order, their ratios' interval, the cells."""
import math

from benchmarks import paired


def test_pairs_alternate_which_side_runs_first():
    orders = [paired.pair_order(i) for i in range(4)]
    assert orders == [(True, False), (False, True)] * 2
    assert all(sorted(o) == [False, True] for o in orders)  # each pair one of each


def test_ratio_interval_is_on_the_log_scale():
    # a ratio and its inverse weigh alike: 2x and 0.5x average to 1
    r = paired.ratio_interval([2.0, 0.5])
    assert math.isclose(r["geomean"], 1.0) and r["low"] < 1.0 < r["high"]
    assert math.isclose(r["low"] * r["high"], 1.0)
    # tight pairs, tight interval; the t-quantile of df = n - 1 (6.314 at df 1)
    r = paired.ratio_interval([1.10, 1.12, 1.08, 1.11, 1.09, 1.10])
    assert 1.08 < r["low"] < r["geomean"] < r["high"] < 1.12 and r["n"] == 6
    logs = [math.log(x) for x in (1.0, 1.2)]
    half = 6.314 * abs(logs[1] - logs[0]) / math.sqrt(2) / math.sqrt(2)
    r = paired.ratio_interval([1.0, 1.2])
    assert math.isclose(math.log(r["high"]) - math.log(r["geomean"]), half, rel_tol=1e-6)
    assert paired.ratio_interval([1.3])["low"] is None
    assert paired.t90(100) == 1.645 and paired.t90(11) == paired.T90[10]


def _run(span, rounds=0, idle=0, sent=()):
    c = {"plugin.rounds": rounds, "plugin.idle_rounds": idle, "plugin.lent_sd_rounds": 0,
         "plugin.idle_lookup_rounds": 0}
    c.update({f"plugin.sent_{n}": x for n, x in enumerate(sent)})
    return {"span_s": span, "tok_s": 63 / span, "counters": c}


def test_a_cell_combines_the_pairs_with_plain_vllms_chunks():
    rec = {"system": "SSD-K3", "dataset": "humaneval", "temperature": 0.0, "batch": 1,
           "paused": [_run(2.0, idle=60, sent=(60,)), _run(2.2, idle=60, sent=(60,))],
           "ssd": [_run(1.6, rounds=40, sent=(10, 10, 10, 10)), _run(2.2, idle=60, sent=(60,))]}
    paired.summarize_pairs(rec)
    assert math.isclose(rec["ratio"]["geomean"], math.sqrt(2.0 / 1.6))
    did = rec["did"]
    assert math.isclose(did["idle_share"], 60 / 100)
    assert math.isclose(did["tokens_per_row"], (10 + 20 + 30) / 100)
    vllm = [{"dataset": "humaneval", "temperature": 0.0, "batch": 1, "tok_s": [30.0, 31.5, 29.0]},
            {"dataset": "mt_bench", "temperature": 0.0, "batch": 1, "tok_s": [99.0]}]
    row, = paired.combine([rec], vllm)
    assert row["vllm_tok_s"] == 30.0
    assert math.isclose(row["paused_vs_vllm"], rec["paused_tok_s"] / 30.0)
    assert math.isclose(row["ssd_vs_vllm"], row["paused_vs_vllm"] * rec["ratio"]["geomean"])
    assert paired.combine([rec], [])[0]["ssd_vs_vllm"] is None  # no vLLM start: no product
    md = paired.markdown({"meta": {"started": "t", "command": "c", "prompts_per_set": 8,
                                   "max_tokens": 64, "repeats": 1, "vllm_starts": 1},
                          "rows": [row]})
    assert f"| SSD-K3 | humaneval | 0 | 1 | 2 | {rec['ratio']['geomean']:.3f} |" in md
