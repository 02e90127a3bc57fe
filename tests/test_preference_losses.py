import functools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_llama, make_tokenizer
from tensordict import TensorDict, lazy_stack

from astrl.losses import DPOLoss, IPOLoss
from astrl.rewards import make_reference

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


@functools.cache
def _tokenizer():
    return make_tokenizer()


def _pairs(tok, n=4, seed=0, masks=True):
    """Ragged pairs: prompts of different lengths, responses that stop at EOS followed by padding."""
    g = torch.Generator().manual_seed(seed)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    members = []
    for i in range(n):
        prompt = torch.randint(5, len(tok), (3 + 2 * i,), generator=g)
        chosen = torch.randint(5, len(tok), (6,), generator=g)
        rejected = torch.randint(5, len(tok), (4 + i % 2,), generator=g)
        if i % 2 == 0:  # chosen stops early: EOS then padding that must not count
            chosen[3], chosen[4:] = eos, pad
        if i == 1:
            rejected[-1] = eos
        td = TensorDict(prompt_tokens=prompt, chosen_tokens=chosen, rejected_tokens=rejected)
        if masks:
            td["chosen_mask"] = torch.arange(6) <= (3 if i % 2 == 0 else 5)
            td["rejected_mask"] = torch.ones(len(rejected), dtype=torch.bool)
        members.append(td)
    return lazy_stack(members)


def summed_logprob(model, prompt, response, eos) -> torch.Tensor:
    """sum_t log p(response_t | prompt, response_<t) up to and including the first EOS: a plain
    unpadded forward of one sequence and a gather."""
    response = response.tolist()
    if eos in response:
        response = response[: response.index(eos) + 1]
    ids = torch.tensor([prompt.tolist() + response])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    start = len(prompt)
    return sum(logp[t - 1, ids[0, t]] for t in range(start, ids.shape[1]))


def _expected_h(model, reference, pairs, eos):
    hs, ws, ls = [], [], []
    with torch.no_grad():
        for pair in pairs.unbind(0):
            p = pair["prompt_tokens"]
            w = summed_logprob(model, p, pair["chosen_tokens"], eos) - summed_logprob(reference, p, pair["chosen_tokens"], eos)
            lo = summed_logprob(model, p, pair["rejected_tokens"], eos) - summed_logprob(
                reference, p, pair["rejected_tokens"], eos
            )
            hs.append(w - lo), ws.append(w), ls.append(lo)
    return torch.stack(hs), torch.stack(ws), torch.stack(ls)


@pytest.mark.parametrize("masks", [True, False])
def test_dpo_and_ipo_equal_a_hand_computation(masks):
    tok = _tokenizer()
    model, reference = make_llama(tok, seed=0), make_llama(tok, seed=1)
    pairs = _pairs(tok, masks=masks)
    h, w, lo = _expected_h(model, reference, pairs, tok.eos_token_id)
    assert (h > 0).any() and (h < 0).any()  # the accuracy metric is not trivially 0 or 1
    dpo = DPOLoss(model, reference, beta=0.3, tokenizer=tok)(pairs)
    assert dpo["loss_dpo"].item() == pytest.approx((-F.logsigmoid(0.3 * h)).mean().item(), abs=1e-5)
    assert dpo["reward_margin"].item() == pytest.approx((0.3 * h).mean().item(), abs=1e-5)
    assert dpo["preference_accuracy"].item() == pytest.approx((h > 0).float().mean().item())
    assert dpo["chosen_logratio"].item() == pytest.approx(w.mean().item(), abs=1e-4)
    assert dpo["rejected_logratio"].item() == pytest.approx(lo.mean().item(), abs=1e-4)
    assert dpo["loss_dpo"].requires_grad and not dpo["reward_margin"].requires_grad
    ipo = IPOLoss(model, reference, beta=0.05, tokenizer=tok)(pairs)
    assert ipo["loss_ipo"].item() == pytest.approx(((h - 1 / (2 * 0.05)) ** 2).mean().item(), rel=1e-5)


def test_tester_equal_to_reference_gives_log2_and_quarter_beta_squared():
    tok = _tokenizer()
    model = make_llama(tok)
    pairs = _pairs(tok)
    dpo = DPOLoss(model)(pairs)  # default reference: a frozen copy of the model
    assert dpo["loss_dpo"].item() == pytest.approx(math.log(2), abs=1e-6)
    assert dpo["preference_accuracy"].item() == 0.0 and dpo["reward_margin"].item() == pytest.approx(0.0, abs=1e-7)
    ipo = IPOLoss(model)
    assert ipo.beta == 0.01  # the ASTPrompter default
    assert ipo(pairs)["loss_ipo"].item() == pytest.approx(1 / (4 * 0.01**2), rel=1e-6)


