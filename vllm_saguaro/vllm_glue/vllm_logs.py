"""vLLM's log lines into a file: for the tools that start engines (`vllm-saguaro tune`,
`benchmarks.soak`), whose own few lines of progress must not drown in vLLM's."""

import json
import os
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
    import sys

    sys.stderr.flush()
    terminal = os.dup(2)
    fd = os.open(os.path.abspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1)
