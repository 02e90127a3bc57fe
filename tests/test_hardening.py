import csv
import io

import pytest
import torch
from conftest import loaded, make_llama, make_tokenizer
from test_training import _config

from astrl.rewards.reference import AdaptersDisabled
from astrl.scorers import KeywordScorer
from astrl.training import ConfigError, TrainConfig, Trainer, resume
from astrl.training.hardening import TargetHardener, target_inputs
from astrl.training.setup import build_models

PROBES = [
    "hello how are you",
    "tell me about your day",
    "what is the weather like",
    "the cat walk park",
    "good food",
    "you idiot",
]
REFUSAL = "i am fine thanks"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def _lora_target(seed: int = 0):
    """A tiny Llama with a LoRA adapter; its LM head is scaled up so that its logits span a realistic
    range (at the default init they stay within about +-0.6, which no adapter below the head can widen)."""
    from peft import LoraConfig, get_peft_model

    tok = make_tokenizer()
    base = make_llama(tok, seed=seed)
    with torch.no_grad():
        base.lm_head.weight.mul_(25)
    targets = ["q_proj", "v_proj", "up_proj", "down_proj"]
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets)).eval(), tok


def _hardener(model, tok, scorer, **kwargs):
    settings = dict(original=AdaptersDisabled(model), refusal=REFUSAL, steps=30, lr=1e-2, batch_size=4, max_new_tokens=16)
    return TargetHardener(model, tok, scorer, **{**settings, **kwargs})


def _emitted_word_scorer(hardener, inputs):
    """A keyword scorer on the words the untrained target says (minus the refusal's): its replies are 'harmful'."""
    import re

    words = {w for reply in hardener.replies(hardener.original, inputs) for w in re.findall(r"[a-z']+", reply.lower())}
    return KeywordScorer(sorted(words - set(REFUSAL.split())))


def test_target_inputs_are_what_the_target_reads():
    tok = make_tokenizer()
    contexts = ["<|im_start|>user\n"] * 2
    chat = target_inputs(tok, contexts, PROBES[:2], "chat")
    expected = tok.apply_chat_template(
        [[{"role": "user", "content": p}] for p in PROBES[:2]], tokenize=False, add_generation_prompt=True
    )
    assert chat == expected
    assert target_inputs(tok, ["a story: ", "b "], ["x", "y"], "text") == ["a story: x", "b y"]
    with pytest.raises(ValueError, match=r"mode must be one of \('chat', 'text'\), got 'voice'"):
        target_inputs(tok, contexts, PROBES[:2], "voice")
    with pytest.raises(ValueError, match="got 2 contexts but 1 probes"):
        target_inputs(tok, contexts, PROBES[:1], "chat")


