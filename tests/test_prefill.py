import pytest
import torch
from conftest import loaded, make_gpt2, make_llama, make_tokenizer

from astrl import lm_scoring
from astrl.prefill import (
    SharedPrefill,
    TurnCache,
    clear_turn_caches,
    longest_prefix_sources,
    longest_prefix_sources_pairwise,
)
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


def _tiny_trainer(tmp_path, name: str, **settings) -> Trainer:
    """A built trainer on a tiny Llama (LoRA tester, adapters-off target) with small sizes; ``settings`` override."""
    tok = make_tokenizer()
    sizes = dict(prompts_per_step=2, group_size=2, turns=2, tree_width=2, tree_depth=2, max_new_tokens=5, total_steps=2)
    config = TrainConfig(
        tester="tiny",
        target="tiny",
        scorer="keywords:a,e,i,o,u",
        prompts="builtin",
        lora_targets=["q_proj", "v_proj"],
        run_dir=str(tmp_path / name),
        **{**sizes, **settings},
    )
    trainer = Trainer(config, models=build_models(config, loaded(make_llama(tok), tok, name="tiny")), progress=False)
    trainer._build()
    return trainer


def _assert_same_step(plain: tuple, other: tuple) -> None:
    """Two (metrics row, samples) of one step: the same texts, and metrics equal up to float rounding."""
    (plain_row, plain_samples), (row, samples) = plain, other
    assert [s["probe"] for s in samples] == [s["probe"] for s in plain_samples]
    assert [s["response"] for s in samples] == [s["response"] for s in plain_samples]
    assert row.keys() == plain_row.keys()
    for key, value in plain_row.items():
        if isinstance(value, float) and "seconds" not in key:
            assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key


@pytest.mark.parametrize("algorithm", ["ipo", "grpo"])
def test_a_training_step_is_the_same_with_and_without_shared_prefill(tmp_path, algorithm):
    rows = {}
    for share in (False, True):
        # without the turn cache (which reads identical rows once itself)
        trainer = _tiny_trainer(tmp_path, f"run_{share}", algorithm=algorithm, share_prefill=share, turn_cache=False)
        row = trainer.train_step()
        prefill = trainer.models.tester.model.generate
        assert isinstance(prefill, SharedPrefill) == share
        if share:
            assert prefill.calls_shared > 0  # siblings / a group's first turn were prefilled once
        rows[share] = (row, trainer._last_samples)
    _assert_same_step(rows[False], rows[True])
    if algorithm == "ipo":
        assert rows[False][0]["pairs"] > 0 and rows[True][0]["pairs"] == rows[False][0]["pairs"]


# -- TurnCache: the last call's KV cache reused by the next ------------------------------------------------------
def _turns(model, tok, prompts, seed, turns=3, branch=True):
    """Three generate calls where each prompt extends the previous one (a conversation), plus, at the second
    turn, a repeated row (a tree sibling) and a fresh prompt (no cached prefix); the sampled rows and logits."""
    rows, out_rows, logits = [list(p) for p in prompts], [], []
    torch.manual_seed(seed)
    for turn in range(turns):
        ids, mask = _batch(tok, [torch.tensor(r) for r in rows])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=True,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
        )
        assert torch.equal(out.sequences[:, : ids.shape[1]], ids)  # the caller's own prompt layout comes back
        new = out.sequences[:, ids.shape[1] :]
        out_rows.append(new)
        logits.append(torch.stack(out.logits, 1))
        reply = [7 + turn, 9, 11]  # the other side's turn, appended to each row
        rows = [r + n.tolist() + reply for r, n in zip(rows, new, strict=True)]
        if branch and turn == 0:
            rows = [*rows, rows[0], [5, 6, 7, 8]]
    return out_rows, logits


