"""Files from other people's run directories, eval folders and archives are read as data, never run."""

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_llama, make_tokenizer
from test_training import _tiny_overrides

from astrl.archive import AttackArchive
from astrl.cli import main
from astrl.evaluation.tester import load_adapter_model, load_tester, resolve_tester
from astrl.models import ModelLoadError, load_model
from astrl.training import ConfigError, load_config, resume
from astrl.training.state_io import UnsafeCheckpointError, load_state


class WritesMarker:
    """Unpickling this calls ``open(path, "w")``: the marker file appears only if the pickle is run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _train_run(tmp_path: Path, model_dir: Path, steps: int = 1) -> Path:
    run_dir = tmp_path / "run"
    overrides = [*_tiny_overrides(model_dir, run_dir), f"total_steps={steps}"]  # the later value wins
    assert main(["train", "--config", "configs/grpo.yaml", "--quiet", *overrides]) == 0
    return run_dir


def test_resume_refuses_a_malicious_state_file_without_running_it(tmp_path, tiny_model_dir, capsys):
    run_dir = _train_run(tmp_path, tiny_model_dir)
    state_file = run_dir / "checkpoints" / "step_000001" / "state.pt"
    assert load_state(state_file)["step"] == 1  # what astrl writes loads with weights_only=True
    marker = tmp_path / "marker"
    torch.save({"step": WritesMarker(marker)}, state_file)
    with pytest.raises(ConfigError, match="checksum|bytes"):  # it differs from what the run wrote: never read
        resume(run_dir, progress=False)
    assert not marker.exists()
    (state_file.parent / "manifest.json").unlink()  # a crafted folder without a manifest is read safely, and refused

    with pytest.raises(UnsafeCheckpointError, match="--trust-checkpoint") as err:
        resume(run_dir, progress=False)
    assert "older astrl" in str(err.value) and not marker.exists()
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "--quiet", "total_steps=2"]) == 2
    assert "--trust-checkpoint" in capsys.readouterr().err and not marker.exists()

    load_state(state_file, trust=True)  # the explicit opt-in unpickles fully: the payload is real
    assert marker.exists()


def test_trust_checkpoint_resumes_an_old_checkpoint_and_rewrites_it_safely(tmp_path, tiny_model_dir, capsys):
    run_dir = _train_run(tmp_path, tiny_model_dir)
    state_file = run_dir / "checkpoints" / "step_000001" / "state.pt"
    state = load_state(state_file)
    state["rng"] = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    torch.save(state, state_file)  # as astrl wrote RNG states before: pickled tuples and a NumPy array
    (state_file.parent / "manifest.json").unlink()  # nor did it write manifests
    with pytest.raises(UnsafeCheckpointError):
        load_state(state_file)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "--quiet", "total_steps=2"]) == 2
    assert "--trust-checkpoint" in capsys.readouterr().err
    assert main(["train", "--resume", str(run_dir), "--trust-checkpoint", "--quiet", "total_steps=2"]) == 0
    assert load_state(run_dir / "checkpoints" / "step_000002" / "state.pt")["step"] == 2


def test_trust_checkpoint_needs_resume():
    assert main(["train", "--trust-checkpoint", "--quiet"]) == 2


def test_config_with_a_python_tag_is_rejected(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "config.yaml"
    path.write_text(f"seed: !!python/object/apply:builtins.open ['{marker}', 'w']\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="python object tags are not allowed"):
        load_config(path)
    with pytest.raises(ConfigError, match="python object tags are not allowed"):
        load_config(None, [f"seed=!!python/object/apply:builtins.open ['{marker}', 'w']"])
    assert not marker.exists()


def test_eval_tester_reads_a_run_directory_as_data(tmp_path, tiny_model_dir):
    run_dir = _train_run(tmp_path, tiny_model_dir)
    marker = tmp_path / "marker"
    torch.save({"step": WritesMarker(marker)}, run_dir / "checkpoints" / "step_000001" / "state.pt")
    # the tester folders (safetensors adapter, JSON configs, tokenizer) load; state.pt is never read
    for checkpoint in (None, "step_000001"):
        source = resolve_tester(str(run_dir), checkpoint)
        assert load_tester(source).model is not None
    assert not marker.exists()

    config = run_dir / "config.yaml"
    config.write_text(config.read_text() + f"extra: !!python/object/apply:builtins.open ['{marker}', 'w']\n")
    with pytest.raises(ModelLoadError, match="is not plain YAML data: python object tags are not allowed"):
        resolve_tester(str(run_dir))
    assert not marker.exists()


def test_pickled_weights_holding_objects_are_refused(tmp_path):
    marker = tmp_path / "marker"
    tok = make_tokenizer()
    folder = tmp_path / "model"
    make_llama(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": WritesMarker(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="refusing to load the weights"):
        load_model(str(folder))

    from peft import LoraConfig, get_peft_model

    base = tmp_path / "base"
    make_llama(tok).save_pretrained(base)
    tok.save_pretrained(base)
    adapter = get_peft_model(make_llama(tok), LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.peft_config["default"].base_model_name_or_path = str(base)
    adapter.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    torch.save({"x": WritesMarker(marker)}, tmp_path / "adapter" / "adapter_model.bin")
    with pytest.raises(ModelLoadError, match="refusing to load the weights"):
        load_adapter_model(tmp_path / "adapter")
    assert not marker.exists()


def test_attack_archives_are_parsed_as_json(tmp_path):
    path = tmp_path / "attacks.jsonl"
    path.write_bytes(b"cbuiltins\nopen\n(S'marker'\nS'w'\ntR.\n")  # a pickle, not JSON
    with pytest.raises(ValueError, match="attacks.jsonl:1"):
        AttackArchive.read(path)
    assert not (tmp_path / "marker").exists() and not Path("marker").exists()


def test_model_loading_never_trusts_remote_code(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seen = []
    for cls in (AutoTokenizer, AutoModelForCausalLM):
        original = cls.from_pretrained.__func__

        def recording(klass, *args, _original=original, **kwargs):
            seen.append(kwargs.get("trust_remote_code", False))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(recording))
    load_model(str(tiny_model_dir))
    assert seen == [False, False]


def test_the_package_has_no_unsafe_loads():
    root = Path(__file__).resolve().parents[1] / "astrl"
    unsafe = re.compile(
        r"trust_remote_code\s*=\s*True|yaml\.(load|unsafe_load|full_load)\(|pickle\.loads?\(|allow_pickle\s*=\s*True"
    )
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not unsafe.search(text), path
        if path.name != "state_io.py":  # the one torch.load, with weights_only=True unless trusted
            calls = re.findall(r"torch\.load\((?!(\.\.\., )?weights_only=True\))", text)  # messages may name the safe call
            assert not calls and "weights_only=False" not in text, path
