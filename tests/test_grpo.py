"""GRPO: advantages per (opener, turn) cell, and the loss's per-response-token KL and diagnostics."""

import math

import pytest
import torch
from test_training import _config, _trainer

from astrl._compat import as_list
from astrl.training.config import ConfigError, load_config
from astrl.training.grpo import turn_group_advantages

EPS = 1e-6


# -- advantages ------------------------------------------------------------------------------------
def test_turn_group_advantages_by_hand():
    openers = ["a", "a", "a", "a", "b", "b", "b", "b"]
    turns = torch.tensor([0, 1, 0, 1, 0, 0, 0, 0])
    returns = torch.tensor([1.0, 2.0, 3.0, 2.0, 0.0, 0.0, 0.0, 4.0])
    advantages = turn_group_advantages(returns, openers, turns, group_size=2, eps=EPS)
    # cell (a, 0): 1, 3 -> mean 2, std 1 -> -1, +1;  cell (a, 1): 2, 2 -> zero std -> 0, 0
    # cell (b, 0): an opener drawn twice (one group of 4): 0, 0, 0, 4 -> mean 1, std sqrt(3) -> -1, -1, -1, 3 over sqrt(3)
    s = math.sqrt(3.0)
    expected = [-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, -1 / (s + EPS), -1 / (s + EPS), -1 / (s + EPS), 3 / (s + EPS)]
    torch.testing.assert_close(advantages, torch.tensor(expected))
    assert advantages[[1, 3]].tolist() == [0.0, 0.0]  # exactly 0, not eps-small


def test_unscaled_group_advantages_are_differences_from_the_group_mean(tmp_path, monkeypatch):
    openers = ["a", "a", "a", "a", "b", "b"]
    turns = torch.tensor([0, 0, 0, 0, 0, 0])
    returns = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.30, 0.31])
    advantages = turn_group_advantages(returns, openers, turns, group_size=2, scale="none")
    # cell a: mean 0.3 -> -0.2, -0.2, -0.2, 0.6; cell b: mean 0.305 -> -0.005, 0.005
    torch.testing.assert_close(advantages, torch.tensor([-0.2, -0.2, -0.2, 0.6, -0.005, 0.005]))
    scaled = turn_group_advantages(returns, openers, turns, group_size=2)
    assert abs(float(scaled[5])) > 0.99  # with the std division a 0.01 difference weighs as much as any
    assert turn_group_advantages(torch.ones(2), ["a", "a"], torch.zeros(2), group_size=2, scale="none").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="scale must be 'std' or 'none', got 'mad'"):
        turn_group_advantages(returns, openers, turns, group_size=2, scale="mad")
    import astrl.training.grpo as grpo

    with pytest.raises(ConfigError, match="group_scale must be one of \\('std', 'none'\\), got 'mad'"):
        load_config(None, ["group_scale=mad"])
    trainer = _trainer(_config(tmp_path, group_scale="none"))
    trainer._build()
    scales = []
    record = lambda *a, **k: scales.append(k.get("scale")) or turn_group_advantages(*a, **k)  # noqa: E731
    monkeypatch.setattr(grpo, "turn_group_advantages", record)
    trainer.algorithm.collect()
    assert scales == ["none"]  # the config reaches the algorithm


