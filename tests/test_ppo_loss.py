import math

import pytest
import torch
from conftest import make_llama, make_tokenizer
from tensordict import LazyStackedTensorDict, TensorDict

from astrl.lm_scoring import head_gives_logits
from astrl.losses import PPOLoss, ValueHead, compute_advantages
from astrl.rewards import TokenLogProbs


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def lora_llama(tok, seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    # random (non-zero) B matrices so that both LoRA factors get gradients at the first step
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(make_llama(tok, seed=seed), config)


def turns(tok, shapes=((3, 5), (7, 2), (2, 6)), eos_at=None, seed=0):
    """A lazily stacked, ragged batch of tester turns: (prompt length, response length) per sample;
    ``eos_at[i]`` puts EOS there and padding after it."""
    eos_at = {0: 2} if eos_at is None else eos_at
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (n_prompt, n_response) in enumerate(shapes):
        response = torch.randint(5, len(tok), (n_response,), generator=g)
        if i in eos_at:
            response[eos_at[i]] = tok.eos_token_id
            response[eos_at[i] + 1 :] = tok.pad_token_id
        prompt = torch.randint(5, len(tok), (n_prompt,), generator=g)
        samples.append(TensorDict(tokens=TensorDict(prompt=prompt, response=response), reward=torch.tensor([float(i) - 1.0])))
    return LazyStackedTensorDict(*samples)


def scored(model, tok, td):
    """Behaviour log-probs and the response mask, exactly as the trainer gets them."""
    return TokenLogProbs(model, tok, out_key="actor_log_probs", frozen=False)(td)


def rows(td, key):
    return td.get(key, as_list=True)


def plain_forward(model, head, prompt, response):
    """log p(response_t | prompt, response_<t) and V at the predicting position, from an unpadded forward."""
    ids = torch.cat([prompt, response])[None]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    start = len(prompt)
    positions = torch.arange(start - 1, start - 1 + len(response))
    logp = torch.log_softmax(out.logits[0].float(), -1)[positions, response]
    return logp, head(out.hidden_states[-1][0, positions])


# -- advantages ----------------------------------------------------------------------------------------------
def handcrafted():
    """Two turns: 3 response tokens; 4 tokens of which the last 2 are padding after EOS (junk values there)."""
    a = TensorDict(
        response_mask=torch.tensor([True, True, True]),
        reward=torch.tensor([[0.1], [-0.2], [1.0]]),
        state_value=torch.tensor([0.5, 0.2, -0.4]),
    )
    b = TensorDict(
        response_mask=torch.tensor([True, True, False, False]),
        reward=torch.tensor([[0.3], [2.0], [5.0], [7.0]]),
        state_value=torch.tensor([1.0, -1.0, 9.0, 9.0]),
    )
    return LazyStackedTensorDict(a, b)


def test_one_step_advantages_match_hand_computed_values():
    td = compute_advantages(handcrafted(), mode="one_step", gamma=0.9, normalize_rewards=False)
    adv, target = rows(td, "advantage"), rows(td, "value_target")
    # A_t = r_t + 0.9 * V_{t+1} - V_t, V after the last response token = 0
    torch.testing.assert_close(adv[0], torch.tensor([0.1 + 0.9 * 0.2 - 0.5, -0.2 + 0.9 * -0.4 - 0.2, 1.0 + 0.4]))
    torch.testing.assert_close(adv[1], torch.tensor([0.3 + 0.9 * -1.0 - 1.0, 2.0 + 1.0, 0.0, 0.0]))  # padding: 0
    torch.testing.assert_close(target[0], torch.tensor([0.1 + 0.9 * 0.2, -0.2 + 0.9 * -0.4, 1.0]))
    torch.testing.assert_close(target[1], torch.tensor([0.3 + 0.9 * -1.0, 2.0, 0.0, 0.0]))
    torch.testing.assert_close(rows(td, "state_value")[1], torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_gae_advantages_match_hand_computed_values():
    td = compute_advantages(handcrafted(), mode="gae", gamma=0.9, lmbda=0.8, normalize_rewards=False)
    adv, target = rows(td, "advantage"), rows(td, "value_target")
    # deltas as above; A_t = delta_t + 0.72 * A_{t+1}
    a2 = 1.4
    a1 = -0.76 + 0.72 * a2
    a0 = -0.22 + 0.72 * a1
    torch.testing.assert_close(adv[0], torch.tensor([a0, a1, a2]))
    b1 = 3.0
    b0 = -1.6 + 0.72 * b1
    torch.testing.assert_close(adv[1], torch.tensor([b0, b1, 0.0, 0.0]))  # the padding's 5.0, 7.0 and 9.0 never leak in
    torch.testing.assert_close(target[0], torch.tensor([a0 + 0.5, a1 + 0.2, a2 - 0.4]))
    torch.testing.assert_close(target[1], torch.tensor([b0 + 1.0, b1 - 1.0, 0.0, 0.0]))
    # lambda = 0 is the one-step estimate; lambda = gamma = 1 gives returns-to-go minus V
    zero = compute_advantages(handcrafted(), mode="gae", gamma=0.9, lmbda=0.0, normalize_rewards=False)
    one = compute_advantages(handcrafted(), mode="one_step", gamma=0.9, normalize_rewards=False)
    for x, y in zip(rows(zero, "advantage"), rows(one, "advantage"), strict=True):
        torch.testing.assert_close(x, y)
    mc = compute_advantages(handcrafted(), mode="gae", gamma=1.0, lmbda=1.0, normalize_rewards=False)
    torch.testing.assert_close(rows(mc, "value_target")[0], torch.tensor([0.9, 0.8, 1.0]))


def test_per_turn_scores_and_batch_normalisation():
    per_turn = handcrafted()
    per_turn.set("reward", torch.tensor([[1.0], [3.0]]))
    td = compute_advantages(per_turn, mode="one_step", normalize_rewards=False)
    # the score sits on the last response token: A_T = score - V_T
    assert rows(td, "advantage")[0][2].item() == pytest.approx(1.0 + 0.4)
    assert rows(td, "advantage")[1][1].item() == pytest.approx(3.0 + 1.0)
    assert rows(td, "advantage")[1][0].item() == pytest.approx(-1.0 - 1.0)
    # normalised: per-turn returns (0.9 and 2.3) become -1/sqrt(2) and +1/sqrt(2) (std over a batch of two);
    # the rewards are all divided by that std, and the mean return is taken off each last token
    zero_values = handcrafted()
    zero_values.set("state_value", torch.nested.as_nested_tensor([torch.zeros(3), torch.zeros(4)], layout=torch.strided))
    td = compute_advantages(zero_values, mode="one_step", normalize_rewards=True)
    reward = rows(td, "value_target")  # = r_t when every value is 0
    scale = 1 / torch.tensor([0.9, 2.3]).std()
    torch.testing.assert_close(reward[0], torch.tensor([0.1, -0.2, 1.0 - 1.6]) * scale)
    torch.testing.assert_close(reward[1], torch.tensor([0.3, 2.0 - 1.6, 0.0, 0.0]) * scale)
    assert reward[0].sum().item() == pytest.approx(-1 / math.sqrt(2), abs=1e-5)
    assert reward[1].sum().item() == pytest.approx(1 / math.sqrt(2), abs=1e-5)
    # equal returns (std 0) are only centred, never divided by eps
    zero_values.set("reward", torch.nested.as_nested_tensor([torch.tensor([0.5, 0.5, 0.0]), torch.tensor([1.0, 0.0, 3.0, 3.0])]))
    reward = rows(compute_advantages(zero_values, mode="one_step"), "value_target")
    torch.testing.assert_close(reward[0], torch.tensor([0.5, 0.5, -1.0]))
    torch.testing.assert_close(reward[1], torch.tensor([1.0, -1.0, 0.0, 0.0]))
    # whitened advantages: mean 0, std 1 over the response tokens only
    td = compute_advantages(handcrafted(), mode="gae", normalize_advantages=True)
    adv = torch.cat([rows(td, "advantage")[0], rows(td, "advantage")[1][:2]])
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert adv.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    assert rows(td, "advantage")[1][2:].abs().sum() == 0


# -- the loss --------------------------------------------------------------------------------------------
def test_first_epoch_ratio_is_one_and_objective_is_minus_the_mean_advantage(tok):
    model = lora_llama(tok)
    loss = PPOLoss(model, ValueHead.for_model(model), value_coef=0.5, entropy_coef=0.01)
    td = compute_advantages(scored(model, tok, turns(tok)), loss, normalize_rewards=True)
    out = loss(td)
    mask = torch.cat(rows(td, "response_mask"))
    adv = torch.cat(rows(td, "advantage"))
    assert not mask.all() and mask.sum() == 5 + 2 + 6 - 2
    assert out["approx_kl"].item() == 0.0 and out["clip_fraction"].item() == 0.0
    assert out["loss_objective"].item() == pytest.approx(-adv[mask].mean().item(), abs=1e-6)
    assert out["loss_objective"].requires_grad and not out["clip_fraction"].requires_grad
    # new values == old values: loss_critic = 0.5 * 0.5 * mean((V_old - target)^2)
    error = (torch.cat(rows(td, "state_value")) - torch.cat(rows(td, "value_target")))[mask]
    assert out["loss_critic"].item() == pytest.approx(0.25 * (error**2).mean().item(), rel=1e-5)
    assert 0 < out["entropy"].item() <= math.log(len(tok))
    assert out["loss_entropy"].item() == pytest.approx(-0.01 * out["entropy"].item())
    assert "loss_kl" not in out.keys() and "kl_to_ref" not in out.keys()


def test_log_probs_values_and_entropy_match_a_plain_forward(tok):
    model = make_llama(tok, seed=2)
    head = ValueHead.for_model(model, hidden_dim=16)
    torch.nn.init.normal_(head.net[-1].weight)  # non-zero values
    loss = PPOLoss(model, head)
    td = turns(tok, shapes=((4, 3), (1, 5), (9, 2)), eos_at={})
    with torch.no_grad():
        out = loss.evaluate(td)
    for i, (p, r) in enumerate(zip(rows(td, ("tokens", "prompt")), rows(td, ("tokens", "response")), strict=True)):
        logp, values = plain_forward(model, head, p, r)
        torch.testing.assert_close(out.log_probs[i, : len(r)], logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.values[i, : len(r)], values, atol=1e-5, rtol=1e-5)
        assert values.abs().sum() > 0
    assert out.values.dtype == torch.float32 and out.log_probs.shape == (3, 5)
    assert torch.equal(out.valid, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool))
    # the LM head is applied to the gathered hidden states only: it must agree with the model's own logits
    assert head_gives_logits(model) is True


@pytest.mark.parametrize("share", [False, True])
def test_a_conversation_s_first_turn_is_read_inside_its_second(tok, share):
    model = make_llama(tok, seed=2)
    head = ValueHead.for_model(model, hidden_dim=16)
    torch.nn.init.normal_(head.net[-1].weight)
    loss = PPOLoss(model, head, share_prefix=share)
    g = torch.Generator().manual_seed(4)
    opener = torch.randint(5, len(tok), (6,), generator=g)
    samples = []  # a group: two conversations of one opener, two turns each
    for _ in range(2):
        probe1, reply, probe2 = (torch.randint(5, len(tok), (n,), generator=g) for n in (3, 4, 5))
        second = torch.cat([opener, probe1, reply])
        samples += [(opener, probe1), (second, probe2)]
    td = LazyStackedTensorDict(
        *(TensorDict(tokens=TensorDict(prompt=p, response=r), reward=torch.tensor([0.0])) for p, r in samples)
    )
    calls, original = [], model.forward
    model.forward = lambda *args, **kw: calls.append(kw["input_ids"].shape[0]) or original(*args, **kw)
    with torch.no_grad():
        out = loss.evaluate(td)
    model.forward = original
    # each first turn read inside its second; with share_prefix the opener but its last token once, then the tails
    assert calls == ([1, 2] if share else [2])
    for i, (p, r) in enumerate(samples):
        logp, values = plain_forward(model, head, p, r)
        torch.testing.assert_close(out.log_probs[i, : len(r)], logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.values[i, : len(r)], values, atol=1e-5, rtol=1e-5)
    assert out.lengths == [3, 5, 3, 5]


class ScaledLogits(torch.nn.Module):
    """A model whose logits are not ``lm_head(last hidden state)`` (as with logit soft-capping)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, use_cache=False, logits_to_keep=0):
        out = self.inner(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=logits_to_keep
        )
        out.logits = 0.5 * out.logits
        return out


def test_models_that_post_process_their_logits_use_the_full_logits(tok):
    model = ScaledLogits(make_llama(tok, seed=4))
    loss = PPOLoss(model, ValueHead.for_model(model))
    td = turns(tok, eos_at={})
    torch.nn.init.normal_(loss.value_head.net.weight)  # non-zero values
    first, second = (loss.evaluate(td) for _ in range(2))
    assert head_gives_logits(model) is False
    for i, (p, r) in enumerate(zip(rows(td, ("tokens", "prompt")), rows(td, ("tokens", "response")), strict=True)):
        logp, values = plain_forward(model, loss.value_head, p, r)
        for out in (first, second):  # the values still read the last hidden state
            torch.testing.assert_close(out.log_probs[i, : len(r)].detach(), logp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.values[i, : len(r)].detach(), values, atol=1e-5, rtol=1e-5)


def dense_turns(tok, model, loss, ratios, advantages):
    """Two turns of two response tokens whose behaviour log-probs make ``new / old`` equal ``ratios``."""
    g = torch.Generator().manual_seed(3)
    td = TensorDict(
        tokens=TensorDict(
            prompt=torch.randint(5, len(tok), (2, 3), generator=g), response=torch.randint(5, len(tok), (2, 2), generator=g)
        ),
        response_mask=torch.ones(2, 2, dtype=torch.bool),
        advantage=torch.tensor(advantages),
        value_target=torch.zeros(2, 2),
        batch_size=[2],
    )
    with torch.no_grad():
        new = loss.evaluate(td).log_probs
    td.set("actor_log_probs", new - torch.tensor(ratios).log())
    return td


def test_clipping_engages_on_a_handcrafted_ratio_and_advantage(tok):
    model = lora_llama(tok)
    loss = PPOLoss(model, ValueHead.for_model(model), clip_epsilon=0.2)
    # ratio 1.5, A=+1 -> clipped 1.2 | ratio 0.5, A=-1 -> clipped -0.8 | ratio 1.1, A=+2 -> 2.2 | ratio 1.5, A=-1 -> -1.5
    td = dense_turns(tok, model, loss, [[1.5, 0.5], [1.1, 1.5]], [[1.0, -1.0], [2.0, -1.0]])
    out = loss(td)
    assert out["loss_objective"].item() == pytest.approx(-(1.2 - 0.8 + 2.2 - 1.5) / 4, abs=1e-5)
    assert out["clip_fraction"].item() == pytest.approx(3 / 4)
    assert out["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 1.5)) / 4, rel=1e-4)
    # every token clipped on the side of its advantage: no policy gradient at all
    td = dense_turns(tok, model, loss, [[2.0, 2.0], [0.3, 0.3]], [[1.0, 1.0], [-1.0, -1.0]])
    out = loss(td)
    out["loss_objective"].backward()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in lora)
    model.zero_grad()
    td = dense_turns(tok, model, loss, [[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [-1.0, -1.0]])
    loss(td)["loss_objective"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


def test_value_head_learns_from_the_critic_loss_only_and_lora_from_the_objective(tok):
    model = lora_llama(tok)
    head = ValueHead.for_model(model)
    torch.nn.init.normal_(head.net.weight)  # a zero-initialised head passes no gradient back to the trunk
    loss = PPOLoss(model, head, entropy_coef=0.1, kl_coef=0.2)
    td = compute_advantages(scored(model, tok, turns(tok)), loss)
    td.set("ref_log_probs", torch.nested.as_nested_tensor([x - 0.3 for x in rows(td, "actor_log_probs")], layout=torch.strided))
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert lora and all(not p.requires_grad for p in frozen)
    for name in ("loss_objective", "loss_entropy", "loss_kl"):
        model.zero_grad(), head.zero_grad()
        loss(td)[name].backward()
        assert all(p.grad is None or p.grad.abs().sum() == 0 for p in head.parameters()), name
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora), name
    model.zero_grad(), head.zero_grad()
    loss(td)["loss_critic"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)  # shared trunk by default
    detached = PPOLoss(model, head, detach_value_input=True)
    model.zero_grad(), head.zero_grad()
    detached(td)["loss_critic"].backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in lora)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    assert all(p.grad is None for p in frozen)
    groups = loss.parameter_groups(lr_policy=1e-4, lr_value=1e-3)
    assert [g["lr"] for g in groups] == [1e-4, 1e-3]
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in lora}
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in head.parameters()}


def test_kl_penalty_and_value_clipping_follow_their_formulas(tok):
    model = lora_llama(tok)
    head = ValueHead.for_model(model)
    torch.nn.init.normal_(head.net.weight, std=0.5)
    td = compute_advantages(scored(model, tok, turns(tok)), PPOLoss(model, head))
    lp = rows(td, "actor_log_probs")
    shift = [torch.linspace(-1.0, 1.0, len(x)) for x in lp]
    td.set("ref_log_probs", torch.nested.as_nested_tensor([x + s for x, s in zip(lp, shift, strict=True)], layout=torch.strided))
    mask = torch.cat(rows(td, "response_mask"))
    d = torch.cat(shift)[mask]  # log pi_ref - log pi (pi = pi_old at the first epoch)
    for estimator, expected in (("k3", (d.exp() - 1 - d).mean()), ("k1", (-d).mean())):
        out = PPOLoss(model, head, kl_coef=0.5, kl_estimator=estimator)(td)
        assert out["kl_to_ref"].item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
        assert out["loss_kl"].item() == pytest.approx(0.5 * expected.item(), rel=1e-4, abs=1e-6)
    # a cap below the largest token's k3 term (e - 2 = 0.718 at d = 1) counts that much at most
    capped = PPOLoss(model, head, kl_coef=0.5, kl_token_cap=0.3)(td)
    assert capped["kl_to_ref"].item() == pytest.approx((d.exp() - 1 - d).clamp(max=0.3).mean().item(), rel=1e-4)
    with pytest.raises(ValueError, match="kl_token_cap must be > 0 or None, got 0"):
        PPOLoss(model, head, kl_token_cap=0)
    # value clipping: with old values 1.0 away from the new ones, the error uses max(|V - R|, |V_old +- c - R|)
    new = torch.cat(rows(td, "state_value"))
    td.set("state_value", torch.nested.as_nested_tensor([v + 1.0 for v in rows(td, "state_value")], layout=torch.strided))
    target = torch.cat(rows(td, "value_target"))
    clipped = new + 1.0 - 0.1  # V_old + clip(V - V_old, -0.1, 0.1)
    expected = 0.5 * torch.max((new - target) ** 2, (clipped - target) ** 2)[mask].mean()
    out = PPOLoss(model, head, value_coef=1.0, value_clip=0.1)(td)
    assert out["loss_critic"].item() == pytest.approx(expected.item(), rel=1e-4)
    assert out["loss_critic"].item() > PPOLoss(model, head, value_coef=1.0)(td)["loss_critic"].item()


def test_a_few_steps_raise_the_log_prob_of_positively_advantaged_tokens(tok):
    model = lora_llama(tok, seed=1)
    loss = PPOLoss(model, ValueHead.for_model(model), entropy_coef=0.0)
    td = scored(model, tok, turns(tok, shapes=((3, 6), (5, 6), (4, 6), (2, 6)), eos_at={}))
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0]).repeat(4, 1)
    td.set("advantage", sign)
    td.set("value_target", torch.zeros(4, 6))
    before = loss.evaluate(td).log_probs.detach()
    optimizer = torch.optim.AdamW(loss.parameter_groups(lr_policy=3e-3, lr_value=1e-2))
    for _ in range(6):
        optimizer.zero_grad()
        out = loss(td)
        sum(v for k, v in out.items() if k.startswith("loss_")).backward()
        optimizer.step()
    change = loss.evaluate(td).log_probs.detach() - before
    assert change[sign > 0].mean() > 0.05
    assert change[sign < 0].mean() < -0.05
    assert out["clip_fraction"].item() > 0  # the ratio moved past 1 +- eps on some tokens


def test_annotate_writes_the_exact_behaviour_log_probs_and_old_values(tok):
    model = lora_llama(tok)
    loss = PPOLoss(model, ValueHead.for_model(model))
    reference = scored(model, tok, turns(tok))
    td = turns(tok)
    td.set("response_mask", torch.nested.as_nested_tensor(rows(reference, "response_mask"), layout=torch.strided))
    loss.annotate(td)
    for a, b in zip(rows(td, "actor_log_probs"), rows(reference, "actor_log_probs"), strict=True):
        assert torch.equal(a, b)
    assert all(not v.requires_grad for v in rows(td, "state_value"))
    again = compute_advantages(td, normalize_rewards=False)  # reuses the annotated values, no forward
    assert torch.equal(torch.cat(rows(again, "state_value")), torch.cat(rows(td, "state_value")))


def test_bad_inputs_raise_clear_errors_naming_the_key(tok):
    model = make_llama(tok)
    loss = PPOLoss(model, ValueHead.for_model(model))
    td = compute_advantages(scored(model, tok, turns(tok)), loss)
    with pytest.raises(KeyError, match="ref_log_probs"):
        PPOLoss(model, loss.value_head, kl_coef=0.1)(td)
    short = td.clone()
    short.set("advantage", torch.nested.as_nested_tensor([x[:-1] for x in rows(td, "advantage")], layout=torch.strided))
    with pytest.raises(ValueError, match="'advantage': sample 0 has 4 values but .*'response'.* has 5 tokens"):
        loss(short)
    renamed = PPOLoss(model, loss.value_head)
    renamed.set_keys(sample_log_prob="behaviour_lp")
    with pytest.raises(KeyError, match="behaviour_lp"):
        renamed(td)
    with pytest.raises(KeyError, match="state_value"):
        compute_advantages(td.exclude("state_value"))
    empty = turns(tok, shapes=((0, 3), (2, 2)), eos_at={})
    with pytest.raises(ValueError, match="'prompt'.*sample 0 is empty"):
        loss.evaluate(empty)
    wrong = handcrafted()
    wrong.set("reward", torch.nested.as_nested_tensor([torch.zeros(2), torch.zeros(4)], layout=torch.strided))
    with pytest.raises(ValueError, match="'reward': sample 0 has 2 values"):
        compute_advantages(wrong)
    holes = handcrafted()
    holes.set(
        "response_mask", torch.nested.as_nested_tensor([torch.tensor([True, False, True]), torch.ones(4, dtype=torch.bool)])
    )
    with pytest.raises(ValueError, match="sample 0 is not a prefix mask"):
        compute_advantages(holes)
    with pytest.raises(ValueError, match="1-D batch"):
        loss(td.unsqueeze(0))
    with pytest.raises(ValueError, match="mode must be one of"):
        compute_advantages(handcrafted(), mode="td")
    with pytest.raises(ValueError, match="unknown key names"):
        compute_advantages(handcrafted(), keys={"advantages": "a"})
    with pytest.raises(ValueError, match="clip_epsilon"):
        PPOLoss(model, loss.value_head, clip_epsilon=0.0)
    with pytest.raises(ValueError, match="kl_estimator"):
        PPOLoss(model, loss.value_head, kl_estimator="k2")
    with pytest.raises(ValueError, match="hidden states of size 32"):
        loss.value_head(torch.zeros(2, 8))
