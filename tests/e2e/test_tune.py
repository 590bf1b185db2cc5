"""vllm-saguaro tune end to end on tiny models, as a user runs it (a subprocess): it
measures, predicts, and writes a saguaro.yaml the plugin accepts."""
import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_saguaro.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_tune_writes_a_valid_recommended_config(tmp_path, tiny_target, tiny_draft):
    out, js = tmp_path / "saguaro.yaml", tmp_path / "tune.json"
    cmd = [sys.executable, "-m", "vllm_saguaro.vllm_glue.cli", "tune", str(tiny_target),
           "--draft", str(tiny_draft), "--batches", "1,2", "--ks", "1,2", "-k", "2",
           "--num-prompts", "2", "--max-tokens", "10", "--dtype", "float32",
           "--max-model-len", "256", "--out", str(out), "--json", str(js),
           "--check", "--starts", "2"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "predicted speedup" in proc.stdout and "recommended K=" in proc.stdout
    # vLLM's log lines (every engine process's) go to the log file, not the terminal
    log = (tmp_path / "saguaro.tune.log").read_text()
    assert "Initializing a V1 LLM engine" in log and "vllm_saguaro" in log
    for text in (proc.stdout, proc.stderr):
        assert "Initializing a V1 LLM engine" not in text and " INFO " not in text
        # the weights' loading bar, and what an engine's process logs as it imports vLLM
        # (before vLLM configures its logging): both go to the log file with its stderr
        assert "Loading safetensors" not in text and "Triton is installed" not in text
    result = json.loads(js.read_text())
    costs = result["costs"]
    assert costs["target_fixed_s"] > 0 and costs["target_per_token_s"] >= 0
    assert costs["draft_fixed_s"] is not None and 0 < costs["acceptance_rate"] < 1
    # batches x K x (SD, SSD, and SD on the lent cores where they could be lent)
    lent = result["lent"]
    assert len(result["predictions"]) == 2 * 2 * (2 + (lent is not None))
    if lent is not None:
        assert lent["lent_sd_fixed_s"] > 0 and lent["borrowed_draft_fixed_s"] > 0
        # step 2b: what SD on the lent cores gives, per batch size
        assert set(result["lent_sd_tok_s"]) == {"1", "2"}
        assert all(r and min(r) > 0 for r in result["lent_sd_tok_s"].values())
    else:
        assert result["lent_sd_tok_s"] is None
    assert set(result["regimes"].values()) <= {"plain", "ssd", "lent_sd"}
    assert all(r["speedup"] > 0 for r in result["predictions"])
    # --check: the config and the target alone twice each (step 0 the alone's first)
    assert "2 engine starts each, pooled" in proc.stdout
    for key in ("measured", "alone_pooled_tok_s", "check_tok_s", "expected_pooled"):
        assert set(result[key]) == {"1", "2"} and all(v > 0 for v in result[key].values())
    cfg = load_config(str(out))
    assert cfg.num_speculative_tokens == result["recommended_k"] in (1, 2)
    assert cfg.controller.policy == "auto" and cfg.controller.target_fixed_s > 0


def test_an_engine_that_fails_to_start_ends_tune_with_its_cause(tmp_path, tiny_target,
                                                                 tiny_draft):
    """The engines' stderr goes to the log file, and with it vLLM's root cause: tune
    brings it back to the terminal (vllm_logs.engine_failures_explained)."""
    out = tmp_path / "saguaro.yaml"
    cmd = [sys.executable, "-m", "vllm_saguaro.vllm_glue.cli", "tune", str(tiny_target),
           "--draft", str(tiny_draft), "--batches", "1", "--num-prompts", "1",
           "--max-tokens", "4", "--dtype", "float32", "--max-model-len", "256",
           "--out", str(out)]
    # more KV cache than the machine has: the engine's worker fails at its start; the
    # engine in a process of its own, as users start it (the tests' default is in-process,
    # where the cause is raised in tune's process and reaches the terminal as it is)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "100000", "RAY_AUTH_MODE": "disabled",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("vllm-saguaro tune: RuntimeError: Engine core initialization failed"
            in proc.stderr), proc.stderr[-3000:]
    assert f"the engine's error, from {tmp_path / 'saguaro.tune.log'} (" in proc.stderr
    assert "VLLM_CPU_KVCACHE_SPACE" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not out.exists()
    assert "vllm-saguaro tune: ended by\nTraceback" in (tmp_path / "saguaro.tune.log").read_text()