def test_turn_group_advantages_refuse_incomplete_groups():
    openers = ["a", "a", "a", "b", "b"]
    turns = torch.tensor([0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"group_size=2 turns; 1 of 2 cells do not \(\(opener 'a', turn 0\): 3\)"):
        turn_group_advantages(torch.zeros(5), openers, turns, group_size=2)


def _turn_dependent_rollouts(trainer, monkeypatch):
    """Collect through the real env, then give each turn a reward that grows with its turn index."""
    original = trainer.algorithm.next_rollout
    noise = torch.Generator().manual_seed(0)

    def next_rollout():
        data = original()
        turn = data["step_count"].reshape(-1).float()
        reward = 10.0 * turn + torch.rand(turn.shape, generator=noise)
        data.set(("next", "reward"), reward.reshape(data["next", "reward"].shape))
        return data

    monkeypatch.setattr(trainer.algorithm, "next_rollout", next_rollout)


@pytest.mark.parametrize("returns", ["turn", "to_go"])
def test_advantages_have_zero_mean_per_turn_position_and_group(tmp_path, monkeypatch, returns):
    trainer = _trainer(_config(tmp_path, prompts_per_step=2, group_size=3, turns=3, returns=returns))
    trainer._build()
    _turn_dependent_rollouts(trainer, monkeypatch)
    batch, rollout = trainer.algorithm.collect()
    advantage = batch["advantage"].reshape(-1)
    assert advantage.shape == (2 * 3 * 3,)
    torch.testing.assert_close(advantage, trainer.algorithm.advantages(rollout))  # same order as the rollout
    openers, turn = as_list(rollout["query"]), rollout["step_count"].reshape(-1)
    rewards = rollout["next", "reward"].reshape(-1)
    for t in range(3):
        at_t = turn == t
        assert advantage[at_t].mean().abs() < 1e-5
        assert (advantage[at_t].pow(2).mean() - 1).abs() < 1e-3  # unit population variance in each cell
        for opener in set(openers):
            cell = at_t & torch.tensor([o == opener for o in openers])
            assert cell.sum() == 3 and advantage[cell].sum().abs() < 1e-5
    for opener in set(openers):
        assert advantage[torch.tensor([o == opener for o in openers])].mean().abs() < 1e-5
    # the data does depend on the turn: normalising over a whole group (all turns) would carry it
    group_mean = rewards.mean()
    assert (rewards[turn == 2] - group_mean).mean() > 5
    # a per-turn shift of the rewards changes no advantage, in both return modes
    rollout.set(("next", "reward"), (rewards - 10.0 * turn.float()).reshape(rollout["next", "reward"].shape))
    torch.testing.assert_close(trainer.algorithm.advantages(rollout), advantage, atol=1e-4, rtol=0)


# -- loss: KL to the reference and diagnostics per response token -----------------------------------
def _by_hand(trainer, batch) -> dict:
    """kl_to_ref, kl_approx and clip_fraction over all response tokens, from token_logprobs."""
    from astrl.lm_scoring import token_logprobs

    models, tokenizer = trainer.models, trainer.models.tester.tokenizer
    prompts = batch.get(("tokens", "prompt"), as_list=True)
    responses = batch.get(("tokens", "response"), as_list=True)
    options = dict(pad_token_id=tokenizer.pad_token_id, max_length=models.tester.context_window)
    with torch.no_grad():
        current = torch.cat(token_logprobs(models.tester.model, prompts, responses, **options))
        reference = torch.cat(token_logprobs(models.reference, prompts, responses, **options))
    old = torch.cat([row[len(p) :] for row, p in zip(batch.get(("log_probs", "full"), as_list=True), prompts, strict=True)])
    d, x = reference - current, current - old
    eps = trainer.config.clip_epsilon
    return {
        "kl_to_ref": float((d.exp() - d - 1).mean()),
        "kl_approx": float((x.exp() - x - 1).mean()),
        "clip_fraction": float(((x < math.log1p(-eps)) | (x > math.log1p(eps))).float().mean()),
        "tokens": current.numel(),
    }


def _update(trainer, batch, steps: int = 3, lr: float = 0.05) -> None:
    optimizer = torch.optim.Adam([p for p in trainer.models.tester.model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        out = trainer.algorithm.loss(batch)
        sum(out[k] for k in out.keys() if k.startswith("loss_")).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_k3_is_exact_below_its_cap_and_passes_no_gradient_above_it():
    from astrl.losses.kl import k3

    x = torch.tensor([0.0, 1.0, -2.0, 14.0], requires_grad=True)
    value = k3(x, cap=10.0)
    expected = [0.0, math.e - 2, math.exp(-2) + 1, 10.0]
    torch.testing.assert_close(value.detach(), torch.tensor(expected))
    value.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.0, math.e - 1, math.exp(-2) - 1, 0.0]))
    assert k3(torch.tensor(14.0)).item() == pytest.approx(math.exp(14) - 15, rel=1e-5)  # no cap: ~1.2e6
    # far above the cap exp(x) overflows float32 (x > ~88.7): the capped estimate stays the cap and its
    # gradient 0, not 0 * inf = nan
    far = torch.tensor([89.0, 100.0, 1e4, 2.0], requires_grad=True)
    value = k3(far, cap=10.0)
    value.sum().backward()
    assert value.detach().tolist()[:3] == [10.0, 10.0, 10.0] and value[3].item() == pytest.approx(math.exp(2) - 3)
    assert torch.isfinite(far.grad).all() and far.grad[:3].tolist() == [0.0, 0.0, 0.0]
    small = torch.tensor([0.3, 5.0], requires_grad=True)  # a small cap: exact below it, the cap above
    torch.testing.assert_close(k3(small, cap=0.01).detach(), torch.tensor([0.01, 0.01]))
    torch.testing.assert_close(k3(torch.tensor([0.1]), cap=0.01), torch.tensor([math.exp(0.1) - 1.1]))