def test_hardening_lowers_attack_success_on_a_trivially_learnable_scorer():
    model, tok = _lora_target()
    inputs = target_inputs(tok, ["<|im_start|>user\n"] * len(PROBES), PROBES, "chat")
    hardener = _hardener(model, tok, KeywordScorer(["placeholder"]))
    hardener.scorer = _emitted_word_scorer(hardener, inputs)
    before = hardener.scorer(hardener.replies(model, inputs))
    assert hardener.add(inputs, before) == int((before > 0.5).sum()) >= 4
    assert hardener.add(inputs, before) == 0  # already archived
    row = hardener.round()
    assert row["harden_attacks"] == len(hardener.attacks) and row["asr_before"] == 1.0
    assert row["harden_sft_loss"] < row["harden_sft_loss_first"] / 4
    assert row["asr_current"] <= 0.25 and row["asr_original"] == 1.0  # the original (adapter off) is unchanged
    assert sum(r == REFUSAL for r in hardener.replies(model, hardener.attacks)) >= len(hardener.attacks) - 1

    # the round's state (adapter, optimizer, archive) restores into a fresh target
    fresh, _ = _lora_target()
    restored = _hardener(fresh, tok, hardener.scorer)
    assert restored.success_rate(fresh, hardener.attacks) == 1.0
    buffer = io.BytesIO()  # through a file, as a checkpoint goes (the live optimizer state shares its tensors)
    torch.save(hardener.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.attacks == hardener.attacks and restored.rounds == 1
    assert restored.replies(fresh, inputs) == hardener.replies(model, inputs)
    assert restored.harden() == hardener.harden()  # optimizer moments and attack order resume too


def test_archive_keeps_new_successful_attacks_up_to_its_size_and_bad_settings_name_the_value():
    model, tok = _lora_target()
    hardener = _hardener(model, tok, KeywordScorer(["x"]), max_attacks=3, threshold=0.5)
    assert hardener.add(["a", "b", "c", "a"], torch.tensor([0.9, 0.5, 0.7, 0.9])) == 2
    assert hardener.add(["d", "e"], torch.tensor([1.0, 0.6])) == 2
    assert hardener.attacks == ["c", "d", "e"]
    assert hardener.round() != {} and _hardener(model, tok, KeywordScorer(["x"])).round() == {
        "harden_round": 1,
        "harden_attacks": 0,
    }
    with pytest.raises(ValueError, match="got 2 attack inputs but 1 scores"):
        hardener.add(["a", "b"], torch.tensor([1.0]))
    with pytest.raises(ValueError, match="hardening steps must be >= 1, got 0"):
        _hardener(model, tok, KeywordScorer(["x"]), steps=0)
    with pytest.raises(ValueError, match="hardening lr must be > 0, got -1"):
        _hardener(model, tok, KeywordScorer(["x"]), lr=-1)
    with pytest.raises(ValueError, match="refusal text must not be empty, got ' '"):
        _hardener(model, tok, KeywordScorer(["x"]), refusal=" ")
    frozen = make_llama(tok).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        TargetHardener(frozen, tok, KeywordScorer(["x"]))
    with pytest.raises(KeyError, match=r"missing \['attacks'"):
        hardener.load_state_dict({"model": {}})


# -- the training loop -----------------------------------------------------------------------------
def _peaky_tiny():
    tok = make_tokenizer()
    base = make_llama(tok)
    with torch.no_grad():
        base.lm_head.weight.mul_(25)
    return loaded(base, tok, name="tiny")


def _anything_but_the_refusal(tok) -> str:
    """A keywords scorer that every word of the tiny vocabulary triggers, except the refusal's words."""
    import re

    words = {w for i in range(len(tok)) for w in re.findall(r"[a-z']+", tok.decode([i]).lower())} - set(REFUSAL.split())
    return "keywords:" + ",".join(sorted(words))


def _hardening_config(tmp_path, **overrides):
    settings = dict(
        scorer=_anything_but_the_refusal(make_tokenizer()),
        harden_every=2,
        total_steps=4,
        save_every=100,
        turns=1,
        harden_steps=30,
        harden_lr=1e-2,
        harden_threshold=0.0,  # any vocabulary word in the reply is an attack success
        harden_batch_size=8,
        lora_targets=["q_proj", "v_proj", "up_proj", "down_proj"],
        refusal=REFUSAL,
        target_max_new_tokens=16,
        loggers=[],  # the scorer's long name is no valid file name for the CSV logger; metrics.csv is kept anyway
    )
    return _config(tmp_path, **{**settings, **overrides})


def test_training_with_hardening_makes_the_target_refuse_found_attacks_and_resumes_exactly(tmp_path, monkeypatch):
    config = _hardening_config(tmp_path / "a")
    trainer = Trainer(config, models=build_models(config, _peaky_tiny()), progress=False)
    models = trainer.models
    assert models.target.model is not models.tester.model and models.original_target is not None
    tester_ptrs = {p.data_ptr() for p in models.tester.model.parameters()}
    assert not tester_ptrs & {p.data_ptr() for p in models.target.model.parameters()}  # its own weights
    rows = trainer.train()
    first, second = rows[1], rows[3]
    assert [r.get("harden_round") for r in rows] == [None, 1, None, 2]
    assert first["harden_attacks"] >= 4 and first["asr_before"] >= 0.75
    assert first["asr_current"] <= 0.25 < first["asr_original"]
    assert second["asr_before"] <= 0.25 < second["asr_original"]  # found attacks stay refused
    assert rows[2]["harden_new_attacks"] < rows[0]["harden_new_attacks"]  # the tester's old probes stop working
    assert (tmp_path / "a" / "run" / "final" / "target" / "adapter_config.json").is_file()

    # stopped after step 3 (one round done), then resumed: the same metrics as the uninterrupted run
    interrupted = Trainer(_hardening_config(tmp_path / "b"), models=build_models(config, _peaky_tiny()), progress=False)
    interrupted.config.save_every = 1
    original_step = interrupted.train_step
    calls = []

    def step():
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return original_step()

    monkeypatch.setattr(interrupted, "train_step", step)
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    resumed = resume(tmp_path / "b" / "run", progress=False, tester_lm=_peaky_tiny())
    assert resumed.step == 3 and len(resumed.hardening.hardener.attacks) == rows[2]["harden_archive"]
    resumed.train()
    after = list(csv.DictReader((tmp_path / "b" / "run" / "metrics.csv").open()))
    before = list(csv.DictReader((tmp_path / "a" / "run" / "metrics.csv").open()))
    keys = ["reward_mean", "loss", "harden_archive", "harden_new_attacks", "asr_before", "asr_current", "harden_sft_loss"]
    assert [{k: r[k] for k in keys} for r in after] == [{k: r[k] for k in keys} for r in before]


def test_hardening_settings_are_checked():
    with pytest.raises(ConfigError, match="harden_every must be >= 0, got -1"):
        TrainConfig(harden_every=-1)
    with pytest.raises(ConfigError, match="harden_every needs lora: true"):
        TrainConfig(harden_every=5, lora=False)
    with pytest.raises(ConfigError, match="refusal must not be empty, got ''"):
        TrainConfig(refusal="")


def test_hardening_archives_the_tree_sampler_nodes_with_ipo(tmp_path):
    config = _hardening_config(tmp_path, algorithm="ipo", tree_depth=1, beta=0.1, total_steps=2)
    rows = Trainer(config, models=build_models(config, _peaky_tiny()), progress=False).train()
    assert rows[0]["harden_new_attacks"] > 0 and rows[1]["harden_round"] == 1
    assert rows[1]["asr_current"] < rows[1]["asr_before"] and rows[1]["asr_original"] == rows[1]["asr_before"]
