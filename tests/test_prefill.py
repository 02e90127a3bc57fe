import pytest
import torch
from conftest import loaded, make_llama, make_tokenizer

from astrl.prefill import SharedPrefill
from astrl.training import TrainConfig, Trainer
from astrl.training.setup import build_models

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def _batch(tok, rows):
    """Left-padded ids and mask of the given token rows."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    return ids, mask


def _generate(model, ids, mask, tok, seed):
    torch.manual_seed(seed)
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=True,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_shared_prefill_samples_the_same_tokens_from_the_same_logits(seed):
    tok = make_tokenizer()
    model = make_llama(tok)
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randint(5, len(tok), (n,), generator=g) for n in (9, 3, 6))
    ids, mask = _batch(tok, [a, a, b, b, c, a, c])  # siblings of three prompts of different lengths
    plain = _generate(model, ids, mask, tok, seed)
    prefill = SharedPrefill(model)
    shared = _generate(model, ids, mask, tok, seed)
    assert (prefill.calls_shared, prefill.rows_saved) == (1, 4)
    assert torch.equal(shared.sequences, plain.sequences)
    for x, y in zip(shared.scores, plain.scores, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    # distinct rows, or the switch off: the original generate, untouched
    _generate(model, *_batch(tok, [a, b, c]), tok, seed)
    prefill.enabled = False
    _generate(model, ids, mask, tok, seed)
    assert prefill.calls_shared == 1
    prefill.remove()
    assert not isinstance(model.generate, SharedPrefill)


@pytest.mark.parametrize("algorithm", ["ipo", "grpo"])
def test_a_training_step_is_the_same_with_and_without_shared_prefill(tmp_path, algorithm):
    tok = make_tokenizer()
    rows = {}
    for share in (False, True):
        config = TrainConfig(
            algorithm=algorithm,
            tester="tiny",
            target="tiny",
            scorer="keywords:a,e,i,o,u",
            prompts="builtin",
            prompts_per_step=2,
            group_size=2,
            turns=2,
            tree_width=2,
            tree_depth=2,
            max_new_tokens=5,
            total_steps=2,
            lora_targets=["q_proj", "v_proj"],
            share_prefill=share,
            run_dir=str(tmp_path / f"run_{share}"),
        )
        trainer = Trainer(config, models=build_models(config, loaded(make_llama(tok), tok, name="tiny")), progress=False)
        trainer._build()
        row = trainer.train_step()
        prefill = trainer.models.tester.model.generate
        assert isinstance(prefill, SharedPrefill) == share
        if share:
            assert prefill.calls_shared > 0  # siblings / a group's first turn were prefilled once
        rows[share] = (row, trainer._last_samples)
    (plain, plain_samples), (shared, shared_samples) = rows[False], rows[True]
    assert [s["probe"] for s in shared_samples] == [s["probe"] for s in plain_samples]
    assert [s["response"] for s in shared_samples] == [s["response"] for s in plain_samples]
    assert shared.keys() == plain.keys()
    for key, value in plain.items():
        if isinstance(value, float) and "seconds" not in key:
            assert shared[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key
    if algorithm == "ipo":
        assert plain["pairs"] > 0 and shared["pairs"] == plain["pairs"]
