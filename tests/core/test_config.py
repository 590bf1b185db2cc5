import pytest
import yaml

from vllm_saguaro.config import SaguaroConfigError, is_saguaro_spec, load_config


@pytest.fixture
def draft(tmp_path):
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_defaults_and_alias(draft):
    cfg = load_config({"method": "saguaro", "draft_model": str(draft), "async": False})
    assert cfg.async_ is False and cfg.num_speculative_tokens == 4
    assert cfg.fanout.policy == "probable" and cfg.fanout.fit_to_round and cfg.saguaro_c == 0.5
    assert cfg.draft_weights == "auto"
    assert cfg.to_json_dict()["async"] is False


def test_yaml_path(tmp_path, draft):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"method": "saguaro", "draft_model": str(draft),
                                 "num_speculative_tokens": 6,
                                 "fanout": {"policy": "uniform", "width": 3}}))
    assert is_saguaro_spec(str(p))
    cfg = load_config(str(p))
    assert cfg.num_speculative_tokens == 6 and cfg.fanout.width == 3


@pytest.mark.parametrize("bad, field", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"saguaro_c": 1.5}, "saguaro_c"),
    ({"saguaro_c": -0.1}, "saguaro_c"),
    ({"draft_modle": "x"}, "draft_modle: unknown key"),
    ({"fanout": {"policy": "geometric", "bugdet": 3}}, "fanout.bugdet: unknown key"),
    ({"draft_device": "gpu1"}, "draft_device"),
    ({"draft_device": "cuda:1", "draft_cpu_cores": [1]}, "draft_cpu_cores applies only"),
    ({"draft_device": "cuda:1", "draft_weights": "fp16"}, "draft_weights 'fp16' is a CPU kernel"),
    ({"fallback": "random"}, "fallback"),
])
def test_bad_config_names_the_field(draft, bad, field):
    with pytest.raises(SaguaroConfigError, match=field.replace("(", r"\(")) as e:
        load_config({"method": "saguaro", "draft_model": str(draft), **bad})
    assert "invalid Saguaro speculative config" in str(e.value)


def test_missing_draft(tmp_path):
    with pytest.raises(SaguaroConfigError, match="draft_model"):
        load_config({"method": "saguaro"})
    with pytest.raises(SaguaroConfigError, match="not a local HF checkpoint"):
        load_config({"method": "saguaro", "draft_model": str(tmp_path / "nope")})
    with pytest.raises(SaguaroConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("name", ["saguaro.yaml", "cpu-reference.yaml"])
def test_shipped_configs_validate(draft, name):
    from pathlib import Path

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / name).read_text())
    assert is_saguaro_spec(data)
    load_config(dict(data, draft_model=str(draft)))  # every other key as shipped
