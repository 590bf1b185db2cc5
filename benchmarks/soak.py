"""The OpenAI server with SSD under load (issue 20, requirement 3).

Many concurrent clients, chat and completions, streaming or not, mixed lengths and
sampling settings; some clients disconnect mid-stream, some give up on a request (the
server aborts it). Afterwards: no errors, every greedy completion identical to plain
decoding's, the draft worker holds no sequence and no KV block (nothing leaked after the
aborts), and /metrics adds up.

    python -m benchmarks.soak --minutes 5 --clients 32          # the reference pair
    python -m benchmarks.soak --minutes 1 --tiny                 # tiny random models

The suite runs a short one on the tiny pair (tests/e2e/test_soak.py). Writes soak.json
(with the server's log beside it) to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import yaml

from vllm_saguaro.vllm_glue.vllm_logs import (engine_failures_explained, send_engine_stderr_to,
                                              send_vllm_logs_to)

MODEL_NAME = "soak"


@dataclass
class Job:
    """One request a client makes, and what it does with the answer."""

    chat: bool
    text: str                     # the prompt, or the user message for chat
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    disconnect_after: int | None = None  # streaming: close the connection after n chunks
    give_up_s: float | None = None       # not streaming: client timeout (the server aborts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def key(self) -> tuple:
        return (self.chat, self.text, self.max_tokens)

    def body(self) -> dict:
        b = {"model": MODEL_NAME, "max_tokens": self.max_tokens, "temperature": self.temperature,
             "top_p": self.top_p, "stream": self.stream}
        if self.seed is not None:
            b["seed"] = self.seed
        if self.chat:
            b["messages"] = [{"role": "user", "content": self.text}]
        else:
            b["prompt"] = self.text
        return b


def make_jobs(completions: list[str], chats: list[str], n: int, seed: int = 0,
              max_tokens: int = 96) -> list[Job]:
    """n jobs, mixed: half greedy (checked against plain decoding), a tenth disconnecting
    mid-stream, a tenth given up on, lengths 1..max_tokens, streaming or not."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        chat = rng.random() < 0.5 and bool(chats)
        text = rng.choice(chats if chat else completions)
        job = Job(chat=chat, text=text, max_tokens=rng.choice([1, 2, 8, 16, 32, max_tokens]),
                  stream=rng.random() < 0.6)
        r = rng.random()
        if r < 0.5:
            pass  # greedy
        elif r < 0.8:
            job.temperature, job.top_p = rng.choice([0.7, 1.0]), rng.choice([0.9, 1.0])
            job.seed = rng.randrange(1 << 20) if rng.random() < 0.5 else None
        elif r < 0.9:
            job.stream, job.disconnect_after = True, rng.randrange(1, 6)
            job.max_tokens = max_tokens
        else:
            job.stream, job.give_up_s = False, rng.choice([0.05, 0.2, 0.5])
            job.max_tokens = max_tokens
        jobs.append(job)
    return jobs


def plain_reference(target: str, jobs: list[Job], **engine_kw) -> dict[tuple, str]:
    """Plain decoding's text for every greedy job (offline engine, no speculation)."""
    from vllm import LLM, SamplingParams

    from vllm_saguaro.vllm_glue.offline import shutdown

    greedy = {j.key: j for j in jobs if j.greedy}
    llm = LLM(model=target, **engine_kw)
    out = {}
    comp = [j for j in greedy.values() if not j.chat]
    chat = [j for j in greedy.values() if j.chat]
    if comp:
        res = llm.generate([j.text for j in comp],
                           [SamplingParams(temperature=0, max_tokens=j.max_tokens) for j in comp],
                           use_tqdm=False)
        out.update({j.key: r.outputs[0].text for j, r in zip(comp, res)})
    if chat:
        res = llm.chat([[{"role": "user", "content": j.text}] for j in chat],
                       [SamplingParams(temperature=0, max_tokens=j.max_tokens) for j in chat],
                       use_tqdm=False)
        out.update({j.key: r.outputs[0].text for j, r in zip(chat, res)})
    shutdown(llm)
    return out


@dataclass
class Tally:
    ok: int = 0
    greedy_checked: int = 0
    disconnected: int = 0
    given_up: int = 0
    errors: list[str] = field(default_factory=list)
    diffs: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str, detail=None) -> None:
        with self.lock:
            if what == "error":
                self.errors.append(detail)
            elif what == "diff":
                self.diffs.append(detail)
            else:
                setattr(self, what, getattr(self, what) + 1)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "lock"}


def _text_of(choice: dict, chat: bool, delta: bool) -> str:
    if chat:
        part = choice.get("delta" if delta else "message") or {}
        return part.get("content") or ""
    return choice.get("text") or ""


