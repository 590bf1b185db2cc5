"""vllm_logs.py: an engine's failure, whose cause went to the log file with the engines'
stderr, brought back to the terminal."""
import pytest

from vllm_saguaro.vllm_glue.vllm_logs import engine_failures_explained, failure_causes

WORKER_TRACEBACK = """\
2026-12-07 15:35:29,600 25035 INFO vllm.v1.worker: something
Traceback (most recent call last):
  File "/x/vllm/v1/worker/cpu_worker.py", line 80, in determine_available_memory
    raise ValueError(
ValueError: Available memory on node 0 is less than requested memory for kv (500.0 GiB).
2026-12-07 15:35:29,647 25035 ERROR vllm.v1.executor: Worker proc VllmWorker-0 died
Traceback (most recent call last):
    raise RuntimeError(
RuntimeError: Worker failed with error 'Available memory ...'
Traceback (most recent call last):
    raise RuntimeError(
RuntimeError: Worker failed with error 'Available memory ...'
"""


def test_failure_causes_are_the_tracebacks_last_lines_distinct_in_order():
    assert failure_causes(WORKER_TRACEBACK) == [
        "ValueError: Available memory on node 0 is less than requested memory for kv "
        "(500.0 GiB).",
        "RuntimeError: Worker failed with error 'Available memory ...'"]
    # indented code and vLLM's logger lines are no cause; at most `most`, the latest
    assert failure_causes("    raise ValueError(x)\n2026 INFO ValueError: no\n") == []
    assert failure_causes("KeyError: 'a'\nOSError: b\nnumpy.linalg.LinAlgError: c\n",
                          most=2) == ["OSError: b", "numpy.linalg.LinAlgError: c"]


def test_an_engine_failure_ends_the_tool_with_the_logs_cause(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("OldError: from an earlier run of the tool\n")
    with pytest.raises(SystemExit) as ended:
        with engine_failures_explained(str(log), "tool"):
            with open(log, "a") as f:
                f.write(WORKER_TRACEBACK)
            raise RuntimeError("Engine core initialization failed. See root cause above. "
                               "Failed core proc(s): {}")
    said = str(ended.value.code)
    assert said.startswith("tool: RuntimeError: Engine core initialization failed. Failed")
    assert "requested memory for kv (500.0 GiB)" in said and str(log) in said
    assert "OldError" not in said and "See root cause above" not in said
    # the tool's own traceback is kept, in the log
    assert log.read_text().endswith("RuntimeError: Engine core initialization failed. See "
                                    "root cause above. Failed core proc(s): {}\n")


def test_a_failure_the_log_does_not_explain_passes_as_it_is(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("ValueError: before the block\n")
    with pytest.raises(KeyError):
        with engine_failures_explained(str(log), "tool"):
            with open(log, "a") as f:
                f.write("2026 INFO vllm: nothing wrong\n")
            raise KeyError("the tool's own bug")
    with pytest.raises(KeyError):  # no log file at all
        with engine_failures_explained(str(tmp_path / "none.log"), "tool"):
            raise KeyError("x")
