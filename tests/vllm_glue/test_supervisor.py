import logging

import pytest

from vllm_saguaro.core.supervision import RestartPolicy
from vllm_saguaro.vllm_glue.supervisor import DraftSupervisor, DraftUnavailable


class _Runtime:
    """Its calls raise what the worker's process sends back (process_actor._failure):
    the error's first line, then where it was raised."""

    def get(self, ref, timeout):
        raise RuntimeError("ZeroDivisionError in step: float division by zero\n"
                           '  File "theory.py", line 75, in ssd_rate')

    def kill(self, actor):
        pass


def test_a_failed_call_logs_one_line_and_where_it_was_raised(caplog):
    """The warning says what failed in one line; where the worker raised it goes to the
    log too (without it a failure in the worker's process cannot be traced)."""
    sup = DraftSupervisor(lambda incarnation: object(), _Runtime(), RestartPolicy())
    with caplog.at_level(logging.INFO, logger="vllm_saguaro"), pytest.raises(DraftUnavailable):
        sup.get(None, "step")
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "division by zero" in warning[0] and "theory.py" not in warning[0]
    assert any("theory.py\", line 75" in r.getMessage() for r in caplog.records)
    assert not sup.up
