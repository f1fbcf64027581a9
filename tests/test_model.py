import pytest

from llmtrain.config import ModelConfig
from llmtrain.model import ModelError, check_model

from .conftest import run_recipe


def test_sequences_within_the_model_positions_pass(tiny_model):
    check_model(ModelConfig(name_or_path=str(tiny_model)), 512)  # the tiny model has 512


def test_sequences_beyond_the_model_positions_are_refused(tiny_model):
    with pytest.raises(ModelError, match=r"data.max_seq_len: 1024 is above the 512 positions .* "
                                         r"set data.max_seq_len=512 or less"):
        check_model(ModelConfig(name_or_path=str(tiny_model)), 1024)


def test_rope_scaling_allows_longer_sequences(tiny_model, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model)
    config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    config.save_pretrained(tmp_path)
    check_model(ModelConfig(name_or_path=str(tmp_path)), 2048)


def test_recipe_refuses_too_long_sequences_before_loading_anything(base_config, tiny_model, chat_file, cache_env,
                                                                   tmp_path):
    out = tmp_path / "run"
    proc = run_recipe(["--config", str(base_config), f"model.name_or_path={tiny_model}", f"data.train={chat_file}",
                       f"output_dir={out}", "data.max_seq_len=4096"], cache_env, check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.max_seq_len: 4096 is above the 512 positions" in errors[0]
    assert not out.exists()