@pytest.mark.parametrize("make", [make_llama, lambda tok: make_gpt2(tok, n_positions=64)], ids=["llama", "gpt2"])
def test_turn_cache_samples_the_same_tokens_from_the_same_logits(make):
    tok = make_tokenizer()
    model = make(tok).eval()
    prompts = [[12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37]]
    plain_rows, plain_logits = _turns(model, tok, prompts, seed=0)
    cache = TurnCache(model)
    rows, logits = _turns(model, tok, prompts, seed=0)
    assert cache.calls_reused == 2  # turns 2 and 3 started from the cache
    assert cache.rows_shared == 1  # the repeated row at turn 2 read its uncached tokens once (then it diverged)
    assert cache.tokens_reused > cache.tokens_prefilled / 2
    for a, b in zip(rows, plain_rows, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(logits, plain_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    cache.remove()
    assert not isinstance(model.generate, TurnCache)


def test_turn_cache_starts_afresh_when_the_weights_change():
    tok = make_tokenizer()
    model = make_llama(tok).eval()
    cache = TurnCache(model)
    prompts = [[12, 13, 14, 15, 16], [20, 21, 22]]
    _turns(model, tok, prompts, seed=1, turns=1, branch=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # as an optimizer step does: in place
    rows, logits = _turns(model, tok, prompts, seed=2, turns=1, branch=False)
    assert cache.calls_reused == 0
    cache.enabled = False
    plain_rows, plain_logits = _turns(model, tok, prompts, seed=2, turns=1, branch=False)
    assert torch.equal(rows[0], plain_rows[0])
    torch.testing.assert_close(logits[0], plain_logits[0])
    # weights swapped in rather than written in place (a weight push may do that) also start afresh
    cache.enabled = True
    _turns(model, tok, prompts, seed=2, turns=1, branch=False)
    model.lm_head.weight.data = model.lm_head.weight.data * 0.5
    swapped_rows, swapped_logits = _turns(model, tok, prompts, seed=2, turns=1, branch=False)
    cache.enabled = False
    plain_rows, plain_logits = _turns(model, tok, prompts, seed=2, turns=1, branch=False)
    assert torch.equal(swapped_rows[0], plain_rows[0])
    torch.testing.assert_close(swapped_logits[0], plain_logits[0])
    assert cache.calls_reused == 0
    # clear() drops the kept cache: the next call prefills in full
    cache.enabled = True
    _turns(model, tok, prompts, seed=3, turns=1, branch=False)
    clear_turn_caches(model)
    _turns(model, tok, prompts, seed=3, turns=1, branch=False)
    assert cache.calls_reused == 0


def test_turn_cache_sees_adapters_injected_after_it_was_installed():
    from peft import LoraConfig, inject_adapter_in_model

    tok = make_tokenizer()
    model = make_llama(tok).eval()
    cache = TurnCache(model)  # installed before the model has any adapter layer
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), model)
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")]
    assert layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the output
    prompts = [[12, 13, 14, 15, 16], [20, 21, 22]]

    def two_turns_with_adapters_off_in_the_second():
        rows, logits = [list(p) for p in prompts], []
        torch.manual_seed(5)
        for turn in range(2):
            for layer in layers:
                layer.enable_adapters(turn == 0)
            ids, mask = _batch(tok, [torch.tensor(r) for r in rows])
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True,
                output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
            logits.append(torch.stack(out.logits, 1))
            rows = [r + n.tolist() + [7, 9, 11] for r, n in zip(rows, out.sequences[:, ids.shape[1] :], strict=True)]
        return logits

    logits = two_turns_with_adapters_off_in_the_second()
    assert cache.calls_reused == 0  # the second call's model is another one: the first call's cache is not read
    cache.enabled = False
    plain = two_turns_with_adapters_off_in_the_second()
    for a, b in zip(logits, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_turn_cache_passes_order_dependent_settings_through():
    tok = make_tokenizer()
    model = make_llama(tok).eval()
    cache = TurnCache(model)
    ids, mask = _batch(tok, [torch.tensor([12, 13, 14, 15])])
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    again = torch.cat([first, torch.tensor([[7, 8]])], dim=1)
    second = model.generate(
        input_ids=again, attention_mask=torch.ones_like(again), max_new_tokens=3, do_sample=False, repetition_penalty=1.3
    )
    assert cache.calls_reused == 0  # a repetition penalty reads the whole input: no cached layout
    cache.enabled = False
    plain = model.generate(
        input_ids=again, attention_mask=torch.ones_like(again), max_new_tokens=3, do_sample=False, repetition_penalty=1.3
    )
    assert torch.equal(second, plain)
    # the output type follows the caller's settings, also when they come in a generation config
    from transformers import GenerationConfig

    cache.enabled = True
    settings = GenerationConfig(max_new_tokens=2, do_sample=False, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids) and out.past_key_values is None


def test_turn_cache_of_a_lora_tester_is_not_used_by_its_adapters_off_target():
    from astrl.models import add_lora
    from astrl.rewards.reference import AdaptersDisabled

    tok = make_tokenizer()
    tester = add_lora(make_llama(tok), rank=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"]).eval()
    with torch.no_grad():
        for name, p in tester.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the output
    target = AdaptersDisabled(tester)
    tester_cache, target_cache = TurnCache(tester), TurnCache(target)
    prompts = [[12, 13, 14, 15, 16], [20, 21, 22]]
    _turns(tester, tok, prompts, seed=4, turns=1, branch=False)
    before = (tester_cache.tokens_prefilled, tester_cache.calls_reused)
    rows, logits = _turns(target, tok, prompts, seed=4, turns=2, branch=False)
    assert (tester_cache.tokens_prefilled, tester_cache.calls_reused) == before  # the target never went through it
    assert target_cache.calls_reused == 1
    tester_cache.enabled = target_cache.enabled = False
    with tester.disable_adapter():
        plain_rows, plain_logits = _turns(tester, tok, prompts, seed=4, turns=2, branch=False)
    for a, b in zip(rows, plain_rows, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(logits, plain_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("algorithm", "mode"), [("grpo", "chat"), ("grpo", "text"), ("ipo", "chat")])
def test_a_training_step_is_the_same_with_and_without_the_turn_cache(tmp_path, algorithm, mode):
    rows = {}
    for reuse in (False, True):
        settings = dict(algorithm=algorithm, mode=mode, turns=3, tree_depth=3, turn_cache=reuse)
        trainer = _tiny_trainer(tmp_path, f"run_{reuse}", **settings)
        hooks = [m.generate for m in (trainer.models.tester.model, trainer.models.target.model)]
        assert all(isinstance(h, TurnCache) for h in hooks) == reuse
        row = trainer.train_step()
        if reuse:
            assert sum(h.calls_reused for h in hooks) >= 3  # later turns / tree levels started from the cache
            assert all(h._state is None for h in hooks)  # freed after the collection
        rows[reuse] = (row, trainer._last_samples)
    _assert_same_step(rows[False], rows[True])


# -- prompt states: log-probs of what a model has just read ---------------------------------------------------
def _read(model, rows, starts, tok, forward=False):
    """Log-probs of ``rows[i][starts[i]:]``: through ``token_logprobs`` (kept states allowed) or, with
    ``forward``, a forward of ``score_tokens``."""
    split = ([r[:s] for r, s in zip(rows, starts, strict=True)], [r[s:] for r, s in zip(rows, starts, strict=True)])
    with torch.no_grad():
        if forward:
            return lm_scoring.score_tokens(model, *split, pad_token_id=tok.pad_token_id).rows()
        return lm_scoring.token_logprobs(model, *split, pad_token_id=tok.pad_token_id)


def _direct(model, rows, starts, tok):
    return _read(model, rows, starts, tok, forward=True)


def _close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_kept_prompt_states_give_the_log_probs_of_a_forward():
    tok = make_tokenizer()
    model = make_llama(tok).eval()
    cache = TurnCache(model, keep_states=True)
    prompts = [torch.tensor(p) for p in ([12, 13, 14, 15, 16, 17], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37])]
    ids, mask = _batch(tok, prompts)
    first = _generate(model, ids, mask, tok, seed=0)
    # any split of a prompt just read: its continuation comes from the kept states, equal to a forward
    rows = [prompts[0], prompts[0][:4], prompts[1], prompts[2], prompts[2]]
    starts = [3, 1, 2, 6, 1]
    _close(_read(model, rows, starts, tok), _direct(model, rows, starts, tok))
    assert cache.rows_from_states == 5
    # a row that is not a prompt read (it goes past one, or differs) is computed by a forward
    other = [torch.cat([prompts[1], torch.tensor([9])]), torch.tensor([12, 13, 99])]
    _close(_read(model, other, [2, 1], tok), _direct(model, other, [2, 1], tok))
    assert cache.rows_from_states == 5
    # the next turn starts from the cache: states exist for what this call read, not for the cached prefix
    grown = [torch.cat([p, first.sequences[i, ids.shape[1] :], torch.tensor([7, 9, 11])]) for i, p in enumerate(prompts)]
    ids2, mask2 = _batch(tok, grown)
    _generate(model, ids2, mask2, tok, seed=1)
    assert cache.calls_reused == 1
    cached = [len(p) + 10 for p in prompts]  # prompt + generated tokens came from the cache
    rows, starts = grown, [c + 1 for c in cached]  # continuations inside the newly read part
    _close(_read(model, rows, starts, tok), _direct(model, rows, starts, tok))
    assert cache.rows_from_states == 8
    early = [3, 2, 4]  # continuations that begin in the cached prefix: a forward
    _close(_read(model, rows, early, tok), _direct(model, rows, early, tok))
    assert cache.rows_from_states == 8
    # with gradients, or after the weights changed, nothing is read from the states
    with torch.enable_grad():
        _ = [
            r.sum()
            for r in lm_scoring.token_logprobs(
                model, [r[:s] for r, s in zip(rows, starts, strict=True)], [r[s:] for r, s in zip(rows, starts, strict=True)]
            )
        ]
    assert cache.rows_from_states == 8
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    _close(_read(model, rows, starts, tok), _direct(model, rows, starts, tok))
    assert cache.rows_from_states == 8
    clear_turn_caches(model)
    assert lm_scoring._PROMPT_STATES.get(model) is None


def test_prompt_states_of_a_target_with_adapters_off_are_the_base_model_s():
    from astrl.models import add_lora
    from astrl.rewards.reference import AdaptersDisabled

    tok = make_tokenizer()
    tester = add_lora(make_llama(tok), rank=2, alpha=4, targets=["q_proj", "v_proj"]).eval()
    with torch.no_grad():
        for name, p in tester.named_parameters():
            if "lora_B" in name:
                p.normal_()  # adapters that change the outputs
    target = AdaptersDisabled(tester)
    cache = TurnCache(target, keep_states=True)
    prompts = [torch.tensor(p) for p in ([12, 13, 14, 15, 16, 17], [20, 21, 22, 23])]
    ids, mask = _batch(tok, prompts)
    _generate(target, ids, mask, tok, seed=0)
    read = _read(target, prompts, [2, 1], tok)
    assert cache.rows_from_states == 2
    _close(read, _direct(target, prompts, [2, 1], tok))
    with tester.disable_adapter():
        _close(read, _direct(tester, prompts, [2, 1], tok))
    adapted = _direct(tester, prompts, [2, 1], tok)
    assert not torch.allclose(adapted[0], read[0], atol=1e-3)  # the tester's own log-probs are other
    assert lm_scoring._PROMPT_STATES.get(tester) is None  # nothing kept for the adapters-on model


# -- which kept row a new row reuses: longest common prefix, first on ties ---------------------------------------
def _packed(rows):
    """Rows packed at the front (fill -1) and their counts."""
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), -1)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return tokens, torch.tensor([len(r) for r in rows])


@pytest.mark.parametrize("match", [longest_prefix_sources, longest_prefix_sources_pairwise], ids=["hashed", "pairwise"])
def test_longest_prefix_sources_by_hand(match):
    old = _packed([[1, 2, 3], [1, 2, 3, 4, 5], [7, 8], [1, 2, 3, 4, 9]])
    new = _packed([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9], [1, 2, 7], [7, 8, 1], [5], [1, 2, 3]])
    source, matched = match(*old, *new)
    # row 0 shares 5 with old 1; row 1 shares 5 with old 3; row 2 shares 2 with old 0, 1 and 3 (first: 0);
    # row 3 shares 2 with old 2; row 4 shares nothing (the first old row, as argmax gives); row 5 shares all 3
    # of its tokens with old 0, 1 and 3 (first: 0)
    assert source.tolist() == [1, 3, 0, 2, 0, 0]
    assert matched.tolist() == [5, 5, 2, 2, 0, 3]


