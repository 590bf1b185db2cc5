"""vllm-saguaro tune's own logic: predictions from measurements, the recommended K, the
yaml it writes (which the plugin must accept), prompt files."""
import json
import os

import pytest

from vllm_saguaro.config import load_config
from vllm_saguaro.vllm_glue import tune

COSTS = {"target_fixed_s": 0.06, "target_per_token_s": 0.0035, "draft_fixed_s": 0.010,
         "draft_per_row_s": 0.002, "acceptance_rate": 0.6}


def alone_from(costs, batches):
    """The target alone at the costs line's rate (what step 0 would measure)."""
    return {b: b / (costs["target_fixed_s"] + costs["target_per_token_s"] * b) for b in batches}


def test_predictions_favour_ssd_at_batch_1_and_nothing_at_large_batch():
    hits = {1: {"hit_rate": 0.5}, 16: {"hit_rate": 0.3}}
    rows = tune.predict(COSTS, hits, [1, 2, 3], alone_from(COSTS, [1, 16]))
    at = {(r["batch"], r["system"], r["k"]): r["speedup"] for r in rows}
    assert at[(1, "SSD", 3)] > at[(1, "SD", 3)] > 0
    assert at[(1, "SSD", 3)] > 1.0
    assert at[(16, "SSD", 3)] < 1.0  # verifying 64 tokens costs more than it gains
    k, expected = tune.recommend(rows, [1, 2, 3])
    assert k in (1, 2, 3) and expected[1] > 1.0 and expected[16] == 1.0  # plain decoding there


LENT = {"lent_sd_fixed_s": 0.036, "lent_sd_per_token_s": 0.0035,
        "borrowed_draft_fixed_s": 0.006, "borrowed_draft_per_row_s": 0.0015,
        "lent_sd_overhead_s": 0.002}


def test_sd_on_the_lent_cores_is_predicted_and_chosen_where_it_leads():
    hits = {1: {"hit_rate": 0.5}, 16: {"hit_rate": 0.3}}
    # the target alone on every core: the lent line's step, as plain vLLM on both cores
    alone = {b: b / (0.036 + 0.0035 * b) for b in (1, 16)}
    rows = tune.predict(COSTS, hits, [1, 2, 3], alone, LENT)
    at = {(r["batch"], r["system"], r["k"]): r["speedup"] for r in rows}
    assert len(rows) == 2 * 3 * 3
    assert at[(1, "lent SD", 1)] > 1.05 * max(1.0, at[(1, "SSD", 3)])
    regime, speedup = tune.with_controller(rows, 1, 3)
    assert regime == "lent_sd" and speedup == max(at[(1, "lent SD", k)] for k in (1, 2, 3))
    assert tune.with_controller(rows, 16, 3) == ("plain", 1.0)
    k, expected = tune.recommend(rows, [1, 2, 3])
    assert expected[1] == max(at[(1, "lent SD", x)] for x in range(1, k + 1))
    # a slower verification on every core: SD on the lent cores no longer leads
    slow = {**LENT, "lent_sd_fixed_s": 0.09}
    rows = tune.predict(COSTS, hits, [1, 2, 3], alone, slow)
    assert tune.with_controller(rows, 1, 3)[0] != "lent_sd"
    # without the lent step (a GPU target): no such rows, the old choice
    assert all(r["system"] != "lent SD" for r in tune.predict(COSTS, hits, [3], alone))


def test_what_sd_on_the_lent_cores_was_measured_to_give_bounds_its_model():
    hits = {1: {"hit_rate": 0.5}, 4: {"hit_rate": 0.4}}
    alone = {b: b / (0.036 + 0.0035 * b) for b in (1, 4)}
    # a verification cheap in its width: the model puts the regime ahead at batch 4 too
    rows = tune.predict(COSTS, hits, [1, 2, 3], alone, {**LENT, "lent_sd_per_token_s": 0.001})
    model = {b: tune.with_controller(rows, b, 3) for b in (1, 4)}
    assert model[4][0] == "lent_sd" and model[4][1] > 1.05
    # step 2b: the regime ran below the target alone at batch 4: plain decoding there
    lent_rates = {1: [alone[1] * 1.5, alone[1] * 1.6], 4: [alone[4] * 0.85, alone[4] * 0.95]}
    measured = tune.measured_ranges(lent_rates, alone)
    assert measured["lent SD"][4] == pytest.approx((0.85, 0.95))
    assert tune.with_controller(rows, 4, 3, measured=measured) == ("plain", 1.0)
    # and above its model at batch 1: the measurement's slowest batch, not the model
    regime, speedup = tune.with_controller(rows, 1, 3, measured=measured)
    assert model[1][1] < 1.5 and (regime, speedup) == ("lent_sd", pytest.approx(1.5))
    # a model inside the measured range stands
    wide = {"lent SD": {4: (0.5, 3.0)}}
    assert tune.with_controller(rows, 4, 3, measured=wide) == model[4]
    k, expected = tune.recommend(rows, [1, 2, 3], measured=measured)
    assert expected == {1: pytest.approx(1.5), 4: 1.0}
    assert tune.measured_ranges(None, alone) == {}


