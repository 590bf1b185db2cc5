import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