def test_one_reference_outlier_token_counts_the_cap_not_exp_of_its_log_ratio(tmp_path):
    from astrl.keys import REF_LOG_PROBS_FULL

    trainer = _trainer(_config(tmp_path, reward="astprompter", kl_coef=0.1))
    trainer._build()
    batch, _ = trainer.algorithm.collect()
    hand = _by_hand(trainer, batch)  # policy == reference: every d_t is 0
    rows = batch.get(REF_LOG_PROBS_FULL, as_list=True)
    prompt = len(batch.get(("tokens", "prompt"), as_list=True)[0])
    rows[0] = rows[0].clone()
    rows[0][prompt] += 14.0  # the reference finds the first response token e^14 times likelier
    batch.set(REF_LOG_PROBS_FULL, torch.nested.as_nested_tensor(rows, layout=torch.strided))
    out = trainer.algorithm.loss(batch)
    assert out["kl_to_ref"].item() == pytest.approx(10.0 / hand["tokens"], rel=1e-4)
    trainer.algorithm.loss_module.kl_token_cap = None  # uncapped: the one token outweighs the batch
    out = trainer.algorithm.loss(batch)
    assert out["kl_to_ref"].item() == pytest.approx((math.exp(14) - 15) / hand["tokens"], rel=1e-3)
    # a token the policy finds e^100 times less likely than the reference (a replayed probe's, after the
    # policy moved away): capped, the loss and every gradient stay finite
    trainer.algorithm.loss_module.kl_token_cap = 10.0
    rows[0][prompt] += 86.0
    batch.set(REF_LOG_PROBS_FULL, torch.nested.as_nested_tensor(rows, layout=torch.strided))
    out = trainer.algorithm.loss(batch)
    assert out["kl_to_ref"].item() == pytest.approx(10.0 / hand["tokens"], rel=1e-4)
    sum(out[k] for k in out.keys() if k.startswith("loss_")).backward()
    grads = [p.grad for p in trainer.models.tester.model.parameters() if p.requires_grad]
    assert grads and all(torch.isfinite(g).all() for g in grads if g is not None)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_kl_and_diagnostics_are_zero_before_the_update_and_per_response_token_after(tmp_path, entropy_coef):
    config = _config(tmp_path, reward="astprompter", kl_coef=0.1, entropy_coef=entropy_coef, clip_epsilon=0.2)
    trainer = _trainer(config)
    trainer._build()
    batch, _ = trainer.algorithm.collect()
    out = trainer.algorithm.loss(batch)
    # policy == reference (LoRA B = 0) == behaviour policy
    assert 0.0 <= out["kl_to_ref"].item() < 1e-6 and out["loss_kl_to_ref"].item() < 1e-7
    assert out["kl_approx"].item() == pytest.approx(0.0, abs=1e-7) and out["clip_fraction"].item() == 0.0
    _update(trainer, batch)
    out, hand = trainer.algorithm.loss(batch), _by_hand(trainer, batch)
    assert out["kl_to_ref"].item() > 1e-4 and out["kl_approx"].item() > 1e-4
    assert 0.0 < out["clip_fraction"].item() <= 1.0
    for key in ("kl_to_ref", "kl_approx", "clip_fraction"):  # means over response tokens only
        assert out[key].item() == pytest.approx(hand[key], rel=1e-3, abs=1e-5), key
    assert out["loss_kl_to_ref"].item() == pytest.approx(0.1 * out["kl_to_ref"].item(), rel=1e-6)
    if entropy_coef:  # read at the response positions of the log-probs' own forward
        _, dist, _ = trainer.algorithm.loss_module._get_cur_log_prob(batch.copy())
        assert int(dist.mask.sum()) == hand["tokens"]
        assert out["entropy"].item() == pytest.approx(float(_response_entropy(trainer, batch)), rel=1e-4)
        assert out["loss_entropy"].item() == pytest.approx(-entropy_coef * out["entropy"].item(), rel=1e-6)
        # and its gradient is the hand-computed entropy's: the bonus trains what it logs
        model = trainer.models.tester.model
        params = [p for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        trainer.algorithm.loss(batch)["loss_entropy"].backward()
        ours = [p.grad.clone() for p in params]
        model.zero_grad()
        (-entropy_coef * _response_entropy(trainer, batch, grad=True)).backward()
        assert any(g.abs().sum() > 0 for g in ours)
        for got, want in zip(ours, [p.grad for p in params], strict=True):
            assert torch.allclose(got, want, rtol=1e-3, atol=1e-8)
    else:
        assert out.get("entropy") is None


def _response_entropy(trainer, batch, grad: bool = False) -> torch.Tensor:
    """Mean full-vocabulary entropy of the tester at the positions that predict response tokens."""
    model, values = trainer.models.tester.model, []
    prompts = batch.get(("tokens", "prompt"), as_list=True)
    for prompt, full in zip(prompts, batch.get(("tokens", "full"), as_list=True), strict=True):
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=full[None]).logits[0, len(prompt) - 1 : len(full) - 1].float()
            values.append(torch.distributions.Categorical(logits=logits).entropy())
    return torch.cat(values).mean()