def test_recommend_prefers_the_smaller_k_on_ties():
    rows = [{"batch": 1, "k": k, "system": "SSD", "speedup": 0.5} for k in (1, 2, 3)]
    assert tune.recommend(rows, [1, 2, 3]) == (1, {1: 1.0})


def test_written_yaml_is_a_valid_config(tmp_path, tiny_draft):
    args = tune.parse_args([str(tiny_draft), "--draft", str(tiny_draft), "--out",
                            str(tmp_path / "s.yaml")])
    tune.write_yaml(args.out, args, 2, COSTS)
    cfg = load_config(args.out)
    assert cfg.num_speculative_tokens == 2 and cfg.controller.policy == "auto"
    assert cfg.controller.target_fixed_s == pytest.approx(0.06)
    assert cfg.controller.target_per_token_s == pytest.approx(0.0035)


def test_prompt_files(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("first\n\nsecond\n")
    assert tune.read_prompts(str(lines), 3) == ["first", "second", "first"]
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    assert tune.read_prompts(str(jl), 2) == ["a", "b"]
    assert len(tune.read_prompts(None, 20)) == 20
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(SystemExit):
        tune.read_prompts(str(tmp_path / "empty.txt"), 2)


def test_bad_arguments_are_refused(tmp_path, tiny_draft):
    with pytest.raises(SystemExit):
        tune.parse_args([str(tmp_path), "--draft", str(tiny_draft)])  # no checkpoint there
    with pytest.raises(SystemExit):
        tune.parse_args([str(tiny_draft), "--draft", str(tiny_draft), "--ks", "0,1"])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):  # --out under a file: refused before measuring
        tune.parse_args([str(tiny_draft), "--draft", str(tiny_draft), "--out",
                         str(tmp_path / "file" / "s.yaml")])


def test_output_directories_are_made_before_measuring(tmp_path, tiny_draft):
    out, js = tmp_path / "new" / "s.yaml", tmp_path / "other" / "t.json"
    tune.parse_args([str(tiny_draft), "--draft", str(tiny_draft), "--out", str(out),
                     "--json", str(js)])
    assert out.parent.is_dir() and js.parent.is_dir()


def test_plain_decoding_on_lent_cores_sets_the_floor():
    rows = [{"batch": 16, "k": 3, "system": "SSD", "speedup": 1.2}]
    assert tune.recommend(rows, [3], plain=1.4) == (3, {16: 1.4})


def test_the_rounds_overhead_and_the_measured_baseline_enter_the_prediction():
    hits = {1: {"hit_rate": 0.5, "overhead_s": 0.0}}
    base = tune.predict(COSTS, hits, [3], alone_from(COSTS, [1]))
    slower = tune.predict(COSTS, {1: {"hit_rate": 0.5, "overhead_s": 0.03}}, [3],
                          alone_from(COSTS, [1]))
    faster_alone = tune.predict(COSTS, hits, [3], {1: 2 * alone_from(COSTS, [1])[1]})
    for system in ("SD", "SSD"):
        b, s, f = (next(r["speedup"] for r in rows if r["system"] == system)
                   for rows in (base, slower, faster_alone))
        assert s < b and f == pytest.approx(b / 2)


def test_round_overhead_from_the_proposers_metrics():
    before = {"rounds": 10, "target_rounds": 9, "target_s": 0.9, "transport_s": 0.05,
              "wait_prespec_s": 0.0}
    after = {"rounds": 30, "target_rounds": 29, "target_s": 0.9 + 20 * 0.110,
             "transport_s": 0.05 + 20 * 0.008, "wait_prespec_s": 20 * 0.002}
    # the target's side 110 ms against a 100 ms model step, 8 ms crossing, 2 ms overrun
    assert tune.round_overhead(before, after, 0.100) == pytest.approx(0.020)
    # a target step faster than the model's takes off the rest, never below 0
    assert tune.round_overhead(before, after, 0.200) == 0.0
    assert tune.round_overhead(before, before, 0.100) == 0.0  # no round measured


def test_engine_starts_are_pooled_over_every_batch():
    starts = [{1: [10.0, 11.0, 12.0], 4: [40.0]}, {1: [20.0, 21.0, 22.0], 4: [30.0, 50.0]}]
    assert tune.pooled(starts) == {1: 16.0, 4: 40.0}
    assert tune.prompts_needed(8, 16) == 16 * tune.MIN_BATCHES
    assert tune.prompts_needed(100, 1) == 100


def test_the_target_alone_runs_on_every_core_unless_the_user_bound_it(monkeypatch):
    from vllm_saguaro.core.placement import BIND_ENV

    monkeypatch.delenv(BIND_ENV, raising=False)
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    assert tune.alone_binding() == {BIND_ENV: cores}
    monkeypatch.setenv(BIND_ENV, "0")
    assert tune.alone_binding() == {}  # the user's own binding stands
