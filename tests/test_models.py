import json

import pytest
import torch

from astrl.models import ModelLoadError, context_window, load_model


def test_local_folder_pads_left_with_a_pad_that_is_not_eos(tiny_model_dir):
    lm = load_model(str(tiny_model_dir))
    tok = lm.tokenizer
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert lm.model.config.pad_token_id == tok.pad_token_id
    assert lm.context_window == 512
    assert not lm.model.training


def test_pad_is_added_when_only_eos_exists(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "no-pad"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["pad_token"] = "<|im_end|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    lm = load_model(str(folder), dtype="bfloat16")
    assert lm.tokenizer.pad_token != lm.tokenizer.eos_token
    assert next(lm.model.parameters()).dtype == torch.bfloat16


def test_context_window_from_gpt2_style_config():
    from transformers import GPT2Config

    assert context_window(GPT2Config(n_positions=321)) == 321


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_unknown_hub_id_offline_fails_with_one_clear_sentence(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as info:
        load_model("nobody/no-such-model-xyz")
    message = str(info.value)
    assert "nobody/no-such-model-xyz" in message and "local folder" in message and "\n" not in message


@pytest.mark.parametrize("dtype", ["float7", "int8", "float64"])  # int8 and float64 are torch dtypes, not weights dtypes here
def test_bad_dtype(tiny_model_dir, dtype):
    with pytest.raises(ModelLoadError, match=f"unknown dtype '{dtype}': use float32, bfloat16, float16"):
        load_model(str(tiny_model_dir), dtype=dtype)