def test_trainer_logs_kl_and_diagnostics_per_response_token(tmp_path):
    import csv

    trainer = _trainer(_config(tmp_path, reward="astprompter", kl_coef=0.1, total_steps=2, save_every=5, lr=3e-2))
    trainer.train()
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    first, second = ({k: float(v) for k, v in r.items() if v not in ("", None)} for r in rows)
    assert first["kl_to_ref"] < 1e-6 and first["kl_approx"] == pytest.approx(0.0, abs=1e-7) and first["clip_fraction"] == 0.0
    assert second["kl_to_ref"] > 0 and second["kl_approx"] >= 0 and 0 <= second["clip_fraction"] <= 1
    for row in (first, second):
        assert row["loss_kl_to_ref"] == pytest.approx(0.1 * row["kl_to_ref"], rel=1e-5, abs=1e-12)
        assert row["loss"] == pytest.approx(row["loss_objective"] + row["loss_kl_to_ref"], rel=1e-5, abs=1e-7)


# -- behaviour log-probs: read before the first update, the first minibatch's from its own forward --------------
def _behaviour_now(trainer, batch) -> list[torch.Tensor]:
    from astrl.lm_scoring import token_logprobs

    models, tokenizer = trainer.models, trainer.models.tester.tokenizer
    prompts, responses = batch.get(("tokens", "prompt"), as_list=True), batch.get(("tokens", "response"), as_list=True)
    with torch.no_grad():
        return token_logprobs(
            models.tester.model, prompts, responses, pad_token_id=tokenizer.pad_token_id, max_length=models.tester.context_window
        )