def run_job(url: str, job: Job, reference: dict, tally: Tally) -> None:
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    try:
        if not job.stream:
            try:
                r = requests.post(url + path, json=job.body(), timeout=job.give_up_s or 600)
            except requests.exceptions.ReadTimeout:
                if job.give_up_s is None:
                    raise
                tally.add("given_up")
                return
            if r.status_code != 200:
                tally.add("error", f"HTTP {r.status_code}: {r.text[:200]}")
                return
            text = _text_of(r.json()["choices"][0], job.chat, delta=False)
        else:
            parts = []
            with requests.post(url + path, json=job.body(), timeout=600, stream=True) as r:
                if r.status_code != 200:
                    tally.add("error", f"HTTP {r.status_code}: {r.text[:200]}")
                    return
                for line in r.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        tally.add("error", f"stream error: {event['error']}")
                        return
                    if event["choices"]:
                        parts.append(_text_of(event["choices"][0], job.chat, delta=True))
                    if job.disconnect_after is not None and len(parts) >= job.disconnect_after:
                        tally.add("disconnected")
                        return  # leaving the with-block closes the connection mid-stream
            text = "".join(parts)
    except Exception as err:  # noqa: BLE001 - every failure is a finding, counted
        tally.add("error", f"{type(err).__name__}: {err}"[:300])
        return
    tally.add("ok")
    if job.greedy and job.key in reference:
        tally.add("greedy_checked")
        if text != reference[job.key]:
            tally.add("diff", {"job": job.body(), "got": text, "want": reference[job.key]})


def run_clients(url: str, jobs: list[Job], reference: dict, clients: int, seconds: float,
                progress: bool = False) -> Tally:
    """`clients` threads, each taking jobs in its own random order until time is up."""
    tally = Tally()
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(1000 + i)
        while time.monotonic() < deadline:
            run_job(url, rng.choice(jobs), reference, tally)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    last_print = time.monotonic()
    while any(t.is_alive() for t in threads):
        # After the deadline the clients finish the requests in flight: poll each second,
        # print every 10 s (was: a line every 0.1 s, hundreds of them).
        left = deadline - time.monotonic()
        time.sleep(min(10.0, left) if left > 0.1 else 1.0)
        if progress and (time.monotonic() - last_print >= 9.9 or not any(t.is_alive() for t in threads)):
            last_print = time.monotonic()
            left = max(0, deadline - last_print)
            busy = sum(t.is_alive() for t in threads)
            print(f"  {left:5.0f} s left: {tally.ok} ok, {tally.greedy_checked} greedy checked, "
                  f"{tally.disconnected} disconnected, {tally.given_up} given up, "
                  f"{len(tally.errors)} errors, {len(tally.diffs)} diffs"
                  + (f", {busy} clients finishing" if left == 0 and busy else ""), flush=True)
        if time.monotonic() > deadline + 900:
            tally.add("error", "clients still busy 15 minutes after the end: a hang")
            break
    return tally