def test_precomputed_reference_logprobs_are_used_and_match():
    tok = _tokenizer()
    model, reference = make_llama(tok, seed=0), make_llama(tok, seed=1)
    loss = DPOLoss(model, reference, beta=0.2)
    pairs = _pairs(tok)
    on_the_fly = loss(pairs)["loss_dpo"]
    loss.reference_logprobs(pairs)
    ref_w = pairs["ref_chosen_logprob"]
    assert ref_w.shape == (4,) and not ref_w.requires_grad
    with torch.no_grad():
        expected = summed_logprob(reference, pairs[0]["prompt_tokens"], pairs[0]["chosen_tokens"], tok.eos_token_id)
    assert ref_w[0].item() == pytest.approx(expected.item(), abs=1e-5)
    torch.testing.assert_close(loss(pairs)["loss_dpo"], on_the_fly)
    pairs.set("ref_chosen_logprob", ref_w + 1.0)  # the stored values are what the loss reads
    h_shift = loss(pairs)["reward_margin"] - loss.beta * (-1.0)
    assert h_shift.item() == pytest.approx(loss(_pairs(tok))["reward_margin"].item(), abs=1e-5)


def test_gradients_reach_lora_parameters_only():
    from peft import LoraConfig, get_peft_model

    tok = _tokenizer()
    tester = get_peft_model(make_llama(tok), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    loss = IPOLoss(tester, beta=0.1)
    assert {p.data_ptr() for p in loss.reference.parameters()} <= {p.data_ptr() for p in tester.parameters()}
    out = loss(_pairs(tok))
    assert out["loss_ipo"].item() != pytest.approx(1 / (4 * 0.1**2))  # adapters on: tester differs from the reference
    out["loss_ipo"].backward()
    lora = {n: p for n, p in tester.named_parameters() if "lora_" in n}
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())
    assert all(p.grad is None for n, p in tester.named_parameters() if "lora_" not in n)
    # the loss module registers the tester, not a second copy of the weights
    assert {id(p) for p in loss.parameters()} == {id(p) for p in tester.parameters()}


def test_plain_reference_gets_no_gradient():
    tok = _tokenizer()
    model = make_llama(tok)
    reference = make_reference(model)
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)  # the tester has moved away from its reference
    DPOLoss(model, reference)(_pairs(tok))["loss_dpo"].backward()
    assert all(p.grad is None for p in reference.parameters())
    assert sum(p.grad.abs().sum() for p in model.parameters() if p.grad is not None) > 0


@pytest.mark.parametrize("loss_cls", [DPOLoss, IPOLoss])
def test_optimizer_steps_increase_the_margin(loss_cls):
    tok = _tokenizer()
    model = make_llama(tok).train()
    loss = loss_cls(model, beta=0.1)
    pairs = _pairs(tok, n=3, seed=2)
    loss.reference_logprobs(pairs)  # scored once, reused at every step
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    margins, losses = [], []
    for _ in range(5):
        out = loss(pairs)
        margins.append(out["reward_margin"].item()), losses.append(out[loss.loss_name].item())
        optimizer.zero_grad()
        out[loss.loss_name].backward()
        optimizer.step()
    last = loss(pairs)
    margins.append(last["reward_margin"].item()), losses.append(last[loss.loss_name].item())
    assert margins[0] == pytest.approx(0.0, abs=1e-6)
    assert all(b > a for a, b in zip(margins, margins[1:], strict=False)) and margins[-1] > 0.3
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))
    assert last["preference_accuracy"] == 1.0