def _stored_behaviour(batch) -> list[torch.Tensor]:
    prompts = batch.get(("tokens", "prompt"), as_list=True)
    return [row[len(p) :] for row, p in zip(batch.get(("log_probs", "full"), as_list=True), prompts, strict=True)]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_behaviour_log_probs_are_those_of_the_policy_that_collected(tmp_path, minibatches):
    config = _config(tmp_path, prompts_per_step=2, group_size=2, turns=2, minibatches=minibatches, epochs=2, lr=0.05)
    trainer = _trainer(config)
    trainer._build()
    algorithm = trainer.algorithm
    batch, _ = algorithm.collect()
    n = batch.batch_size[0]
    batch.set("advantage", torch.linspace(-1.0, 1.0, n).reshape(n, 1, 1))  # tied rewards would not move the tester
    collected = _behaviour_now(trainer, batch)  # the tester as it collected
    assert all(torch.isnan(row).all() for row in _stored_behaviour(batch))  # not read yet
    parts = list(algorithm.minibatches(batch, torch.Generator().manual_seed(0)))
    assert len(parts) == 2 * minibatches
    first = {id(td) for td in parts[0].tensordicts}
    for td, row, want in zip(batch.tensordicts, _stored_behaviour(batch), collected, strict=True):
        if id(td) in first:  # left to the first minibatch's own forward
            assert torch.isnan(row).all()
        else:  # read in minibatches(), before any update
            torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)
    optimizer = torch.optim.Adam([p for p in algorithm.models.tester.model.parameters() if p.requires_grad], lr=0.05)
    for i, part in enumerate(parts):
        out = algorithm.loss(part)
        if i == 0:  # the behaviour policy is the current one: the ratio is exactly 1
            assert out["kl_approx"].item() == 0.0 and out["clip_fraction"].item() == 0.0
        sum(out[k] for k in out.keys() if k.startswith("loss_")).backward()
        optimizer.step()
        optimizer.zero_grad()
    for row, want in zip(_stored_behaviour(batch), collected, strict=True):  # every row: the collecting policy's
        torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)
    moved = _behaviour_now(trainer, batch)
    assert max(float((a - b).abs().max()) for a, b in zip(moved, collected, strict=True)) > 1e-3  # the updates did move it


def test_behaviour_log_probs_not_read_before_an_update_are_an_error(tmp_path):
    trainer = _trainer(_config(tmp_path, prompts_per_step=2, group_size=2, minibatches=2))
    trainer._build()
    algorithm = trainer.algorithm
    batch, _ = algorithm.collect()
    with torch.no_grad():
        next(p for p in algorithm.models.tester.model.parameters() if p.requires_grad).add_(0.1)  # an update
    with pytest.raises(RuntimeError, match="tester changed before the behaviour log-probs"):
        algorithm.loss(batch)


# -- minibatches of whole conversations, one loss forward per conversation ---------------------------------------
def test_minibatches_of_groups_keep_them_whole_and_reduce_to_plain_ones():
    from tensordict import TensorDict

    from astrl.training.batches import shuffled_minibatches

    batch = TensorDict(i=torch.arange(12), batch_size=[12])
    for options in (dict(count=3), dict(count=5), dict(count=1, size=4)):
        plain = [mb["i"].tolist() for mb in shuffled_minibatches(batch, torch.Generator().manual_seed(3), epochs=2, **options)]
        alone = shuffled_minibatches(batch, torch.Generator().manual_seed(3), epochs=2, groups=torch.arange(12), **options)
        assert [mb["i"].tolist() for mb in alone] == plain  # one item per group: the same minibatches
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    parts = [
        mb["i"].tolist() for mb in shuffled_minibatches(batch, torch.Generator().manual_seed(3), epochs=2, count=2, groups=groups)
    ]
    assert len(parts) == 4
    for epoch in (parts[:2], parts[2:]):
        assert sorted(i for part in epoch for i in part) == list(range(12))  # every item once an epoch
    for part in parts:
        assert len(part) == 6 and len(set(groups[part].tolist())) == 2
        for i in part:  # a group's items together, in batch order
            members = [j for j in part if groups[j] == groups[i]]
            assert members == sorted(members) and len(members) == 3


