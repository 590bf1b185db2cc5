"""vllm-saguaro tune's own logic: predictions from measurements, the recommended K, the
yaml it writes (which the plugin must accept), prompt files."""
import json

import pytest

from vllm_saguaro.config import load_config
from vllm_saguaro.vllm_glue import tune

COSTS = {"target_fixed_s": 0.06, "target_per_token_s": 0.0035, "draft_fixed_s": 0.010,
         "draft_per_row_s": 0.002, "acceptance_rate": 0.6}


def test_predictions_favour_ssd_at_batch_1_and_nothing_at_large_batch():
    hits = {1: {"hit_rate": 0.5}, 16: {"hit_rate": 0.3}}
    rows = tune.predict(COSTS, hits, [1, 2, 3])
    at = {(r["batch"], r["system"], r["k"]): r["speedup"] for r in rows}
    assert at[(1, "SSD", 3)] > at[(1, "SD", 3)] > 0
    assert at[(1, "SSD", 3)] > 1.0
    assert at[(16, "SSD", 3)] < 1.0  # verifying 64 tokens costs more than it gains
    k, expected = tune.recommend(rows, [1, 2, 3])
    assert k in (1, 2, 3) and expected[1] > 1.0 and expected[16] == 1.0  # plain decoding there


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


def test_plain_decoding_on_lent_cores_sets_the_floor():
    rows = [{"batch": 16, "k": 3, "system": "SSD", "speedup": 1.2}]
    assert tune.recommend(rows, [3], plain=1.4) == (3, {16: 1.4})