def test_set_keys_and_clear_errors():
    tok = _tokenizer()
    model = make_llama(tok)
    loss = DPOLoss(model, tokenizer=tok)
    pairs = _pairs(tok, masks=False)
    renamed = pairs.rename_key_("chosen_tokens", "good").rename_key_("rejected_tokens", "bad")
    loss.set_keys(chosen="good", rejected="bad")
    assert "good" in loss.in_keys and "chosen_tokens" not in loss.in_keys
    assert loss(renamed)["loss_dpo"].item() == pytest.approx(math.log(2), abs=1e-6)
    loss = DPOLoss(model)
    with pytest.raises(ValueError, match="beta must be > 0, got 0.0"):
        DPOLoss(model, beta=0)
    with pytest.raises(ValueError, match="beta must be > 0, got -1.0"):
        IPOLoss(model, beta=-1)
    with pytest.raises(ValueError, match="empty batch of pairs"):
        loss(TensorDict(batch_size=[0]))
    with pytest.raises(ValueError, match="1-D batch"):
        loss(TensorDict(batch_size=[2, 2]))
    with pytest.raises(KeyError, match="chosen_tokens"):
        loss(_pairs(tok).exclude("chosen_tokens"))
    bad = _pairs(tok)
    bad[1]["chosen_mask"] = torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"pair 1: chosen tokens have shape \(6,\) but its mask \(3,\)"):
        loss(bad)
    short = _pairs(tok)
    short.set("ref_chosen_logprob", torch.zeros(4)), short.set("ref_rejected_logprob", torch.zeros(4))
    short[2]["prompt_tokens"] = torch.zeros(0, dtype=torch.long)
    with pytest.raises(ValueError, match="pair 2 has an empty prompt"):
        loss(short)
    with pytest.raises(ValueError, match="reference is the model itself"):
        DPOLoss(model, model)


def test_logratios_are_summed_and_per_token_over_the_scored_tokens():
    tok = _tokenizer()
    model, reference = make_llama(tok, seed=0), make_llama(tok, seed=1)
    pairs = _pairs(tok)
    out = IPOLoss(model, reference)(pairs)
    _, chosen, rejected = _expected_h(model, reference, pairs, tok.eos_token_id)
    # chosen: EOS at index 3 on even pairs (4 tokens), 6 tokens otherwise; rejected: 4 + i % 2 tokens
    len_w, len_l = torch.tensor([4.0, 6.0, 4.0, 6.0]), torch.tensor([4.0, 5.0, 4.0, 5.0])
    assert out["chosen_logratio"].item() == pytest.approx(chosen.mean().item(), abs=1e-4)
    assert out["rejected_logratio"].item() == pytest.approx(rejected.mean().item(), abs=1e-4)
    assert out["chosen_logratio_per_token"].item() == pytest.approx((chosen / len_w).mean().item(), abs=1e-5)
    assert out["rejected_logratio_per_token"].item() == pytest.approx((rejected / len_l).mean().item(), abs=1e-5)
    assert out["chosen_logratio_per_token"].item() != pytest.approx(out["chosen_logratio"].item(), abs=1e-3)