def test_ppo_minibatches_keep_a_conversation_s_turns_together(tmp_path):
    config = _config(tmp_path, algorithm="ppo", prompts_per_step=2, group_size=2, turns=3, minibatches=2)
    trainer = _trainer(config)
    trainer._build()
    batch, _ = trainer.algorithm.collect()
    n = batch.batch_size[0]
    conversations = batch.get("conversation").reshape(-1)
    assert conversations.tolist() == [i // 3 for i in range(n)]  # trajectory-contiguous: 3 turns each
    parts = list(trainer.algorithm.minibatches(batch, torch.Generator().manual_seed(0)))
    assert len(parts) == 2 * config.epochs
    for part in parts:  # whole conversations only, so that the loss forward nests their turns
        ids = part.get("conversation").reshape(-1)
        assert all(int((ids == c).sum()) == 3 for c in ids.unique())
    out = trainer.algorithm.loss(parts[0])  # the loss reads a minibatch holding the conversation key
    terms = [k for k in out.keys() if k.startswith("loss_")]
    assert "loss_critic" in terms and all(torch.isfinite(out[k]).all() for k in terms)


def test_a_conversation_s_turns_share_one_loss_forward_with_the_same_gradient(tmp_path, monkeypatch):
    import astrl.training.grpo as grpo_module
    from astrl import lm_scoring
    from astrl.lm_scoring import token_logprobs

    config = _config(tmp_path, prompts_per_step=2, group_size=2, turns=3, minibatches=2)
    trainer = _trainer(config)
    trainer._build()
    algorithm = trainer.algorithm
    batch, _ = algorithm.collect()
    n = batch.batch_size[0]
    batch.set("advantage", torch.linspace(-1.0, 1.0, n).reshape(n, 1, 1))
    parts = list(algorithm.minibatches(batch, torch.Generator().manual_seed(0)))
    conversations = batch.get("conversation").reshape(-1)
    assert conversations.tolist() == [i // 3 for i in range(n)]  # trajectory-contiguous: 3 turns each
    for part in parts:  # whole conversations only
        ids = part.get("conversation").reshape(-1)
        assert all(int((ids == c).sum()) == 3 for c in ids.unique())
    params = [p for p in algorithm.models.tester.model.parameters() if p.requires_grad]
    forwards = []
    original = grpo_module.nested_token_logprobs

    def counted(model, prompts, responses, **options):
        forwards.append(len(prompts))
        return original(model, prompts, responses, **options)

    scored = []
    score_tokens = lm_scoring.score_tokens
    monkeypatch.setattr(
        lm_scoring,
        "score_tokens",
        lambda model, prefixes, *a, **k: scored.append(len(prefixes)) or score_tokens(model, prefixes, *a, **k),
    )

    monkeypatch.setattr(grpo_module, "nested_token_logprobs", counted)
    out = algorithm.loss(parts[0])
    grads = torch.autograd.grad(out["loss_objective"], params, allow_unused=True)
    monkeypatch.setattr(grpo_module, "nested_token_logprobs", token_logprobs)  # every turn its own row
    plain = algorithm.loss(parts[0])
    plain_grads = torch.autograd.grad(plain["loss_objective"], params, allow_unused=True)
    torch.testing.assert_close(out["loss_objective"], plain["loss_objective"], rtol=1e-5, atol=1e-6)
    assert any(g is not None and g.abs().max() > 0 for g in grads)
    for g, h in zip(grads, plain_grads, strict=True):
        if g is not None or h is not None:
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
    assert forwards and forwards[0] == parts[0].batch_size[0]
    assert scored[0] < parts[0].batch_size[0]  # turns contained in later ones were not run again


def test_a_kl_coefficient_without_reference_log_probs_is_an_error_not_a_dropped_term(tmp_path):
    from astrl.keys import REF_LOG_PROBS_FULL

    trainer = _trainer(_config(tmp_path, reward="astprompter", kl_coef=0.1))
    trainer._build()
    batch, _ = trainer.algorithm.collect()
    batch = batch.exclude(REF_LOG_PROBS_FULL)
    loss = trainer.algorithm.loss_module
    with pytest.raises(ValueError, match=r"kl_coef is 0\.1 .*'ref_log_probs', 'full'"):
        trainer.algorithm.loss(batch)
    loss.kl_coef = 0.0  # no KL term asked for: the loss needs no reference
    out = trainer.algorithm.loss(batch)
    assert "kl_to_ref" not in out.keys() and "loss_kl_to_ref" not in out.keys() and out["loss_objective"].isfinite()


def test_chat_groups_read_their_prompt_once_with_the_loss_and_log_probs_of_row_by_row_forwards(tmp_path, monkeypatch):
    from astrl import lm_scoring

    trainer = _trainer(_config(tmp_path, prompts_per_step=2, group_size=3, turns=2))
    trainer._build()
    algorithm = trainer.algorithm
    assert algorithm.share_prefix and algorithm.loss_module.share_prefix  # chat mode
    heads = []
    original = lm_scoring._tails_after_heads
    monkeypatch.setattr(lm_scoring, "_tails_after_heads", lambda *a: heads.append((max(a[3]) + 1, len(a[3]))) or original(*a))
    batch, _ = algorithm.collect()
    # the reference log-probs: the first-turn prompt of each opener's 3 conversations read once (2 rows fewer each)
    assert len(heads) == 1 and heads[0][0] <= heads[0][1] - 4
    n = batch.batch_size[0]
    batch.set("advantage", torch.linspace(-1.0, 1.0, n).reshape(n, 1, 1))
    params = [p for p in algorithm.models.tester.model.parameters() if p.requires_grad]
    results = {}
    for share in (True, False):
        algorithm.loss_module.share_prefix = share
        out = algorithm.loss(batch)
        grads = torch.autograd.grad(out["loss_objective"], params)
        results[share] = (out["loss_objective"].detach(), grads, batch.get(("log_probs", "full"), as_list=True))
    assert heads == [heads[0], heads[0]]  # the loss forward shared them too (and only with share_prefix)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-6)
    for g, h in zip(results[True][1], results[False][1], strict=True):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # the reference log-probs equal a row-by-row forward
        prompts, responses = batch.get(("tokens", "prompt"), as_list=True), batch.get(("tokens", "response"), as_list=True)
        plain = lm_scoring.token_logprobs(algorithm.models.reference, prompts, responses, pad_token_id=0)
    for row, p, expected in zip(batch.get(("ref_log_probs", "full"), as_list=True), prompts, plain, strict=True):
        torch.testing.assert_close(row[len(p) :], expected, rtol=1e-5, atol=1e-5)


def test_text_mode_keeps_the_row_by_row_forward(tmp_path):
    trainer = _trainer(_config(tmp_path, mode="text"))
    trainer._build()
    assert not trainer.algorithm.share_prefix and not trainer.algorithm.loss_module.share_prefix


def test_an_update_whose_gradient_is_not_finite_is_skipped_and_counted(tmp_path, capsys):
    trainer = _trainer(_config(tmp_path, reward="astprompter", kl_coef=0.1, epochs=2, total_steps=2))
    trainer._build()
    loss, calls = trainer.algorithm.loss, []

    def poisoned(minibatch):  # the first update's gradient is nan in one weight: clipping spreads it to all
        out = loss(minibatch)
        calls.append(1)
        if len(calls) == 1:
            weight = next(p for p in trainer.models.tester.model.parameters() if p.requires_grad)
            out["loss_objective"] = out["loss_objective"] + (weight.sum() * 0.0 + 1.0).sqrt() * torch.tensor(float("nan"))
        return out

    trainer.algorithm.loss = poisoned
    weights = lambda: [p.detach().clone() for p in trainer.models.tester.model.parameters() if p.requires_grad]  # noqa: E731
    before = weights()
    row = trainer.train_step()
    after = weights()
    assert len(calls) == 2 and row["skipped_updates"] == 1
    assert all(torch.isfinite(w).all() for w in after)  # the nan never reached a weight
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))  # the second update was applied
    assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0  # the mean over the applied update
    assert "step 1: 1 of 2 updates had a gradient that is not finite and were skipped" in capsys.readouterr().err
    trainer.algorithm.loss = loss
    assert "skipped_updates" not in trainer.train_step()  # a clean step: no column of its own