def test_longest_prefix_sources_match_every_pair_compared():
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        vocab = 3 if trial % 2 else 50  # a small vocabulary makes long shared prefixes and many ties
        old_rows = [
            torch.randint(vocab, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 30, (40,), generator=generator)
        ]
        new_rows = []
        for n in torch.randint(1, 40, (60,), generator=generator):
            base = old_rows[int(torch.randint(len(old_rows), (), generator=generator))]
            keep = int(torch.randint(len(base) + 1, (), generator=generator))
            new_rows.append(base[:keep] + torch.randint(vocab, (int(n),), generator=generator).tolist())
        old, new = _packed(old_rows), _packed(new_rows)
        hashed, pairwise = longest_prefix_sources(*old, *new), longest_prefix_sources_pairwise(*old, *new)
        assert torch.equal(hashed[0], pairwise[0]) and torch.equal(hashed[1], pairwise[1])


def test_longest_prefix_sources_fall_back_on_a_hash_collision(monkeypatch):
    from astrl import prefill

    monkeypatch.setattr(prefill, "_prefix_keys", lambda tokens: torch.zeros_like(tokens, dtype=torch.long))
    old = _packed([[4, 5], [1, 2, 3]])
    new = _packed([[1, 2, 9], [4, 6]])
    source, matched = longest_prefix_sources(*old, *new)  # every key equal: the check finds it, the pairs decide
    assert source.tolist() == [1, 0] and matched.tolist() == [2, 1]
