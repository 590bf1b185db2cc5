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


def test_with_plain_vllm_beside_each_side_runs_in_each_place_alike():
    orders = [paired.arm_order(i, beside=True) for i in range(12)]
    assert all(sorted(o) == sorted(paired.ARMS) for o in orders)
    assert len(set(orders[:6])) == 6 and orders[6:] == orders[:6]  # the six orders, in turn
    for place in range(3):  # over six pairs, each side runs in each place twice
        assert {a: sum(o[place] == a for o in orders[:6]) for a in paired.ARMS} == \
            dict.fromkeys(paired.ARMS, 2)
    # without plain vLLM beside: the two sides, alternating
    assert [paired.arm_order(i, beside=False) for i in range(2)] == [("paused", "ssd"),
                                                                    ("ssd", "paused")]


def _cell(vllm_spans, paused_spans, ssd_spans, dataset="mt_bench"):
    rec = {"system": "SSD-K3", "dataset": dataset, "temperature": 1.0, "batch": 4,
           "paused": [_run(x, idle=60, sent=(60,)) for x in paused_spans],
           "ssd": [_run(x, idle=60, sent=(60,)) for x in ssd_spans],
           "vllm": [_run(x) for x in vllm_spans]}
    paired.summarize_pairs(rec)
    return rec


def test_plain_vllm_beside_is_compared_within_the_pairs():
    # the machine slows down through the cell: across pairs tok/s halve, but within each
    # pair SSD runs in 0.9 of plain vLLM's time and paused in 0.95
    vllm = [2.0, 3.0, 4.0]
    rec = _cell(vllm, [0.95 * x for x in vllm], [0.9 * x for x in vllm])
    assert math.isclose(rec["ssd_vs_beside"]["geomean"], 1 / 0.9)
    assert math.isclose(rec["ssd_vs_beside"]["low"], 1 / 0.9)  # no spread within pairs
    assert math.isclose(rec["paused_vs_beside"]["geomean"], 1 / 0.95)
    assert math.isclose(rec["beside_tok_s"], 63 / 3.0)
    # the medians across pairs alone would say otherwise: 63/3 vs 63/(0.9*3)
    row, = paired.combine([rec], [])
    assert math.isclose(row["ssd_vs_beside"]["geomean"], 1 / 0.9)
    assert row["ssd_vs_vllm"] is None  # no separate plain vLLM start
    # a cell without plain vLLM beside has none of these
    plain = _cell([], [2.0], [1.8])
    assert "ssd_vs_beside" not in plain and paired.combine([plain], [])[0]["ssd_vs_beside"] is None


def test_blocks_pool_every_pair_of_every_start():
    a = _cell([2.0, 2.0], [2.0, 2.0], [1.6, 1.6])          # start 1: SSD 1.25x
    b = _cell([2.0, 2.0], [2.0, 2.0], [2.5, 2.5])          # start 2: SSD 0.8x
    a["started_first"], b["started_first"] = "vllm", "plugin"
    other = _cell([2.0], [2.0], [1.0], dataset="humaneval")  # one start only: not pooled
    pool, = paired.pooled([a, b, other])
    assert pool["starts"] == 2 and pool["ssd_vs_beside"]["n"] == 4
    assert math.isclose(pool["ssd_vs_beside"]["geomean"], 1.0)  # 1.25 and 0.8 average to 1
    assert pool["per_start"] == [a["ssd_vs_beside"]["geomean"], b["ssd_vs_beside"]["geomean"]]
    assert math.isclose(pool["ssd_vs_paused"]["geomean"], 1.0)
    md = paired.markdown({"meta": {"started": "t", "command": "c", "prompts_per_set": 8,
                                   "max_tokens": 64, "repeats": 1, "vllm_starts": 0,
                                   "beside_vllm": True},
                          "rows": paired.combine([a, b], []), "pooled": [pool]})
    assert "| SSD-K3 | mt_bench | 1 | 4 | 2 | 4 | **1.000** |" in md
    assert "**1.250** |" in md  # the first start's row
    assert "| 1.250 (vllm first), 0.800 (plugin first) |" in md


def test_the_start_orders_weigh_alike_in_the_pool():
    # two starts with plain vLLM first (SSD 1.10x each) and one with the plugin first
    # (0.90x): each order weighs half, not a third
    firsts = [_cell([2.0, 2.0], [2.0, 2.0], [2.0 / 1.1, 2.0 / 1.1]) for _ in range(2)]
    last = _cell([2.0, 2.0], [2.0, 2.0], [2.0 / 0.9, 2.0 / 0.9])
    for rec, first in zip(firsts + [last], ("vllm", "vllm", "plugin")):
        rec["started_first"] = first
    pool, = paired.pooled(firsts + [last])
    assert math.isclose(pool["ssd_vs_beside"]["geomean"], math.sqrt(1.1 * 0.9))
    assert pool["ssd_vs_beside"]["n"] == 6
    # one order only: every pair in one interval, as ratio_interval
    one = paired.balanced_interval([[1.0, 1.2, 1.1]])
    assert one == paired.ratio_interval([1.0, 1.2, 1.1])
    # the interval: each order's variance of its mean, the smallest order's df
    r = paired.balanced_interval([[1.0, 1.2], [0.9, 1.0, 1.1]])
    logs = [[math.log(x) for x in (1.0, 1.2)], [math.log(x) for x in (0.9, 1.0, 1.1)]]
    import statistics
    half = paired.t90(1) * math.sqrt(sum(statistics.variance(g) / len(g) for g in logs) / 4)
    assert math.isclose(math.log(r["high"]) - math.log(r["geomean"]), half, rel_tol=1e-9)
    assert paired.balanced_interval([[1.1], [0.9, 1.0]])["low"] is None
