"""The benchmark's quick mode end to end on tiny models: it runs and writes well-formed results.

Not a speed test: tiny random models on a shared machine say nothing about speed, so only
the shape of the JSON / markdown is checked, and that every record says where its
threads ran. It runs in a subprocess, as a user runs the benchmark.
"""
import json
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The target alone (the speedup's base) and SSD (the plugin's counters, theory, projection,
# the lengths table): the smallest set that exercises every output column within the time
# budget. K pinned: what the controller would send on tiny random models is not the point.
SYSTEMS = "AR,SSD-K3-fixed"


def write_prompts(path: Path) -> Path:
    rows = [{"set": "chatty", "prompt": "w5 w9 w12 w7", "chat": True},
            {"set": "raw", "prompt": "w1 w2 w3 w4 w5 w6", "chat": False}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_quick_mode_writes_results(tmp_path, tiny_target, tiny_draft):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--project",
           "--target", str(tiny_target), "--draft", str(tiny_draft),
           "--prompts-file", str(write_prompts(tmp_path / "p.jsonl")),
           "--out", str(out), "--batches", "1", "--max-tokens", "16",
           "--systems", SYSTEMS, "--draft-dtype", "float32"]
    libs = subprocess.run(["bash", str(ROOT / "scripts" / "cpu_env.sh")], capture_output=True,
                          text=True).stdout
    if "tcmalloc" not in libs or "libiomp" not in libs:  # the default needs both
        cmd += ["--ld-preload", "none"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # vLLM's log lines (every engine's) in the file, the terminal the benchmark's own
    vllm_log = (out / "vllm.log").read_text()
    assert "vllm" in vllm_log and "INFO" in vllm_log, vllm_log[:500]
    assert " INFO " not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    # nor the weights' loading bar, nor what an engine's process prints as it imports
    # vLLM: the engines' stderr goes to the log file too
    for line in ("Loading safetensors", "Triton is installed"):
        assert line not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    assert "[bench" in proc.stdout

    result = json.loads((out / "latest.json").read_text())
    recs = result["records"]
    assert {r["system"] for r in recs} == set(SYSTEMS.split(","))
    assert {r["dataset"] for r in recs} == {"chatty", "raw"}
    for r in recs:
        assert r["tok_s_seq"] > 0 and r["tpot_ms"] > 0 and r["n_requests"] >= 1
        assert r["placement"]["target"]["busy_threads"], r["placement"]
        assert r["forward_ms"], "the target's forward times per width are missing"
        assert r["speedup"] is not None
        if r["kind"] != "ar":
            assert r["accept_len"] is not None and 1.0 <= r["accept_len"] <= r["k"] + 1
    ssd = [r for r in recs if r["kind"] == "ssd"]
    assert all(0.0 <= r["hit_rate"] <= 1.0 and r["draft_wait_s"] >= 0 for r in ssd)
    assert all(r["predicted"] is not None and r["limit"] is not None for r in ssd)
    assert result["projection"]["rows"] and "not a measurement" in result["projection"]["label"]

    md = (out / "latest.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert table[0].startswith("| dataset |")
    ncols = table[0].count("|")
    assert all(line.count("|") == ncols for line in table[1:1 + len(recs)])
    assert "NOT a measurement" in md
    assert "## Lengths sent" in md and all(r["lengths"]["shares"][-1] == 1.0 for r in ssd)


def test_overrides_reach_a_valid_plugin_config(tiny_draft):
    """--saguaro-c / --draft-sampling / --fallback / --fit-to-round end up in the SSD
    system's spec, which the plugin's own config model accepts (no engine needed)."""
    from benchmarks.run import System, apply_overrides, parse_args, settings_for
    from vllm_saguaro.config import load_config

    d = str(tiny_draft)
    args = parse_args(["--quick", "--draft", d, "--ld-preload", "none", "--saguaro-c", "0.25",
                       "--draft-sampling", "greedy", "--fallback", "neural", "--fit-to-round", "off"])
    s = apply_overrides(settings_for("quick"), args)
    cfg = load_config(System("ssd", 3, budget=4).spec(d, s))
    assert (cfg.saguaro_c, cfg.draft_sampling, cfg.fallback) == (0.25, "greedy", "neural")
    assert not cfg.fanout.fit_to_round and cfg.fanout.budget == 4
    plain = apply_overrides(settings_for("quick"), parse_args(["--draft", d, "--ld-preload", "none"]))
    sync = load_config(System("sync_sd", 3).spec(d, plain))
    assert sync.fallback == "auto"  # no --fallback: the plugin's default
    assert load_config(System("ssd", 3).spec(d, plain)).fanout.fit_to_round  # the default: on


def test_theory_uses_each_sources_acceptance_and_the_backup_actually_used():
    """SSD's prediction takes E_hit / E_miss from the worker's outcomes by source and
    charges a miss round the backup's mean time, fast (prompt lookup) rounds included;
    a result without those counters keeps the old, neural-only model and says so."""
    from benchmarks.run import add_theory, summarize

    group = {"dataset": "d", "temperature": 0.0, "batch": 1, "max_tokens": 9, "n_chunks": 0}
    ar = {**group, "system": "AR", "kind": "ar", "k": 0, "cores": 1, "per_token_s": [0.1],
          "spans_s": [0.8], "counters": {"vllm:spec_decode_num_accepted_tokens": 0}}
    c = {"vllm:spec_decode_num_drafts": 100, "vllm:spec_decode_num_accepted_tokens": 100,
         "plugin.rounds": 100, "plugin.seqs": 100, "plugin.lookups": 100, "plugin.hits": 50,
         "plugin.fallbacks": 50, "plugin.wait_prespec_s": 0.0, "plugin.wait_step_s": 1.0,
         "draft.prespec_s": 5.0, "draft.fallback_s": 2.0, "draft.fallback_rounds": 20,
         "draft.fast_seqs": 30, "draft.fast_rounds": 30,
         "draft.hit_outcomes": 50, "draft.hit_tokens": 125,        # E_hit 2.5
         "draft.neural_outcomes": 20, "draft.neural_tokens": 40,   # E_miss (40 + 45) / 50 = 1.7
         "draft.fast_outcomes": 30, "draft.fast_tokens": 45}
    ssd = {**group, "system": "SSD-K3", "kind": "ssd", "k": 3, "cores": 2, "per_token_s": [0.08],
           "spans_s": [12.0], "counters": c}
    new_counters = {k for k in c if k.startswith("draft.") and k.endswith(("_outcomes", "_tokens", "_rounds"))
                    and k != "draft.fallback_rounds"}
    old = {**ssd, "counters": {k: v for k, v in c.items() if k not in new_counters}}
    recs = [ar, ssd]
    for r in recs:
        summarize(r)
    add_theory(recs)
    assert (ssd["accept_len_hit"], ssd["accept_len_miss"]) == (2.5, 1.7)
    # V = 12 s / 100 rounds - 0.01 s wait = 0.11 s; t1 = 0.1 s; T_p = 0.05 / 0.11 of a verify;
    # backup 2 s over 50 miss rounds = 0.04 s. Tokens 0.5*2.5 + 0.5*1.7 = 2.1; time
    # 0.5*1 + 0.5*(1 + 0.04/0.11) = 1.1818 verifies -> 2.1 / 1.1818 * 0.1 / 0.11 = 1.615.
    assert abs(ssd["predicted"] - 1.615) < 1e-3 and not ssd["note"]
    recs = [ar, old]
    summarize(old)
    add_theory(recs)
    # E = 2.0 for both, neural backup 2 s / 20 rounds = 0.1 s: time 0.5 + 0.5*(1 + 0.1/0.11)
    # = 1.4545 -> 2.0 / 1.4545 * 0.1 / 0.11 = 1.25
    assert old["accept_len_miss"] is None and abs(old["predicted"] - 1.25) < 1e-3
    assert "assumes the neural backup" in old["note"]


def test_engine_starts_pool_into_one_record_per_cell_with_their_spread():
    """--starts N: a system's records of one group from N engine starts become one
    record whose figures are medians over every start's requests and spans (counters
    summed), with each start's tok/s total kept; other cells stay apart."""
    from benchmarks.run import markdown, pool_starts, summarize

    def rec(system, batch, spans, accepted):
        r = {"system": system, "kind": "ar", "k": 0, "cores": 1, "dataset": "d",
             "temperature": 0.0, "batch": batch, "max_tokens": 11, "n_requests": len(spans),
             "n_chunks": len(spans), "per_token_s": [s / 10 for s in spans], "spans_s": spans,
             "wall_s": spans, "placement": {}, "forward_ms": {"1": 10.0 * len(spans)},
             "counters": {"vllm:spec_decode_num_drafts": 10,
                          "vllm:spec_decode_num_accepted_tokens": accepted}}
        summarize(r)
        return r

    runs = [rec("AR", 1, [1.0], 5), rec("AR", 2, [2.0], 0), rec("AR", 1, [2.0, 4.0], 15)]
    runs[0]["forward_ms"]["5"] = 7.0  # a width only the first start ran
    pooled = pool_starts(runs)
    assert len(pooled) == 2
    one = next(r for r in pooled if r["batch"] == 1)
    assert one["starts_tok_s"] == [10.0, 3.75]      # 10 tokens / 1 s; median of 5, 2.5
    assert one["spans_s"] == [1.0, 2.0, 4.0] and one["tok_s_total"] == 5.0
    assert one["counters"]["vllm:spec_decode_num_accepted_tokens"] == 20
    assert one["accept_len"] == 2.0 and one["n_requests"] == 3
    assert one["forward_ms"] == {"1": 15.0, "5": 7.0}
    assert one["starts_forward_ms"] == [{"1": 10.0, "5": 7.0}, {"1": 20.0}]
    assert [c["vllm:spec_decode_num_accepted_tokens"] for c in one["starts_counters"]] == [5, 15]
    two = next(r for r in pooled if r["batch"] == 2)
    assert two["starts_tok_s"] == [10.0] and two["tok_s_total"] == 10.0
    for r in pooled:
        r.update(speedup=None, speedup_vs_best_2c=None, predicted=None, limit=None,
                 measured_over_limit=None, note="")
    text = markdown({"meta": {"mode": "full", "started": "t", "target": "T", "draft": "D",
                              "max_tokens": 11, "cores": [0, 1], "settings": {}},
                     "records": pooled})
    assert "| d | 0 | 1 | AR | 10.0, 3.8 | 3.8 / 6.9 / 10.0 |" in text


def _where(target_threads, draft_threads=None):
    def side(threads):
        return {"pid": 1, "threads": len(threads), "busy_threads": threads,
                "busy_cores": sorted({c for t in threads for c in t["cores"]}),
                "all_cores": sorted({c for t in threads for c in t["cores"]})}
    return {"target": side(target_threads), "draft": side(draft_threads) if draft_threads else None}


def _t(cores, busy=1.0, name="python", tid=1):
    return {"tid": tid, "name": name, "cores": cores, "cpu_s": busy, "busy_s": busy}


def test_the_benchmark_refuses_threads_that_are_not_where_it_says():
    from benchmarks.run import System, check_placement

    pair = [0, 1]
    check_placement(System("ar"), _where([_t([0])]), pair)
    check_placement(System("ar", cores=2), _where([_t([0, 1]), _t([0, 1], 0.8)]), pair)
    check_placement(System("ar", cores=2), _where([_t([0]), _t([1], 0.8)]), pair)  # Intel OpenMP
    ssd = System("ssd", 3)
    # Ray's client threads of the target's process may sit on the draft's core
    check_placement(ssd, _where([_t([0]), _t([1], 0.1, "gcs_client")], [_t([1])]), pair)
    # the draft's core lent: the team's thread there may be busier than the main thread
    check_placement(ssd, _where([_t([0], 5.1), _t([1], 6.1, tid=2)], [_t([1])]), pair)
    # SD on the lent cores: the draft's team borrows the target's core, a thread bound there
    borrowing = _where([_t([0])], [_t([1]), _t([0], 0.5, tid=2)])
    check_placement(ssd, borrowing, pair, borrowed=True)
    with pytest.raises(SystemExit, match="threads not where the benchmark says"):
        check_placement(ssd, borrowing, pair)  # no lent_sd round: not borrowed
    # who may borrow (the benchmark passes borrowed for them from the start): the
    # controller's auto regime only, not a pinned K, SSD's regime pinned, or plain vLLM
    assert ssd.may_borrow and System("sync_sd", 3).may_borrow
    assert not System("ssd", 3, controller="fixed").may_borrow
    assert not System("ssd", 3, regime="ssd").may_borrow
    assert not System("ar", cores=2).may_borrow and not System("vllm_sd", 1).may_borrow
    with pytest.raises(SystemExit, match="threads not where the benchmark says"):
        check_placement(ssd, _where([_t([0])], [_t([0, 1])]), pair, borrowed=True)  # roaming
    bad = [
        (System("ar"), _where([_t([0, 1])])),                          # unbound target
        (System("ar", cores=2), _where([_t([0, 1])])),                  # one thread on 2 cores
        (System("ar", cores=2), _where([_t([0]), _t([0], 0.5)])),       # 2 threads, one core
        (ssd, _where([_t([1])], [_t([1])])),                            # target on the draft's core
        (ssd, _where([_t([0])], [_t([0, 1])])),                         # draft free to roam
        (ssd, _where([_t([0])])),                                       # no draft seen
        (ssd, _where([_t([0]), _t([0, 1], 0.2)], [_t([1])])),           # a roaming target thread
        (ssd, _where([_t([0], 6.1, tid=2), _t([1], 5.1)], [_t([1])])),  # main thread on the draft's
    ]
    for system, where in bad:
        with pytest.raises(SystemExit, match="threads not where the benchmark says"):
            check_placement(system, where, pair)
