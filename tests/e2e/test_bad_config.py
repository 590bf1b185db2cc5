"""Bad Saguaro configurations, given as a user gives them (``LLM(speculative_config=...)``,
the path every entry point takes): each fails before any engine process starts, within
seconds, with one error that names the field and says what to do. The README's table
("Bad configuration") lists the same cases."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from vllm_saguaro.config import SaguaroConfigError


def _copy(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        edit(dst)
    return dst


def _corrupt_weights(d):
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")


def _corrupt_config(d):
    (d / "config.json").write_text("{\"model_type\": \"llama\", ")


def _other_vocab_size(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] += 7
    (d / "config.json").write_text(json.dumps(cfg))


def _other_tokenizer(d):
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, another mapping
    (d / "tokenizer.json").write_text(json.dumps(tok))


def _unsupported_type(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))


# (case, change to the spec, checkpoint edit, environment, what the error must say)
CASES = [
    ("K of the wrong type", {"num_speculative_tokens": "four"}, None, {},
     ["num_speculative_tokens", "valid integer", "K, draft tokens per round"]),
    ("K out of range", {"num_speculative_tokens": 0}, None, {},
     ["num_speculative_tokens", "greater than or equal to 1"]),
    ("C out of range", {"saguaro_c": 1.5}, None, {}, ["saguaro_c", "less than or equal to 1"]),
    ("nested value out of range", {"fanout": {"budget": 0}}, None, {},
     ["fanout.budget", "greater than or equal to 1"]),
    ("unknown choice", {"fanout": {"policy": "greedy"}}, None, {},
     ["fanout.policy", "'geometric', 'uniform' or 'probable'"]),
    ("unknown key (typo)", {"num_speculative_token": 3}, None, {},
     ["num_speculative_token: unknown key", "known keys:", "num_speculative_tokens"]),
    ("unknown nested key", {"controller": {"polcy": "auto"}}, None, {},
     ["controller.polcy: unknown key", "policy"]),
    ("half of a measured pair", {"controller": {"target_fixed_s": 0.02}}, None, {},
     ["target_fixed_s and target_per_token_s go together"]),
    ("timeout of the wrong sign", {"supervision": {"timeout_s": -1}}, None, {},
     ["supervision.timeout_s", "greater than 0"]),
    ("no draft_model", {"draft_model": None}, None, {}, ["draft_model"]),
    ("draft_model not a checkpoint", {"draft_model": "/nonexistent/draft"}, None, {},
     ["draft_model", "no config.json", "saved Llama/Qwen checkpoint"]),
    ("corrupt config.json", {}, _corrupt_config, {},
     ["draft_model", "config.json is not a usable", "save_pretrained"]),
    ("unsupported draft architecture", {}, _unsupported_type, {},
     ["draft_model", "'gpt2' is not supported"]),
    ("corrupt weights", {}, _corrupt_weights, {},
     ["draft_model", "model.safetensors is not a readable safetensors file", "save the checkpoint again"]),
    ("draft vocabulary of another size", {}, _other_vocab_size, {},
     ["draft_model", "vocabulary of", "target's tokenizer"]),
    ("draft with another tokenizer", {}, _other_tokenizer, {},
     ["draft_model", "another tokenizer", "target's tokenizer"]),
    ("a GPU that is not there", {"draft_device": "cuda:3"}, None, {},
     ["draft_device cuda:3", "draft_device: cpu"]),
    ("a core that does not exist", {"draft_cpu_cores": [4096]}, None, {},
     ["draft_cpu_cores [4096]", "not available to this process", "pick draft cores"]),
    ("the draft on the target's cores", {"draft_cpu_cores": ["last"]}, None,
     {"VLLM_CPU_OMP_THREADS_BIND": "all"}, ["draft_cpu_cores", "overlap the cores the target"]),
    ("every core given to the target", {}, None, {"VLLM_CPU_OMP_THREADS_BIND": "all"},
     ["VLLM_CPU_OMP_THREADS_BIND", "leaves none for the draft", "bind the target to fewer"]),
]


@pytest.mark.parametrize("case, change, edit, env, says", CASES, ids=[c[0] for c in CASES])
def test_bad_config_fails_fast_and_says_what_to_do(tiny_target, tiny_draft, tmp_path,
                                                   monkeypatch, case, change, edit, env, says):
    from vllm import LLM
    from vllm.platforms import current_platform

    cores = sorted(os.sched_getaffinity(0))
    if env or "draft_cpu_cores" in change:
        if not current_platform.is_cpu() or len(cores) < 2:
            pytest.skip("CPU placement cases need a CPU build and 2 cores")
        for k, v in env.items():
            monkeypatch.setenv(k, f"{cores[0]}-{cores[-1]}" if v == "all" else v)
        if change.get("draft_cpu_cores") == ["last"]:
            change = {"draft_cpu_cores": [cores[-1]]}
    draft = _copy(tiny_draft, tmp_path / "draft", edit) if edit else tiny_draft
    spec = {"method": "saguaro", "draft_model": str(draft), "num_speculative_tokens": 3}
    spec.update(change)
    spec = {k: v for k, v in spec.items() if v is not None}
    path = tmp_path / "saguaro.yaml"
    path.write_text(yaml.safe_dump(spec))
    t0 = time.perf_counter()
    with pytest.raises(SaguaroConfigError) as err:
        LLM(model=str(tiny_target), speculative_config=str(path), enforce_eager=True,
            max_model_len=256)
    assert time.perf_counter() - t0 < 30, "a bad config must fail within seconds"
    message = str(err.value)
    for text in says:
        assert text in message, f"{case}: {text!r} not in:\n{message}"
    assert "Traceback" not in message


RAY_SCRIPT = """
import sys
from vllm import LLM
try:
    LLM(model=sys.argv[1], speculative_config={"method": "saguaro", "draft_model": sys.argv[2],
        "num_speculative_tokens": 3, "draft_runtime": "ray"}, enforce_eager=True,
        max_model_len=256)
except Exception as err:
    print("ERROR:", err)
    sys.exit(3)
"""


def test_ray_unable_to_start_is_one_clear_error(tiny_target, tiny_draft):
    """draft_runtime 'ray' and RAY_ADDRESS naming a cluster that is not there (a user's
    stray setting): the engine refuses to start, at once, saying that Ray could not start
    and what to check. (The CPU default, a child process, does not use Ray. The address
    is a port nothing listens on, not 'auto': 'auto' joins any Ray cluster still up on
    the machine, such as one a Ray engine test left shutting down.)"""
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:9", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RAY_SCRIPT, str(tiny_target), str(tiny_draft)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.perf_counter() - t0 < 120
    line = next(l for l in proc.stdout.splitlines() if l.startswith("ERROR:"))
    assert "Ray could not start for the draft worker" in line and "RAY_ADDRESS" in line, line