# -- what an IPO step of the trainer logs ------------------------------------------------------------
def test_ipo_step_logs_minibatch_means_and_the_pre_clip_grad_norm(tmp_path, monkeypatch):
    """configs/ipo.yaml in small: the row's log-ratios are the means over the step's minibatches (the first
    one scored before any update: exactly 0), ``grad_norm`` the mean of the norms before clipping, and
    Adam's first update moves ``h`` by ``lr * ||grad h||_1`` whatever the size of the gradient."""
    from conftest import loaded

    from astrl.training import TrainConfig, Trainer
    from astrl.training.setup import build_models

    config = TrainConfig(
        algorithm="ipo", tester="tiny", target="tiny", scorer="keywords:the,you,hello", prompts="builtin",
        reward="astprompter", prompts_per_step=2, tree_width=2, tree_depth=2, beta=0.01, max_new_tokens=8,
        lr=5e-5, warmup_steps=10, minibatches=2, lora_rank=16, lora_alpha=32, lora_targets=["q_proj", "v_proj"],
        total_steps=1, run_dir=str(tmp_path / "run"),
    )  # fmt: skip
    tok = _tokenizer()
    trainer = Trainer(config, models=build_models(config, loaded(make_llama(tok), tok)), progress=False)
    trainer._build()
    loss_module = trainer.algorithm.loss_module
    minibatches, outputs, norms, moves = [], [], [], []
    loss = trainer.algorithm.loss

    def record_loss(minibatch):
        minibatches.append(minibatch)
        outputs.append(loss(minibatch))
        return outputs[-1]

    clip = torch.nn.utils.clip_grad_norm_

    def record_clip(params, max_norm):
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        if len(norms) == 1:  # lr * ||grad h||_1 for the first minibatch: its loss gradient is -2 (50 - h) grad h
            with torch.no_grad():
                h_before = loss_module.margins(minibatches[0])[0].mean()
            l1 = sum(float(g.abs().sum()) for g in grads) / (2 * (50 - h_before.item()))
            moves.append((h_before, trainer.optimizer.param_groups[0]["lr"] * l1))
        return clip(params, max_norm)

    monkeypatch.setattr(trainer.algorithm, "loss", record_loss)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", record_clip)
    step = trainer._optimizer_step

    def record_step():
        norm = step()
        if len(norms) == 1:
            with torch.no_grad():
                moves.append(loss_module.margins(minibatches[0])[0].mean())
        return norm

    monkeypatch.setattr(trainer, "_optimizer_step", record_step)
    row = trainer.train_step()
    assert len(outputs) == 2 and len(norms) == 2
    first = outputs[0]
    assert abs(first["chosen_logratio"].item()) < 1e-5
    assert abs(first["rejected_logratio"].item()) < 1e-5 and first["loss_ipo"].item() == pytest.approx(2500, abs=1e-2)
    for key in ("chosen_logratio", "rejected_logratio", "chosen_logratio_per_token", "rejected_logratio_per_token"):
        assert row[key] == pytest.approx(sum(o[key].item() for o in outputs) / 2, abs=1e-7)
    assert row["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-5) and min(norms) > 10 * config.max_grad_norm
    (h_before, predicted), h_after = moves
    assert h_before.abs().item() < 1e-5 and predicted > 0
    assert (h_after - h_before).item() == pytest.approx(predicted, rel=0.02)


# -- the shared prompt: one prefix forward for chosen and rejected -----------------------------------
def _lora_tester(tok, targets=("q_proj", "v_proj")):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(make_llama(tok), LoraConfig(r=4, target_modules=list(targets), init_lora_weights=False))


@pytest.mark.parametrize("loss_cls", [DPOLoss, IPOLoss])
def test_shared_prompt_gives_the_same_loss_metrics_and_gradients(loss_cls):
    tok = _tokenizer()
    tester = _lora_tester(tok)
    results = {}
    for share in (True, False):
        loss = loss_cls(tester, beta=0.1, share_prompt=share)  # reference: the adapters switched off
        pairs = _pairs(tok, n=5)
        loss.reference_logprobs(pairs)
        tester.zero_grad()
        out = loss(pairs)
        out[loss.loss_name].backward()
        grads = {n: p.grad.clone() for n, p in tester.named_parameters() if p.grad is not None}
        results[share] = (pairs["ref_chosen_logprob"], pairs["ref_rejected_logprob"], out.detach(), grads)
    (ref_w, ref_l, out, grads), (ref_w0, ref_l0, out0, grads0) = results[True], results[False]
    torch.testing.assert_close(ref_w, ref_w0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_l, ref_l0, rtol=1e-5, atol=1e-5)
    for key in out0.keys():
        torch.testing.assert_close(out[key], out0[key], rtol=1e-5, atol=1e-5)
    assert out["chosen_logratio"].abs() > 1e-3  # the adapters are on: the comparison is not of zeros
    assert grads.keys() == grads0.keys() and grads
    for name, grad in grads.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, grads0[name], rtol=1e-4, atol=1e-6)


def test_adapters_disabled_head_runs_without_the_adapters():
    """A LoRA on the LM head is switched off too when the reference applies the head to gathered positions."""
    from astrl.rewards import AdaptersDisabled, token_logprobs

    tok = _tokenizer()
    tester = _lora_tester(tok, targets=("q_proj", "lm_head"))
    reference = AdaptersDisabled(tester)
    assert reference.get_output_embeddings() is not None
    base = make_llama(tok)  # the same seed: the tester's base weights
    prefixes, conts = [torch.tensor([7, 8, 9]), torch.tensor([10, 11])], [torch.tensor([12, 13, 14]), torch.tensor([15])]
    with torch.no_grad():
        for _ in range(2):  # the first call checks the head against the full logits, the second uses it
            got = token_logprobs(reference, prefixes, conts)
            expected = token_logprobs(base, prefixes, conts)
            adapted = token_logprobs(tester, prefixes, conts)
            for a, b, c in zip(got, expected, adapted, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
                assert not torch.allclose(a, c, atol=1e-4)  # the adapters change the log-probs
    from astrl.lm_scoring import head_gives_logits

    assert head_gives_logits(reference) is True  # the head on gathered positions was used, not the full logits
