import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip, with the reason, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here; scripts/gpu_check.sh runs these)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _restore_cpu_affinity():
    """Give each test module the process's CPU set back after it ran.

    In-process engines bind the pytest process to the target's core(s) (vLLM's CPU worker,
    and the plugin keeping the target off the draft's core). Without this, a later module's
    subprocess inherits one core: the benchmark then refuses to run ("needs 2 cores").
    """
    cores = os.sched_getaffinity(0)
    yield
    if os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from tests.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "target")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tiny_target):
    """A perturbed copy of the target: agrees often, not always (hits and misses both occur)."""
    from tests.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "draft", base=tiny_target,
                           noise=0.3, seed=1)
