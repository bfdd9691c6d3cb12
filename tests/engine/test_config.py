"""EngineConfig: sources, precedence and validation errors that name the field."""

import pytest

from deepinfer.config import EngineConfig, load_config
from deepinfer.errors import ConfigError


def test_defaults():
    cfg = load_config(env={})
    assert cfg.backend == "auto" and cfg.enable_prefix_caching and cfg.swa_replay == "bounded"


def test_precedence_keyword_env_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"backend": "from-file", "seed": 3, "max_num_seqs": 8}')
    env = {"DEEPINFER_BACKEND": "from-env", "DEEPINFER_SEED": "5"}
    cfg = load_config({"backend": "from-flag"}, str(f), env)
    assert (cfg.backend, cfg.seed, cfg.max_num_seqs) == ("from-flag", 5, 8)
    cfg = load_config({}, str(f), env)
    assert cfg.backend == "from-env"
    cfg = load_config({}, None, {"DEEPINFER_CONFIG": str(f)})
    assert cfg.backend == "from-file"


def test_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("dtype: bfloat16\nkv_cache_memory: 1000000\n")
    cfg = load_config({}, str(f), {})
    assert cfg.dtype == "bfloat16" and cfg.kv_cache_memory == 1_000_000


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": "float8"}, "dtype"),
        ({"swa_replay": "sometimes"}, "swa_replay"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
    ],
)
def test_invalid_value_names_field(overrides, field):
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        load_config(overrides, None, {})


def test_invalid_env_value_names_field():
    with pytest.raises(ConfigError, match="field 'seed'"):
        load_config({}, None, {"DEEPINFER_SEED": "abc"})


def test_unknown_field_in_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("bakend: cpu\n")
    with pytest.raises(ConfigError, match="unknown field 'bakend'"):
        load_config({}, str(f), {})


def test_missing_and_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({}, str(tmp_path / "none.yaml"), {})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config({}, str(bad), {})


def test_model_is_pydantic():
    assert issubclass(EngineConfig, __import__("pydantic").BaseModel)


def test_graph_settings_from_keywords_environment_and_their_errors():

    c = load_config(env={"DEEPINFER_GRAPH_CAPTURE_SIZES": "1,2,4", "DEEPINFER_ENFORCE_EAGER": "false"})
    assert c.graph_capture_sizes == [1, 2, 4] and c.enforce_eager is False and c.overlap_scheduling is None
    assert load_config(env={"DEEPINFER_GRAPH_CAPTURE_SIZES": "[8, 16]"}).graph_capture_sizes == [8, 16]
    with pytest.raises(ConfigError, match=r"^invalid config: graph_capture_sizes go up to 128 but max_num_seqs is 64"):
        load_config({"graph_capture_sizes": [128]})
    with pytest.raises(ConfigError, match="graph_capture_sizes.*every size > 0"):
        load_config({"graph_capture_sizes": [0, 2]})