def metrics(url: str) -> dict[str, float]:
    """/metrics as name -> value, summed over labels."""
    out: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        name = name.split("{")[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def settle(url: str, timeout_s: float = 120.0) -> dict[str, float]:
    """Wait until no request runs or waits and the draft worker has reported what it holds
    after the batch emptied; returns /metrics then."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        idle = m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
        if idle and m.get("vllm:saguaro_draft_sequences", 1) == 0 or time.monotonic() > deadline:
            return m
        time.sleep(1)


def check_metrics(m: dict[str, float], tally: Tally) -> list[str]:
    """What /metrics must satisfy after a run; the problems found."""
    problems = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    need(m.get("vllm:num_requests_running", -1) == 0, "requests still running")
    need(m.get("vllm:saguaro_draft_sequences", -1) == 0,
         f"the draft worker still holds {m.get('vllm:saguaro_draft_sequences')} sequences")
    need(m.get("vllm:saguaro_draft_kv_blocks_used", -1) == 0,
         f"the draft worker still holds {m.get('vllm:saguaro_draft_kv_blocks_used')} KV blocks")
    need(m.get("vllm:saguaro_cache_hits_total", 0) <= m.get("vllm:saguaro_cache_lookups_total", 0),
         "cache hits > lookups")
    need(m.get("vllm:spec_decode_num_accepted_tokens_total", 0)
         <= m.get("vllm:spec_decode_num_draft_tokens_total", 0), "accepted > drafted tokens")
    need(m.get("vllm:saguaro_speculation_length_total", 0) >= m.get("vllm:saguaro_rounds_total", 0),
         "fewer sequence-rounds than rounds")
    need(m.get("vllm:request_success_total", 0) >= tally.ok,
         f"vllm:request_success_total {m.get('vllm:request_success_total')} < {tally.ok} completed")
    need(m.get("vllm:saguaro_draft_failures_total", 0) == 0, "the draft worker failed")
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(target: str, spec: dict, workdir: Path, extra: list[str] = (), env: dict | None = None,
          startup_s: float = 300, name: str = MODEL_NAME):
    """`vllm-saguaro serve TARGET --speculative-config <spec>` as a user starts it (its own
    process group, engine in its own process); yields (url, process); always stopped."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "saguaro.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    port = free_port()
    log = open(workdir / "server.log", "w")
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled", **(env or {}))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)  # the server's whole log goes to server.log
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm-saguaro"), "serve", target,
           "--speculative-config", str(spec_path), "--port", str(port), "--host", "127.0.0.1",
           "--served-model-name", name, *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError("server exited:\n" + (workdir / "server.log").read_text()[-4000:])
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not healthy in {startup_s:.0f} s")
            time.sleep(1)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def draft_worker_rss_mb(server_pid: int) -> float | None:
    """Resident memory of the server's draft worker process, MB (None if not found)."""
    import psutil

    from vllm_saguaro.draft.process_actor import is_draft_worker

    for p in psutil.process_iter(["cmdline", "pid"]):
        try:
            if is_draft_worker(" ".join(p.info["cmdline"] or [])) and os.getsid(p.pid) == os.getsid(server_pid):
                return p.memory_info().rss / 2**20
        except (psutil.Error, ProcessLookupError):
            continue
    return None


def soak(url: str, proc, jobs: list[Job], reference: dict, clients: int, seconds: float,
         progress: bool = False) -> dict:
    """Warm up, run the clients, settle, check; the report."""
    for job in jobs[:4]:  # warm-up: compiled paths, the draft's first rounds
        run_job(url, Job(chat=job.chat, text=job.text, max_tokens=4), {}, Tally())
    rss_before = draft_worker_rss_mb(proc.pid)
    t0 = time.monotonic()
    tally = run_clients(url, jobs, reference, clients, seconds, progress)
    wall = time.monotonic() - t0
    m = settle(url)
    rss_after = draft_worker_rss_mb(proc.pid)
    problems = check_metrics(m, tally)
    return {"clients": clients, "seconds": round(wall, 1), **tally.as_dict(),
            "problems": problems, "draft_rss_mb": [rss_before, rss_after],
            "metrics": {k: v for k, v in m.items() if "saguaro" in k or "spec_decode" in k
                        or k.startswith("vllm:request_success")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="how long the clients run")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients")
    ap.add_argument("--jobs", type=int, default=200, help="distinct requests the clients draw from")
    ap.add_argument("--tiny", action="store_true", help="tiny random models instead of the reference pair")
    ap.add_argument("--speculate-always", action="store_true",
                    help="controller.policy fixed: K tokens every round (the default controller "
                         "leaves the draft idle at large batches, where speculation cannot pay)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the server's log is in --out
    if args.tiny:
        from tests.tiny_models import make_tiny_llama

        target = str(make_tiny_llama(args.out / "models" / "target"))
        draft = str(make_tiny_llama(args.out / "models" / "draft", base=target, noise=0.3, seed=1))
        words = [f"w{i}" for i in range(10, 500)]
        rng = random.Random(0)
        completions = [" ".join(rng.choices(words, k=rng.randrange(2, 40))) for _ in range(40)]
        chats = [" ".join(rng.choices(words, k=rng.randrange(2, 20))) for _ in range(40)]
        spec = {"method": "saguaro", "draft_model": draft, "num_speculative_tokens": 3,
                "draft_dtype": "float32", "log_stats_interval_s": 10}
        max_len, max_tokens = 512, 96
    else:
        from benchmarks.prompts import humaneval_prompts, mt_bench_questions
        from benchmarks.reference_pair import HEAD_TOKENS, build_reference_pair

        target, draft = build_reference_pair()
        completions, chats = humaneval_prompts()[:40], mt_bench_questions()[:40]
        spec = {"method": "saguaro", "draft_model": str(draft), "draft_head_tokens": HEAD_TOKENS,
                "num_speculative_tokens": 3, "log_stats_interval_s": 30}
        max_len, max_tokens = 2048, 128
    if args.speculate_always:
        spec["controller"] = {"policy": "fixed"}
    jobs = make_jobs(completions, chats, args.jobs, max_tokens=max_tokens)
    reference_log = str(args.out / "reference.log")
    send_vllm_logs_to(reference_log)
    send_engine_stderr_to(reference_log)
    print(f"plain decoding's answers for {sum(j.greedy for j in jobs)} greedy jobs "
          f"(vLLM's log: {reference_log}) ...", flush=True)
    with engine_failures_explained(reference_log, "benchmarks.soak"):
        reference = plain_reference(str(target), jobs, max_model_len=max_len,
                                    enforce_eager=True, seed=0, dtype="float32",
                                    use_tqdm_on_load=False)
    print(f"server with SSD; {args.clients} clients for {args.minutes} min ...", flush=True)
    with serve(str(target), spec, args.out, ["--max-model-len", str(max_len), "--enforce-eager",
                                              "--seed", "0", "--dtype", "float32"]) as (url, proc):
        report = soak(url, proc, jobs, reference, args.clients, args.minutes * 60, progress=True)
    report["command"] = " ".join(sys.argv)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    bad = report["errors"] or report["diffs"] or report["problems"]
    print(f"{report['ok']} requests ok ({report['greedy_checked']} greedy checked against plain "
          f"decoding), {report['disconnected']} disconnected, {report['given_up']} given up, "
          f"{len(report['errors'])} errors, {len(report['diffs'])} diffs, problems: "
          f"{report['problems'] or 'none'}; draft worker RSS "
          f"{' -> '.join('?' if mb is None else f'{mb:.0f}' for mb in report['draft_rss_mb'])} MB. "
          f"Report: {args.out / 'soak.json'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
