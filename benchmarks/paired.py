"""SSD against plain decoding within one engine start (issue 19), pair by pair.

Usage:
    python -m benchmarks.paired [--batches 1,4,16] [--temperatures 0,1] [--repeats N]
        [--prompts-per-set 8] [--max-tokens 64] [--vllm-starts 1] [--beside-vllm]
        [--blocks N] [--out DIR]

Why: on these CPUs one engine start's decode speed differs from the next by ~5% (the
median coefficient of variation of plain vLLM's starts over 14 cells), up to 25%. A grid
of two starts per system (benchmarks/run.py) cannot tell a cell at 0.93x from one at
1.0x; ~22 starts per system and cell would be needed. Here the plugin's engine (SSD,
its defaults) runs every chunk of prompts twice: once paused (SaguaroProposer.pause,
through the worker RPC: plain decoding under the plugin, the draft idle with its cores
lent, no lookup drafts) and once as configured. The order alternates pair by pair
(paused first, then SSD first, ...), so the start's own speed and the drift through
the run cancel in each pair's ratio.

SSD against plain vLLM is then the product of two factors, reported apart:
- SSD / paused, within the start: what speculation (the controller's choices) gives
  over plain decoding under the plugin, with a 90% interval over the pairs;
- paused / plain vLLM on two cores (vLLM's own binding, a start of its own per block,
  `--vllm-starts`, running the same chunks): the plugin's own cost when it speculates
  nothing, across starts as any baseline must be, so as noisy as the grid's cells.

What the pairing changes: the controller's idle timers run on through the paused
chunks (an idle's 30 s recheck comes sooner by their time), and what it measured
of the last chunk may have expired (kept 30 s). vLLM's prefix cache serves the
second run of a chunk's prompts; the alternation gives both sides as many first runs.

`--beside-vllm` takes the start-to-start spread out of SSD against plain vLLM too: plain
vLLM's engine (its own binding, as `--vllm-starts` starts it) is started beside the
plugin's and stays resident through the block, and every chunk runs on it as a third
side of each pair, in turn (arm_order: each side runs first, second and third alike
over six pairs). An idle engine waits on its queue and its draft on its pipe, so the
engine that runs has the cores to itself. The prefix caches are then reset before
every run, so that each side prefills every chunk cold (with the plugin's two runs
sharing one cache, vLLM's alone would otherwise prefill cold only in the first pass).
SSD / plain vLLM and paused / plain vLLM are then ratios within the pairs, with their
90% intervals; what is left between starts is each engine start's own speed, which
more blocks (`--blocks`) average. Which engine starts first biases the comparison: an
A/A check, two plain vLLM engines side by side, put the second-started one 5% ahead at
batch 4 and 2% at batch 16 (issue 19's twenty-seventh round). So the two engines start
in one order in odd blocks and in the other in even ones, and the pooled table weighs
the two orders alike (balanced_interval).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from benchmarks.run import (ENV, Settings, System, chunks, decode_times, diff, environment,
                            load_prompts, log, make_engine, plan_systems, resolve_models,
                            resolve_preload, snapshot)
from vllm_saguaro.vllm_glue.offline import shutdown
from vllm_saguaro.vllm_glue.vllm_logs import (engine_failures_explained, send_engine_stderr_to,
                                              send_vllm_logs_to)

# Student's t at 0.95 (a two-sided 90% interval) by degrees of freedom; 1.645 beyond
T90 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860,
       9: 1.833, 10: 1.812, 12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}


def t90(df: int) -> float:
    """Student's t for a two-sided 90% interval (the table's entry at or below df)."""
    if df > 30:
        return 1.645
    return T90[max(d for d in T90 if d <= df)]


def ratio_interval(ratios: list[float]) -> dict:
    """The pairs' ratios summarised on the log scale (a ratio and its inverse weigh
    alike): geometric mean, median, and a 90% t-interval of the geometric mean (None
    with fewer than two pairs)."""
    logs = [math.log(r) for r in ratios]
    out = {"n": len(ratios), "geomean": math.exp(statistics.fmean(logs)),
           "median": statistics.median(ratios), "low": None, "high": None}
    if len(logs) >= 2:
        half = t90(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        out["low"] = math.exp(statistics.fmean(logs) - half)
        out["high"] = math.exp(statistics.fmean(logs) + half)
    return out


def pair_order(i: int) -> tuple[bool, bool]:
    """Whether each run of pair i is paused: paused first in even pairs, SSD first in
    odd ones, so neither side always runs first (a chunk's first run prefills cold)."""
    return (True, False) if i % 2 == 0 else (False, True)


# The sides of a pair with plain vLLM beside (--beside-vllm): their orders in turn
ARMS = ("paused", "ssd", "vllm")
ARM_ORDERS = list(itertools.permutations(ARMS))


def arm_order(i: int, beside: bool) -> tuple[str, ...]:
    """The sides of pair i in the order they run: paused and SSD alternating first
    (pair_order); with plain vLLM beside, the six orders of the three in turn, so that
    over six pairs each side runs first, second and third twice."""
    if beside:
        return ARM_ORDERS[i % len(ARM_ORDERS)]
    return tuple("paused" if p else "ssd" for p in pair_order(i))


def set_paused(llm, paused: bool) -> None:
    if llm.collective_rpc("saguaro_pause", args=(paused,)) != [True]:
        raise SystemExit("the engine has no Saguaro proposer to pause")


def run_chunk(llm, chunk: list[str], sp, max_tokens: int, cold: bool = False) -> dict:
    """One chunk's run: its decode span, tok/s and counter deltas. cold: the engine's
    prefix cache reset first (--beside-vllm)."""
    if cold and not llm.reset_prefix_cache():
        raise SystemExit("the engine's prefix cache could not be reset (requests still running)")
    before, _ = snapshot(llm)
    outs = llm.generate(chunk, sp, use_tqdm=False)
    after, _ = snapshot(llm)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    _, span = decode_times(outs, max_tokens)
    return {"span_s": span, "tok_s": len(chunk) * (max_tokens - 1) / span,
            "counters": diff(after, before)}


def controller_did(counters: list[dict]) -> dict:
    """What SSD's runs did, summed: the share of rounds the draft idled, of SD on the
    lent cores, of the idle's own lookup drafts, and the draft tokens sent per row."""
    c = {k: sum(x.get(k, 0) for x in counters) for k in counters[0]} if counters else {}
    rounds = c.get("plugin.rounds", 0) + c.get("plugin.idle_rounds", 0)
    # rows by tokens sent (plugin.sent_<n>, n = 0..K: as many as the run's K)
    sent = {int(k.rsplit("_", 1)[1]): x for k, x in c.items() if k.startswith("plugin.sent_")}
    rows = sum(sent.values())
    share = lambda k: c.get(k, 0) / rounds if rounds else None  # noqa: E731
    return {"rounds": rounds, "idle_share": share("plugin.idle_rounds"),
            "lent_sd_share": share("plugin.lent_sd_rounds"),
            "idle_lookup_share": share("plugin.idle_lookup_rounds"),
            "tokens_per_row": sum(n * x for n, x in sent.items()) / rows if rows else None}


@contextmanager
def engine(system: System, spec: dict | None, prompts, target, s: Settings):
    """An engine started as its user starts it (System.env), warmed up on one prompt
    (not measured), shut down after."""
    from vllm import SamplingParams

    with environment(system.env(s.pair, s)):
        llm = make_engine(target, spec, s)
    try:
        warm = next(iter(prompts.values()))[:1]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        yield llm
    finally:
        shutdown(llm)


def run_plugin_block(system: System, groups: list[tuple], prompts, target, draft,
                     s: Settings, repeats: int, beside: System | None = None,
                     plugin_first: bool = False) -> list[dict]:
    """One engine start of `system`: every group's chunks, each run paused and as
    configured, and on plain vLLM's engine started beside it (`beside`), in turn
    (arm_order). plugin_first: the plugin's engine starts before plain vLLM's (measure
    alternates it by block: an A/A check found the engine started second faster)."""
    from vllm import SamplingParams

    with ExitStack() as stack:
        def start(which: str):
            if which == "plugin":
                return stack.enter_context(engine(system, system.spec(draft, s), prompts,
                                                  target, s))
            return None if beside is None else stack.enter_context(
                engine(beside, None, prompts, target, s))
        if plugin_first:
            llm, plain = start("plugin"), start("vllm")
        else:
            plain, llm = start("vllm"), start("plugin")
        out = []
        for dataset, temperature, batch in groups:
            sp = SamplingParams(temperature=temperature, max_tokens=s.max_tokens, ignore_eos=True)
            rec = {"system": system.name, "dataset": dataset, "temperature": temperature,
                   "batch": batch, "paused": [], "ssd": []}
            if plain is not None:
                rec["vllm"], rec["started_first"] = [], "plugin" if plugin_first else "vllm"
            for i, chunk in enumerate(chunks(prompts[dataset], batch) * repeats):
                for arm in arm_order(i, plain is not None):
                    if arm != "vllm":
                        set_paused(llm, arm == "paused")
                    rec[arm].append(run_chunk(plain if arm == "vllm" else llm, chunk, sp,
                                              s.max_tokens, cold=plain is not None))
            set_paused(llm, False)
            summarize_pairs(rec)
            beside_note = ("" if plain is None else f", SSD / plain vLLM beside "
                           f"{rec['ssd_vs_beside']['geomean']:.3f} (90% "
                           f"{_f(rec['ssd_vs_beside']['low'])}-{_f(rec['ssd_vs_beside']['high'])})")
            log(f"  {system.name} {dataset} T={temperature:g} b={batch}: SSD / paused "
                f"{rec['ratio']['geomean']:.3f} (90% {_f(rec['ratio']['low'])}-"
                f"{_f(rec['ratio']['high'])}, {rec['ratio']['n']} pairs){beside_note}, idle "
                f"{_f(rec['did']['idle_share'])}")
            out.append(rec)
        return out


def run_vllm_block(system: System, groups: list[tuple], prompts, target, s: Settings,
                   repeats: int) -> list[dict]:
    """One engine start of plain vLLM: every group's chunks as many times as the
    plugin's block runs each side."""
    from vllm import SamplingParams

    with engine(system, None, prompts, target, s) as llm:
        out = []
        for dataset, temperature, batch in groups:
            sp = SamplingParams(temperature=temperature, max_tokens=s.max_tokens, ignore_eos=True)
            runs = [run_chunk(llm, c, sp, s.max_tokens)
                    for c in chunks(prompts[dataset], batch) * repeats]
            out.append({"dataset": dataset, "temperature": temperature, "batch": batch,
                        "tok_s": [r["tok_s"] for r in runs]})
        return out


def speedups(recs: list[dict], base: str, side: str) -> list[float]:
    """Each pair's tok/s of `side` over `base` ("paused", "ssd", "vllm"), over the cells'
    records `recs`: the inverse of their spans' ratio, as both decode the same tokens."""
    return [a["span_s"] / b["span_s"] for rec in recs for a, b in zip(rec[base], rec[side])]


def summarize_pairs(rec: dict) -> None:
    """A cell's pairs: SSD / paused (speedups), and with plain vLLM beside (rec["vllm"])
    SSD / plain vLLM and paused / plain vLLM alike; medians of each side's tok/s; what
    SSD's runs did."""
    def ratios(base: str, side: str) -> dict:
        return ratio_interval(speedups([rec], base, side))
    rec["ratio"] = ratios("paused", "ssd")
    rec["paused_tok_s"] = statistics.median(r["tok_s"] for r in rec["paused"])
    rec["ssd_tok_s"] = statistics.median(r["tok_s"] for r in rec["ssd"])
    rec["did"] = controller_did([r["counters"] for r in rec["ssd"]])
    if rec.get("vllm"):
        rec["ssd_vs_beside"] = ratios("vllm", "ssd")
        rec["paused_vs_beside"] = ratios("vllm", "paused")
        rec["beside_tok_s"] = statistics.median(r["tok_s"] for r in rec["vllm"])


def combine(plugin: list[dict], vllm: list[dict]) -> list[dict]:
    """One row per system and cell: SSD / paused within the start, paused / plain vLLM across
    starts (medians of the chunks' tok/s), and their product."""
    rows = []
    for rec in plugin:
        key = (rec["dataset"], rec["temperature"], rec["batch"])
        theirs = [t for v in vllm if (v["dataset"], v["temperature"], v["batch"]) == key
                  for t in v["tok_s"]]
        vllm_tok_s = statistics.median(theirs) if theirs else None
        paused_vs = rec["paused_tok_s"] / vllm_tok_s if vllm_tok_s else None
        rows.append({**{k: rec[k] for k in ("system", "dataset", "temperature", "batch", "ratio",
                                             "paused_tok_s", "ssd_tok_s", "did")},
                     "vllm_tok_s": vllm_tok_s, "paused_vs_vllm": paused_vs,
                     "ssd_vs_vllm": paused_vs * rec["ratio"]["geomean"] if paused_vs else None,
                     **{k: rec.get(k) for k in ("beside_tok_s", "ssd_vs_beside",
                                                "paused_vs_beside")}})
    return rows


def balanced_interval(groups: list[list[float]]) -> dict:
    """Ratios from groups that may each carry a bias of their own (the start order of
    the engines beside each other), each group weighing alike: the geometric mean of the
    groups' geometric means, with a 90% t-interval from the groups' variances (df: the
    smallest group's, which errs wide). One group: ratio_interval."""
    groups = [g for g in groups if g]
    if len(groups) == 1:
        return ratio_interval(groups[0])
    logs = [[math.log(r) for r in g] for g in groups]
    centre = statistics.fmean(statistics.fmean(g) for g in logs)
    out = {"n": sum(map(len, logs)), "geomean": math.exp(centre),
           "median": statistics.median(r for g in groups for r in g), "low": None, "high": None}
    if min(map(len, logs)) >= 2:
        var = sum(statistics.variance(g) / len(g) for g in logs) / len(logs) ** 2
        half = t90(min(map(len, logs)) - 1) * math.sqrt(var)
        out["low"], out["high"] = math.exp(centre - half), math.exp(centre + half)
    return out


def pooled(plugin: list[dict]) -> list[dict]:
    """With plain vLLM beside, each system's cell over every block (engine starts): the
    pairs of all its starts, SSD / plain vLLM with the starts of each order weighing
    alike (balanced_interval: an A/A check, two plain vLLM engines side by side, put the
    second-started one 5% ahead at batch 4), and SSD / paused in one interval; one row
    per system and cell run in more than one block."""
    cells: dict[tuple, list[dict]] = {}
    for rec in plugin:
        if rec.get("vllm"):
            key = (rec["system"], rec["dataset"], rec["temperature"], rec["batch"])
            cells.setdefault(key, []).append(rec)
    out = []
    for (system, dataset, temperature, batch), recs in cells.items():
        if len(recs) < 2:
            continue
        orders = sorted({rec.get("started_first") for rec in recs}, key=str)
        by_order = [[rec for rec in recs if rec.get("started_first") == o] for o in orders]
        out.append({"system": system, "dataset": dataset, "temperature": temperature,
                    "batch": batch, "starts": len(recs),
                    "ssd_vs_beside": balanced_interval([speedups(group, "vllm", "ssd")
                                                        for group in by_order]),
                    "ssd_vs_paused": ratio_interval(speedups(recs, "paused", "ssd")),
                    "per_start": [rec["ssd_vs_beside"]["geomean"] for rec in recs],
                    "first": [rec.get("started_first") for rec in recs]})
    return out


def _per_start(pool: dict) -> str:
    """A pooled cell's SSD / plain vLLM beside in each start, with which engine started
    first there."""
    firsts = pool.get("first") or [None] * len(pool["per_start"])
    return ", ".join(f"{x:.3f}" + (f" ({w} first)" if w else "")
                     for x, w in zip(pool["per_start"], firsts))


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# SSD against plain decoding, paired within one engine start ({m['started']})",
             "", f"`{m['command']}`", "",
             f"{m['prompts_per_set']} prompts per set, {m['max_tokens']} tokens, "
             f"passes over each set: {m['repeats']}; {m['vllm_starts']} plain vLLM start(s) "
             "per block. SSD / paused: geometric mean over the pairs, with its 90% interval "
             "(within the start). Paused / vLLM: medians of the chunks' tok/s, across starts."
             + (" Plain vLLM beside: started beside each plugin start, every chunk run on "
                "it too, in turn (prefix caches reset before every run); its ratios are "
                "within the pairs, with their 90% intervals." if m.get("beside_vllm") else ""),
             "", "| system | set | T | b | pairs | SSD / paused | 90% | paused tok/s | "
                 "SSD tok/s | vLLM 2c tok/s | paused / vLLM | SSD / vLLM | vLLM beside tok/s | "
                 "**SSD / vLLM beside** | 90% | paused / vLLM beside | idle | lent SD | "
                 "idle lookup | tokens / row |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        q, d, b = r["ratio"], r["did"], r.get("ssd_vs_beside") or {}
        lines.append(f"| {r['system']} | {r['dataset']} | {r['temperature']:g} | {r['batch']} | "
                     f"{q['n']} | "
                     f"{q['geomean']:.3f} | {_f(q['low'], '.3f')}-{_f(q['high'], '.3f')} | "
                     f"{r['paused_tok_s']:.1f} | {r['ssd_tok_s']:.1f} | {_f(r['vllm_tok_s'], '.1f')} | "
                     f"{_f(r['paused_vs_vllm'], '.3f')} | {_f(r['ssd_vs_vllm'], '.3f')} | "
                     f"{_f(r.get('beside_tok_s'), '.1f')} | **{_f(b.get('geomean'), '.3f')}** | "
                     f"{_f(b.get('low'), '.3f')}-{_f(b.get('high'), '.3f')} | "
                     f"{_f((r.get('paused_vs_beside') or {}).get('geomean'), '.3f')} | "
                     f"{_f(d['idle_share'])} | {_f(d['lent_sd_share'])} | "
                     f"{_f(d['idle_lookup_share'])} | {_f(d['tokens_per_row'])} |")
    if result.get("pooled"):
        lines += ["", "Pooled over the blocks (engine starts), plain vLLM beside: every pair of "
                  "every start, the starts of each order (which engine started first) "
                  "weighing alike in SSD / vLLM beside.", "",
                  "| system | set | T | b | starts | pairs | **SSD / vLLM beside** | 90% | "
                  "per start | SSD / paused | 90% |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["pooled"]:
            b, q = r["ssd_vs_beside"], r["ssd_vs_paused"]
            lines.append(f"| {r['system']} | {r['dataset']} | {r['temperature']:g} | "
                         f"{r['batch']} | {r['starts']} | {b['n']} | **{b['geomean']:.3f}** | "
                         f"{_f(b['low'], '.3f')}-{_f(b['high'], '.3f')} | "
                         f"{_per_start(r)} | "
                         f"{q['geomean']:.3f} | {_f(q['low'], '.3f')}-{_f(q['high'], '.3f')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.paired",
                                description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--prompts-per-set", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=None,
                   help="passes over each set (default: enough for 6 pairs a cell)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--systems", default=None, help="comma list of the plugin's SSD systems "
                   "(benchmarks.run's names, e.g. SSD-K3,SSD-K3-nolookup; default SSD-K<k>), "
                   "each a start of its own per block, in turn")
    p.add_argument("--vllm-starts", type=int, default=1,
                   help="plain vLLM (2 cores) starts per block, after the plugin's (0: none)")
    p.add_argument("--beside-vllm", action="store_true",
                   help="start plain vLLM (2 cores) beside each plugin start and run every "
                        "chunk on it too, in turn: SSD / plain vLLM within the pairs; the "
                        "prefix caches reset before every run")
    p.add_argument("--blocks", type=int, default=1,
                   help="each batch size's starts this many times over (new engines each); "
                        "with --beside-vllm the engines' start order alternates by block, "
                        "so an even number balances it")
    p.add_argument("--out", default="benchmarks/results/paired")
    p.add_argument("--log-file", help="vLLM's own log (default: vllm.log in --out)")
    p.add_argument("--target"), p.add_argument("--draft")
    p.add_argument("--prompts-file", help="JSON lines {set, prompt, chat} instead of the PyPI sets")
    p.add_argument("--ld-preload", default="docs", help="as benchmarks.run's")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (decode time is first to last token)")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.blocks < 1:
        p.error("--blocks must be >= 1")
    return args


def main(argv=None) -> dict:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # as a user starts it
    args = parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 2:
        raise SystemExit(f"needs exactly 2 cores (target + draft), this process has {cores}")
    batches = [int(x) for x in args.batches.split(",")]
    temps = [float(x) for x in args.temperatures.split(",")]
    s = Settings("paired", args.max_tokens, batches, temps, [args.k], 8, args.prompts_per_set,
                 pair=cores, ld_preload=resolve_preload(args.ld_preload))
    if not args.draft:
        from benchmarks.reference_pair import HEAD_TOKENS

        s.head_tokens = HEAD_TOKENS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = str(Path(args.log_file) if args.log_file else out / "vllm.log")
    send_vllm_logs_to(log_file)
    send_engine_stderr_to(log_file)
    log(f"vLLM's own log: {log_file}")
    with engine_failures_explained(log_file, "benchmarks.paired"):
        return measure(args, s, out, cores, batches, temps, argv)


def measure(args, s, out: Path, cores: list[int], batches: list[int], temps: list[float],
            argv) -> dict:
    """Every batch size's blocks (the plugin's starts, then plain vLLM's), results written
    after each start."""
    target, draft = resolve_models(args)
    prompts = load_prompts(args, target, s)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ar = System("ar", cores=2)
    names = (args.systems or f"SSD-K{args.k}").split(",")
    known = {x.name: x for x in plan_systems(s) if x.kind == "ssd"}
    if set(names) - set(known):
        raise SystemExit(f"unknown SSD systems {sorted(set(names) - set(known))}; "
                         f"with K={args.k}: {', '.join(known)}")
    meta = {"started": started, "command": "python -m benchmarks.paired "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "target": target, "draft": draft, "cores": cores,
            "max_tokens": args.max_tokens, "prompts_per_set": args.prompts_per_set,
            "repeats": args.repeats or "enough for 6 pairs",
            "vllm_starts": args.vllm_starts, "systems": names,
            "beside_vllm": args.beside_vllm, "blocks": args.blocks}
    plugin, vllm = [], []

    def write() -> dict:  # after every start: a long run stopped keeps what it measured
        result = {"meta": meta, "plugin": plugin, "vllm": vllm, "rows": combine(plugin, vllm),
                  "pooled": pooled(plugin)}
        (out / "latest.json").write_text(json.dumps(result, indent=1))
        (out / "latest.md").write_text(markdown(result))
        return result

    beside = ar if args.beside_vllm else None
    if beside is not None and args.blocks % 2:
        log("note: with an odd --blocks the engines' start orders are not balanced "
            "(the engine started second ran ~5% faster at batch 4 in an A/A check)")
    for block in range(args.blocks):
        for b in batches:
            per_set = min(len(v) for v in prompts.values())
            repeats = args.repeats or max(1, math.ceil(6 / max(1, math.ceil(per_set / b))))
            groups = [(d, t, b) for t in temps for d in prompts]
            of = f" (block {block + 1}/{args.blocks})" if args.blocks > 1 else ""
            for name in names:
                log(f"b={b}: {name}, {repeats} pass(es), paired"
                    + (", plain vLLM beside" if beside else "") + of)
                plugin += run_plugin_block(known[name], groups, prompts, target, draft, s,
                                           repeats, beside, plugin_first=block % 2 == 1)
                write()
            for i in range(args.vllm_starts):
                log(f"b={b}: plain vLLM 2c, start {i + 1}/{args.vllm_starts}{of}")
                vllm += run_vllm_block(ar, groups, prompts, target, s, repeats)
                write()
    result = write()
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
