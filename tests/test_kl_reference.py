"""kl_reference: the KL (and preference) reference pinned to the tester its warm start left."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from conftest import make_llama, make_tokenizer
from test_training import _config, _tiny_tester, _trainer

from astrl.lm_scoring import accepts
from astrl.models import add_lora
from astrl.rewards.reference import AdaptersDisabled, PinnedReference, frozen_copy
from astrl.training.config import ConfigError, load_config
from astrl.training.state_io import trainable_state
from astrl.training.trainer import resume


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _bump_adapters(model: torch.nn.Module, by: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(by)


def test_a_pinned_reference_is_the_base_until_pinned_then_the_tester_as_it_stood():
    tok = make_tokenizer()
    tester = add_lora(make_llama(tok), rank=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"]).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = PinnedReference(AdaptersDisabled(tester))
    _bump_adapters(tester, 0.5)  # the warm start trains the adapters
    base, warm = _logits(reference, ids), _logits(tester, ids)
    assert not torch.allclose(base, warm)
    torch.testing.assert_close(base, _logits(reference.base, ids))  # not pinned yet: the untrained tester
    hook = object()
    tester.generate = hook  # an instance hook (SharedPrefill, TurnCache) stays with the tester
    pinned = reference.pin(tester)
    assert vars(tester)["generate"] is hook and "generate" not in vars(pinned)
    _bump_adapters(tester, 0.5)  # RL goes on training the tester
    torch.testing.assert_close(_logits(reference, ids), warm)  # the reference stays where it was pinned
    assert not torch.allclose(_logits(tester, ids), warm)
    assert not any(p.requires_grad for p in reference.parameters()) and not pinned.training
    assert reference.get_output_embeddings() is pinned.get_output_embeddings()
    # log-prob code reads the signature of the model behind the views (to pass logits_to_keep)
    assert accepts(reference, "logits_to_keep") and accepts(reference.base, "logits_to_keep")
    assert not accepts(reference, "no_such_argument")


def test_adapters_disabled_gives_the_base_and_leaves_each_adapter_layer_as_it_was():
    """Each call switches every adapter layer off and back to its own state, an error inside included;
    a layer the user switched off stays off, and the head without an adapter is the model's own."""
    tok = make_tokenizer()
    base = make_llama(tok)
    tester = add_lora(make_llama(tok), rank=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"]).eval()
    _bump_adapters(tester, 0.5)
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = AdaptersDisabled(tester)
    adapted = _logits(tester, ids)
    assert not torch.allclose(adapted, _logits(base, ids))
    torch.testing.assert_close(_logits(reference, ids), _logits(base, ids))
    torch.testing.assert_close(_logits(tester, ids), adapted)  # the adapters are back on
    with pytest.raises(IndexError):
        reference(input_ids=torch.tensor([[len(tok) + 10**6]]))  # an id past the vocabulary fails inside the call
    torch.testing.assert_close(_logits(tester, ids), adapted)
    layers = reference.adapter_layers()
    assert len(layers) == 2 * base.config.num_hidden_layers  # q_proj and v_proj of every layer
    layers[0].enable_adapters(False)  # switched off by hand: the call must not switch it back on
    reference(input_ids=ids)
    assert layers[0].disable_adapters and not any(layer.disable_adapters for layer in layers[1:])
    assert reference.get_output_embeddings() is tester.get_output_embeddings()  # no adapter on the head


def test_adapters_disabled_switches_off_an_adapter_added_after_its_first_call():
    from peft import LoraConfig

    tok = make_tokenizer()
    base = make_llama(tok)
    tester = add_lora(make_llama(tok), rank=4, alpha=8, dropout=0.0, targets=["q_proj"]).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = AdaptersDisabled(tester)
    torch.testing.assert_close(_logits(reference, ids), _logits(base, ids))
    tester.add_adapter("more", LoraConfig(r=4, target_modules=["up_proj"], init_lora_weights=False))
    tester.set_adapter("more")
    assert not torch.allclose(_logits(tester, ids), _logits(base, ids))
    torch.testing.assert_close(_logits(reference, ids), _logits(base, ids))  # up_proj's new layers are off too


def test_adapters_disabled_switches_off_adapters_that_are_no_layers():
    from peft import PromptTuningConfig, get_peft_model

    tok = make_tokenizer()
    base = make_llama(tok)
    tester = get_peft_model(make_llama(tok), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = AdaptersDisabled(tester)
    assert reference.adapter_layers() == []
    assert _logits(tester, ids).shape[1] == 4 + 3  # the virtual tokens are read first
    torch.testing.assert_close(_logits(reference, ids), _logits(base, ids))


def test_frozen_copy_of_a_plain_model_shares_no_weights():
    model = torch.nn.Linear(2, 2)
    clone = frozen_copy(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(clone.weight, model.weight) and not clone.weight.requires_grad and model.weight.requires_grad


WARM = dict(warm_start_probes=4, warm_start_rounds=1, warm_start_min_toxic=0.0, kl_coef=0.05, epochs=1, reward="elicit")
WARM.update(reply_lexicon_weight=1.0, reply_lexicon="hell,idiot,the,you,how,are", warm_start_select="lexicon", warm_start_lr=3e-2)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_first_steps_kl_is_zero_against_the_warm_start_and_not_against_the_base(tmp_path, algorithm):
    rows = {}
    for name in ("base", "warm_start"):
        config = _config(tmp_path / name, total_steps=1, kl_reference=name, algorithm=algorithm, **WARM)
        trainer = _trainer(config)
        rows[name] = trainer.train()[0]
        assert trainer.warm_start["kept"] > 0  # the warm start moved the tester
    # step 1's only update reads the KL before the tester moves: 0 against itself, > 0 against the base
    assert rows["warm_start"]["kl_to_ref"] == pytest.approx(0.0, abs=1e-6)
    assert rows["base"]["kl_to_ref"] > 1e-3


def test_dpos_first_loss_is_log_2_against_the_warm_start_and_not_against_the_base(tmp_path):
    losses = {}
    for name in ("base", "warm_start"):
        config = _config(tmp_path / name, total_steps=1, kl_reference=name, algorithm="dpo", **WARM)
        losses[name] = _trainer(config).train()[0]["loss"]
    # -log sigmoid(beta * 0): every pair's log-ratio to the reference is 0 before the first update
    assert losses["warm_start"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(losses["base"] - math.log(2)) > 1e-4


def test_a_resumed_run_restores_the_pinned_reference_not_the_resumed_tester(tmp_path):
    config = _config(tmp_path, total_steps=2, save_every=1, kl_reference="warm_start", **WARM)
    trainer = _trainer(config)
    trainer.train()
    reference = trainer.models.reference
    pinned = {k: v.clone() for k, v in trainable_state(reference.pinned).items()}
    tester = trainable_state(trainer.models.tester.model)
    assert any(not torch.equal(tester[k], v) for k, v in pinned.items())  # two RL steps moved the tester away
    again = resume(config.run_dir, ["total_steps=3"], progress=False, tester_lm=_tiny_tester())  # from step 2
    assert again.step == 2
    restored = trainable_state(again.models.reference.pinned)
    assert restored.keys() == pinned.keys() and all(torch.equal(restored[k], v) for k, v in pinned.items())


def test_a_checkpoint_saved_against_the_base_does_not_resume_against_the_warm_start(tmp_path):
    config = _config(tmp_path, total_steps=1, save_every=1, kl_reference="base", **WARM)
    _trainer(config).train()
    overrides = ["kl_reference=warm_start", "total_steps=2"]
    with pytest.raises(ConfigError, match=r"step 1\) was saved with kl_reference: base.*resume with kl_reference=base"):
        resume(config.run_dir, overrides, progress=False, tester_lm=_tiny_tester())
    shutil.rmtree(config.run_dir + "/checkpoints/step_000001")  # at step 0 the tester is still the warm start's
    trainer = resume(config.run_dir, overrides, progress=False, tester_lm=_tiny_tester())
    pinned, tester = trainable_state(trainer.models.reference.pinned), trainable_state(trainer.models.tester.model)
    assert pinned.keys() == tester.keys() and all(torch.equal(pinned[k], v) for k, v in tester.items())
    trainer.save_checkpoint()  # now step 0 holds the pinned reference
    with pytest.raises(ConfigError, match="holds a pinned reference but this run has kl_reference: base"):
        resume(config.run_dir, ["total_steps=2"], progress=False, tester_lm=_tiny_tester())


def test_kl_reference_is_checked_before_a_model_loads():
    with pytest.raises(ConfigError, match="kl_reference must be one of \\('base', 'warm_start'\\), got 'sft'"):
        load_config(None, ["kl_reference=sft"])
    with pytest.raises(ConfigError, match="kl_reference: warm_start pins the tester its warm start leaves"):
        load_config(None, ["kl_reference=warm_start", "kl_coef=0.02"])
    with pytest.raises(ConfigError, match="which kl_coef 0.0 switches off: set kl_coef > 0"):
        load_config(None, ["kl_reference=warm_start", "warm_start_probes=8"])
    assert load_config(None, ["kl_reference=warm_start", "warm_start_probes=8", "algorithm=dpo"]).kl_reference == "warm_start"


@pytest.mark.parametrize("lora", [True, False])
def test_the_untrained_tester_is_the_base_whatever_the_reference_is_pinned_to(tmp_path, lora):
    from astrl.training.setup import build_models

    config = _config(tmp_path, kl_reference="warm_start", lora=lora, **WARM)
    models = build_models(config, _tiny_tester())
    ids = torch.tensor([[5, 6, 7, 8]])
    before = _logits(models.untrained, ids)
    if lora:
        _bump_adapters(models.tester.model, 0.5)
    else:
        with torch.no_grad():
            next(models.tester.model.parameters()).add_(0.5)
    models.reference.pin(models.tester.model)  # the warm start's pin
    torch.testing.assert_close(_logits(models.untrained, ids), before)  # still the tester before training
    assert not torch.allclose(_logits(models.reference, ids), before)  # the reference moved to the warm start
