from benchmarks.plan_cost import load, per_step_ms


def test_plan_cost_times_this_controller_and_another_file(tmp_path):
    """The --against file loads as a module of its own (its dataclasses included) and
    both are timed on the same candidates."""
    import inspect

    from vllm_saguaro.core import controller

    copy = tmp_path / "controller.py"
    copy.write_text(inspect.getsource(controller))
    other = load(str(copy))
    assert other is not controller and other.Candidate is not controller.Candidate
    for mod in (controller, other):
        assert per_step_ms(mod, [3, 0, None, 1]) > 0.0
