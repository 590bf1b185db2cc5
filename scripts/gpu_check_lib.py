"""Bookkeeping for scripts/gpu_check.sh (stdlib only: it must work when torch does not).

    gpu_check_lib.py init JSON                   start a fresh results file
    gpu_check_lib.py fig FIGS KEY VALUE          note a key figure of the running stage
    gpu_check_lib.py junit FIGS XML [--max-skipped N] [--require FILE:N ...]
                                                 pytest's counts (and failures) as figures;
                                                 exit 1 if the counts miss the expectations
    gpu_check_lib.py timing FIGS JSON            ops_timing's medians and agreement as figures
    gpu_check_lib.py worker-timing FIGS JSON     the worker timing's medians as figures
    gpu_check_lib.py record JSON FIGS NAME RC SECONDS [optional]
                                                 the stage's entry; FIGS is emptied
    gpu_check_lib.py summary JSON                print the table; exit 0 iff every required
                                                 stage passed
    gpu_check_lib.py wheels DIR                  the wheels of DIR to install here: all but
                                                 typing_extensions when this python's is as new
"""
from __future__ import annotations

import json
import os
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path


def _load(path: str, default):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def _dump(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def cmd_init(path: str) -> None:
    _dump(path, {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "finished": False,
                 "ok": None, "stages": []})


def cmd_fig(figs: str, key: str, value: str) -> None:
    d = _load(figs, {})
    d[key] = _value(value)
    _dump(figs, d)


def cmd_junit(figs: str, xml: str, *opts: str) -> int:
    d = _load(figs, {})
    max_skipped, require = None, []
    it = iter(opts)
    for o in it:
        if o == "--max-skipped":
            max_skipped = int(next(it))
        elif o == "--require":
            f, _, n = next(it).rpartition(":")
            require.append((f, int(n)))
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError) as e:
        d["junit"] = f"unreadable: {e}"
        _dump(figs, d)
        return 1
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failed, skipped, per_file = [], [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed"}.get(child.tag, child.tag)
                if child.tag == "skipped":
                    skipped.append(f"{name}: {(child.get('message') or '')[:120]}")
                else:
                    failed.append(name)
                break
        counts[kind] += 1
        if kind == "passed":
            f = case.get("classname", "").replace(".", "/")
            per_file[f] = per_file.get(f, 0) + 1
    d.update(counts)
    if failed:
        d["failures"] = failed[:30]
    if skipped:
        d["skips"] = skipped[:30]
    problems = []
    if max_skipped is not None and counts["skipped"] > max_skipped:
        problems.append(f"{counts['skipped']} skipped (at most {max_skipped} expected)")
    for f, n in require:
        got = sum(v for k, v in per_file.items() if f in k)
        if got < n:
            problems.append(f"{got} passed in {f} ({n} expected)")
    if problems:
        d["expectations"] = problems
    _dump(figs, d)
    return 1 if problems or failed or counts["error"] else 0


def cmd_timing(figs: str, path: str) -> int:
    d = _load(figs, {})
    t = _load(path, None)
    if not t:
        d["timing"] = "no results"
        _dump(figs, d)
        return 1
    ms, differ = {}, []
    for e in t.get("results", []):
        ms[f"{e['op']} r{e['rows']} v{e['vocab']}"] = e["ms"]
        differ += [f"{e['op']} r{e['rows']} v{e['vocab']} {b}"
                   for b, ok in e.get("agree", {}).items() if not ok]
    d.update(device=t.get("device_name", t.get("device")), ms=ms, skipped_backends=t.get("skipped"))
    if t.get("results"):  # the largest shape, every op: ms by backend
        big = max(t["results"], key=lambda e: (e["rows"] * e["vocab"]))
        d["headline"] = {f"{e['op']} r{e['rows']} v{e['vocab']}": e["ms"] for e in t["results"]
                         if (e["rows"], e["vocab"]) == (big["rows"], big["vocab"])}
    if differ:
        d["differ_from_reference"] = differ
    _dump(figs, d)
    return 1 if differ else 0


def cmd_worker_timing(figs: str, path: str) -> int:
    d = _load(figs, {})
    t = _load(path, None)
    if not t:
        d["worker_timing"] = "no results"
        _dump(figs, d)
        return 1
    d["ms"] = {f"{r['device']} {r['dtype']} b{r['batch']}":
               {"prespec": r["prespec_ms"], "fallback": r["fallback_ms"]} for r in t["rows"]}
    b = max((r["batch"] for r in t["rows"]), default=None)
    d["headline"] = {k: v for k, v in d["ms"].items() if k.endswith(f" b{b}")}
    _dump(figs, d)
    return 0


def cmd_record(path: str, figs: str, name: str, rc: str, seconds: str,
               optional: str = "") -> None:
    res = _load(path, {"stages": []})
    rc_v = _value(rc)
    res["stages"] = [s for s in res["stages"] if s["name"] != name]
    res["stages"].append({"name": name, "rc": rc_v, "ok": rc_v == 0,
                          "optional": optional == "optional", "seconds": float(seconds),
                          "figures": _load(figs, {})})
    _dump(path, res)
    _dump(figs, {})


def cmd_summary(path: str) -> int:
    res = _load(path, {"stages": []})
    ok = all(s["ok"] or s["optional"] for s in res["stages"]) and bool(res["stages"])
    res["ok"], res["finished"] = ok, True
    res["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    _dump(path, res)
    print(f"\n{'stage':28s} {'status':9s} {'rc':>8s} {'seconds':>8s}  figures")
    for s in res["stages"]:
        status = "ok" if s["ok"] else ("skipped" if s["rc"] == "skipped" else "FAILED")
        if s["optional"] and not s["ok"]:
            status += "*"
        f = s["figures"]
        keys = ("cuda_available", "device", "torch", "triton", "pydantic", "nvcc", "build_s",
                "available", "passed", "failed", "error", "skipped", "expectations",
                "failures", "headline", "differ_from_reference", "timing", "worker_timing",
                "note")
        short = {k: f[k] for k in keys if k in f}
        print(f"{s['name']:28s} {status:9s} {str(s['rc']):>8s} {s['seconds']:8.1f}  "
              f"{json.dumps(short)[:300]}")
    print(f"\ngpu_check: {'ALL STAGES PASSED' if ok else 'FAILED'} "
          f"(* optional; results {path})")
    return 0 if ok else 1


def _version_tuple(v: str) -> tuple:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def cmd_wheels(directory: str) -> None:
    """Print the wheels to install: typing_extensions only if this python lacks it or has
    an older one (the image has it; pydantic needs a recent one)."""
    import importlib.metadata as md

    for whl in sorted(Path(directory).glob("*.whl")):
        dist, version = whl.name.split("-")[:2]
        if dist.lower() == "typing_extensions":
            try:
                have = md.version("typing_extensions")
            except md.PackageNotFoundError:
                have = None
            if have is not None and _version_tuple(have) >= _version_tuple(version):
                print(f"gpu_check: keeping the image's typing_extensions {have} "
                      f"(wheel {version})", file=sys.stderr)
                continue
        with zipfile.ZipFile(whl):  # a truncated carry fails here, by name
            pass
        print(whl)


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    fn = {"init": cmd_init, "fig": cmd_fig, "junit": cmd_junit, "timing": cmd_timing,
          "worker-timing": cmd_worker_timing, "record": cmd_record, "summary": cmd_summary,
          "wheels": cmd_wheels}[cmd]
    rc = fn(*args)
    return rc or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
