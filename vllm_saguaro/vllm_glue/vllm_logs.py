"""vLLM's log lines into a file: for the tools that start engines (`vllm-saguaro tune`,
the benchmarks), whose own few lines of progress must not drown in vLLM's; and, when an
engine fails, its cause brought back from that file to the terminal."""

import json
import os
import re
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path


def send_vllm_logs_to(path: str) -> None:
    """vLLM's log lines go to `path` (appended), in this process and in every engine
    process started after this (they configure vLLM's logging from
    VLLM_LOGGING_CONFIG_PATH); progress bars are off (TQDM_DISABLE). Without this each
    engine start prints some 60 lines of vLLM's, and a tool's own lines (tune's, the
    soak's) are lost among them."""
    import atexit
    import logging.config
    import tempfile

    handler = {"class": "logging.FileHandler", "filename": os.path.abspath(path),
               "formatter": "plain", "mode": "a"}
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"plain": {"format": "%(asctime)s %(process)d %(levelname)s "
                                                 "%(name)s: %(message)s"}},
              "handlers": {"file": handler},
              "loggers": {name: {"handlers": ["file"], "level": "INFO", "propagate": False}
                          for name in ("vllm", "vllm_saguaro")}}
    fd, config_path = tempfile.mkstemp(prefix="vllm-saguaro-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    atexit.register(Path(config_path).unlink, missing_ok=True)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = config_path
    os.environ["TQDM_DISABLE"] = "1"
    logging.config.dictConfig(config)  # this process's vLLM loggers, if already set up


def send_engine_stderr_to(path: str) -> None:
    """What the engine processes started after this write to stderr goes to `path`
    (appended): a process inherits its stderr, and not all of it is vLLM's logger. Seen
    in tune's terminal with send_vllm_logs_to alone, at every engine start: what vLLM's
    modules log as an engine process imports them, before it configures logging
    ("Triton is installed, but doesn't include CPU backend"), Python's FutureWarnings,
    and torch's C++ NUMA warning. This process's own errors and warnings still reach
    the terminal (sys.stderr stays there)."""
    sys.stderr.flush()
    terminal = os.dup(2)
    fd = os.open(os.path.abspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1)


# A traceback's last line, unindented: "RuntimeError: Worker failed with error '...'".
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)(: |$)")


def failure_causes(text: str, most: int = 3) -> list[str]:
    """The exceptions named in a log's text (each traceback's last line), the last
    `most` distinct ones, oldest first: an engine's worker and its core process both
    log the same root cause, each with its traceback."""
    causes: list[str] = []
    for line in text.splitlines():
        if _EXCEPTION_LINE.match(line):
            if line in causes:
                causes.remove(line)
            causes.append(line)
    return causes[-most:]


@contextmanager
def engine_failures_explained(path: str, tool: str):
    """An exception out of the block that the log at `path` (where send_engine_stderr_to
    sent the engines' stderr) explains ends the tool with those causes on the terminal
    and the tool's own traceback appended to the log. Without it the terminal showed
    vLLM's "Engine core initialization failed. See root cause above", the cause being
    in the log file (measured: tune with VLLM_CPU_KVCACHE_SPACE=500, the cause a
    RuntimeError naming the memory asked for and the memory there). An exception the
    log does not explain (none of its lines since the block began names one) passes."""
    try:
        since = os.path.getsize(path)
    except OSError:
        since = 0
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised below unless the log explains it
        try:
            with open(path, "rb") as f:  # (a byte offset: text files seek by cookies)
                f.seek(since)
                causes = failure_causes(f.read().decode(errors="replace"))
        except OSError:
            causes = []
        if not causes:
            raise
        with open(path, "a") as f:
            f.write(f"{tool}: ended by\n{traceback.format_exc()}")
        lines = "\n  ".join(c if len(c) <= 600 else c[:600] + " ..." for c in causes)
        said = str(err).replace("See root cause above. ", "")[:300]  # (it is below)
        raise SystemExit(f"{tool}: {type(err).__name__}: {said}\n"
                         f"the engine's error, from {path} (where this traceback is "
                         f"appended):\n  {lines}") from None
