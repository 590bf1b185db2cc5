"""`vllm-saguaro serve TARGET --speculative-config saguaro.yaml`: the OpenAI endpoints with SSD.

The server runs as a user would start it (subprocess, own engine process); the test talks
HTTP on loopback only and always stops the server.
"""
import json
import os
import signal
import subprocess
import time

import pytest
import requests

from benchmarks.soak import serve
from tests.e2e.conftest import make_llm, release
from vllm_saguaro.draft.process_actor import is_draft_worker


@pytest.fixture(scope="module")
def server(tiny_target, spec_base, tmp_path_factory):
    d = tmp_path_factory.mktemp("server")
    with serve(str(tiny_target), dict(spec_base, log_stats_interval_s=1), d,
               ["--enforce-eager", "--max-model-len", "512", "--seed", "0"],
               env={"VLLM_CPU_KVCACHE_SPACE": "1"}, startup_s=240, name="tiny") as (url, proc):
        yield url, proc, d / "server.log"


PROMPT = "w10 w11 w12 w13 w14"


def test_completions_greedy_identical_to_plain(server, tiny_target):
    url, _, _ = server
    r = requests.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    from vllm import SamplingParams

    llm = make_llm(tiny_target)
    ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    release(llm)
    assert text == ref[0].outputs[0].text


def test_chat_and_streaming(server):
    url, _, _ = server
    r = requests.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "w20 w21"}],
        "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    chat_text = r.json()["choices"][0]["message"]["content"]
    assert chat_text
    chunks = []
    with requests.post(url + "/v1/chat/completions", timeout=120, stream=True, json={
            "model": "tiny", "messages": [{"role": "user", "content": "w20 w21"}],
            "max_tokens": 12, "temperature": 0, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                chunks.append(delta.get("content") or "")
    assert len(chunks) > 2 and "".join(chunks) == chat_text
    r = requests.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_metrics_page_has_ssd_figures(server):
    url, _, _ = server
    requests.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
    page = requests.get(url + "/metrics", timeout=30).text
    values = {}
    for line in page.splitlines():
        if line.startswith("vllm:") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0) + float(value)
    assert values.get("vllm:spec_decode_num_drafts_total", 0) > 0
    assert values.get("vllm:saguaro_cache_lookups_total", 0) > 0
    assert "vllm:saguaro_cache_hits_total" in values


def _session_processes(sid: int) -> dict[int, str]:
    out = subprocess.run(["ps", "ww", "-s", str(sid), "-o", "pid=,args="], capture_output=True,
                         text=True).stdout
    return {int(line.split(None, 1)[0]): line.split(None, 1)[1] for line in out.splitlines()
            if line.strip()}


def test_server_threads_target_and_draft_on_their_own_cores(server):
    """The server's target worker computes on the target's core (bound by vLLM), every
    thread of the draft worker is on the draft's, and both did work."""
    from vllm_saguaro.core.placement import process_threads

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("SSD on CPU needs 2 cores")
    url, proc, _ = server
    procs = _session_processes(proc.pid)
    worker = [p for p, a in procs.items() if "Worker" in a and not is_draft_worker(a)]
    draft = [p for p, a in procs.items() if is_draft_worker(a)]
    assert len(worker) == 1 and len(draft) == 1, procs
    before = {p: sum(t.cpu_s for t in process_threads(p)) for p in worker + draft}
    r = requests.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    target, draft_cores = {cores[0]}, {cores[-1]}
    threads = process_threads(draft[0])
    off = [t for t in threads if not set(t.cores) <= draft_cores]
    assert not off, f"draft worker threads off core {sorted(draft_cores)}: {off}"
    assert sum(t.cpu_s for t in threads) > before[draft[0]], "the draft worker did no work"
    threads = process_threads(worker[0])
    # the target's own threads on its core (with draft_runtime ray, Ray's client threads
    # there sit on the draft's)
    roaming = [t for t in threads if not (set(t.cores) <= target or set(t.cores) <= draft_cores)]
    assert not roaming, f"target worker threads free to use both sides: {roaming}"
    main = next(t for t in threads if t.tid == worker[0])
    busiest = max(threads, key=lambda t: t.cpu_s)
    assert set(main.cores) <= target and set(busiest.cores) <= target, (main, busiest)
    assert sum(t.cpu_s for t in threads) > before[worker[0]], "the target worker did no work"


def _metric(url, name) -> float:
    page = requests.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_server_survives_the_draft_process_killed_mid_stream(server, tiny_target):
    """SIGKILL of the draft worker's process while a request streams: that request and
    the ones after it complete with plain decoding's text, the failure is counted on
    /metrics, and a new draft worker takes over."""
    url, proc, _ = server
    draft = [p for p, a in _session_processes(proc.pid).items() if is_draft_worker(a)]
    assert len(draft) == 1
    failures = _metric(url, "vllm:saguaro_draft_failures_total")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks, after_kill = [], 0
    with requests.post(url + "/v1/completions", timeout=300, stream=True, json=body) as s:
        for line in s.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunks.append(json.loads(line[6:])["choices"][0]["text"])
            if len(chunks) == 5:
                os.kill(draft[0], signal.SIGKILL)
            elif len(chunks) > 5:
                after_kill += 1
    assert after_kill > 0, "the request had finished before the kill"
    from vllm import SamplingParams

    llm = make_llm(tiny_target)
    ref = llm.generate([PROMPT, "w30 w31"], SamplingParams(temperature=0, max_tokens=300,
                                                           ignore_eos=True))
    release(llm)
    assert "".join(chunks) == ref[0].outputs[0].text
    assert _metric(url, "vllm:saguaro_draft_failures_total") == failures + 1
    deadline = time.time() + 90
    while _metric(url, "vllm:saguaro_draft_restarts_total") < 1:  # the restart: 5 s on
        assert time.time() < deadline, "no new draft worker within 90 s"
        requests.post(url + "/v1/completions", timeout=120, json={   # rounds move it along
            "model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        time.sleep(1)
    drafts = _metric(url, "vllm:spec_decode_num_drafts_total")
    r = requests.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "w30 w31", "max_tokens": 300, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref[1].outputs[0].text
    assert _metric(url, "vllm:spec_decode_num_drafts_total") > drafts, "speculation did not resume"
    alive = [p for p, a in _session_processes(proc.pid).items() if is_draft_worker(a)]
    assert len(alive) == 1 and alive != draft


def test_server_stops_cleanly(server):
    """Ctrl-C (SIGINT to the process group): the server exits and takes the draft worker
    with it. vLLM's own abort-mode shutdown may log an EngineDeadError traceback (a race
    inside vLLM); no error may come from the plugin."""
    _, proc, log = server
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) is not None
    text = log.read_text()
    assert "vllm_saguaro" not in "".join(
        line for line in text.splitlines(keepends=True) if "File " in line or "Error" in line)
    time.sleep(2)
    alive = [p for p, a in _session_processes(proc.pid).items() if is_draft_worker(a)]
    assert not alive, f"draft worker processes left behind: {alive}"
