import pytest
import torch
from test_training import _config, _run_twice, _trainer
from test_tree_sampler import OPENERS, ConstantScorer, _policies, _tokenizers

from astrl._compat import as_list
from astrl.losses import IPOLoss
from astrl.ragged import as_rows
from astrl.rewards import response_mask
from astrl.sampling import PAIR_KEYS, TreeSampler, WeakSupervision
from astrl.scorers import KeywordScorer
from astrl.training import ConfigError, TrainConfig

HARMFUL = ["you idiot", "damn you", "hell hell bad dog you idiot damn hell you idiot bad bad"]  # the last one is cut


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def _sample(scorer=None, **kwargs):
    tester, target = _policies(max_new=5)
    sampler = TreeSampler(tester, target, [scorer or ConstantScorer()], OPENERS, num_trees=2, tree_depth=2, seed=1, **kwargs)
    return tester, sampler.sample()


def test_forced_pairs_put_the_harmful_text_on_the_chosen_side_as_a_tester_response():
    tester, result = _sample()  # a constant score: every group ties, so no sampled pair survives
    assert int(result["num_pairs"]) == 0
    tok = _tokenizers()[0]
    weak = WeakSupervision(HARMFUL, tok, probability=1.0, max_new_tokens=5, seed=0)
    pairs, forced = weak(result)
    groups, nodes = result["groups"], result["nodes"]
    assert forced == pairs.batch_size[0] == int(result["num_groups"]) == 2 * (1 + 2)  # trees x (1 + width) sibling groups
    assert set(PAIR_KEYS) | {"forced"} == set(pairs.keys())
    prompts, responses = as_rows(nodes.get("prompt_tokens", as_list=True)), as_rows(nodes.get("response_tokens", as_list=True))
    masks = as_rows(nodes.get("response_mask", as_list=True))
    texts = as_list(pairs["chosen_probe"])
    assert set(texts) <= set(HARMFUL) and len(set(texts)) > 1
    for i, pair in enumerate(pairs.unbind(0)):
        text, tokens, mask = texts[i], pair["chosen_tokens"], pair["chosen_mask"]
        expected = tok(text, add_special_tokens=False)["input_ids"][:4] + [tok.eos_token_id]
        assert tokens.tolist() == expected  # the text's own ids, cut to max_new_tokens - 1, then EOS
        assert mask.dtype == torch.bool and mask.all() and torch.equal(mask, response_mask(tokens, {tok.eos_token_id}))
        if text != HARMFUL[2]:
            assert tok.decode(tokens[:-1]) == text
        worst = int(groups["worst"][i])
        assert int(pair["rejected_node"]) == worst and int(pair["chosen_node"]) == -1 and bool(pair["forced"])
        assert torch.equal(pair["prompt_tokens"], prompts[worst])
        assert torch.equal(pair["rejected_tokens"], responses[worst]) and torch.equal(pair["rejected_mask"], masks[worst])
        assert pair["rejected_probe"] == as_list(nodes["probe"])[worst]
        assert torch.isnan(pair["chosen_reward"]) and torch.isnan(pair["reward_gap"])
        assert int(pair["depth"]) == int(groups["depth"][i]) and int(pair["tree"]) == int(groups["tree"][i])
    # the loss scores exactly the forced ids as the chosen response
    loss = IPOLoss(tester.model, beta=0.1, max_length=512)
    _, chosen, rejected = loss._pairs(pairs)
    assert [c.tolist() for c in chosen] == [t.tolist() for t in pairs.get("chosen_tokens", as_list=True)]
    assert [len(r) for r in rejected] == [int(m.sum()) for m in pairs.get("rejected_mask", as_list=True)]
    loss.reference_logprobs(pairs)
    out = loss(pairs)
    assert torch.isfinite(out["loss_ipo"]) and out["loss_ipo"].requires_grad


def test_the_batch_coin_is_seeded_and_resumes_exactly():
    _, result = _sample(scorer=KeywordScorer(["the", "you", "hello"]))
    tok = _tokenizers()[0]
    weak = WeakSupervision(HARMFUL, tok, probability=0.4, max_new_tokens=5, seed=3)

    def run(w, n):
        outs = [w(result) for _ in range(n)]
        return [(f, as_list(p["chosen_probe"]) if f else None) for p, f in outs]

    first = run(weak, 10)
    state = weak.state_dict()
    rest = run(weak, 20)
    restored = WeakSupervision(HARMFUL, tok, probability=0.4, max_new_tokens=5, seed=99)
    restored.load_state_dict(state)
    assert run(restored, 20) == rest
    flags = [f for f, _ in first + rest]
    assert 0 < sum(f > 0 for f in flags) < len(flags)  # some batches forced, some not
    assert all(p is result["pairs"] for p, f in (weak(result) for _ in range(3)) if f == 0)  # unforced: untouched
    never = WeakSupervision(HARMFUL, tok, probability=0.0, max_new_tokens=5)
    assert all(never(result)[1] == 0 for _ in range(20)) and never.batches == 20 and never.forced_batches == 0


def test_bad_weak_supervision_settings_name_the_value():
    tok = _tokenizers()[0]
    with pytest.raises(ValueError, match=r"probability must be in \[0, 1\], got 1.5"):
        WeakSupervision(HARMFUL, tok, probability=1.5, max_new_tokens=5)
    with pytest.raises(ValueError, match="at least one non-empty"):
        WeakSupervision(["", "  "], tok, probability=0.5, max_new_tokens=5)
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 2 \(a token and the EOS\), got 1"):
        WeakSupervision(HARMFUL, tok, probability=0.5, max_new_tokens=1)
    with pytest.raises(KeyError, match="generator"):
        WeakSupervision(HARMFUL, tok, probability=0.5, max_new_tokens=5).load_state_dict({"batches": 0})
    with pytest.raises(ConfigError, match="weak_supervision must be in \\[0, 1\\], got 2.0"):
        TrainConfig(algorithm="ipo", weak_supervision=2.0)
    with pytest.raises(ConfigError, match="weak_supervision needs algorithm dpo or ipo, got 'grpo'"):
        TrainConfig(algorithm="grpo", weak_supervision=0.5)


def _harmful_file(tmp_path):
    path = tmp_path / "harmful.txt"
    path.write_text("\n".join(HARMFUL) + "\n")
    return str(path)


def test_ipo_training_logs_forced_pairs_and_resumes_exactly(tmp_path, monkeypatch):
    settings = dict(
        algorithm="ipo",
        reward="astprompter",
        total_steps=4,
        save_every=100,
        prompts_per_step=2,
        tree_width=2,
        tree_depth=1,
        beta=0.1,
        lr=1e-2,
        weak_supervision=0.5,  # with seed 0 the coin forces steps 1, 2, 3 and not step 4
        weak_supervision_prompts=_harmful_file(tmp_path),
    )
    rows, uninterrupted, after = _run_twice(tmp_path, monkeypatch, 2, **settings)
    assert [r["pairs_forced"] for r in rows] == [2, 2, 2, 0]  # 2 groups per step: all forced or none
    keys = ["reward_mean", "loss", "loss_ipo", "pairs", "pairs_forced", "grad_norm", "lr"]
    assert [{k: r[k] for k in keys} for r in after] == [{k: r[k] for k in keys} for r in uninterrupted]


def test_forced_pairs_teach_the_tester_the_harmful_text(tmp_path):
    # every batch forced with one text: its log-prob under the tester must rise well above the start
    config = _config(
        tmp_path,
        algorithm="dpo",
        total_steps=6,
        save_every=100,
        prompts_per_step=2,
        tree_width=2,
        tree_depth=1,
        beta=0.5,
        lr=1e-2,
        lora=False,
        turns=1,
        weak_supervision=1.0,
        weak_supervision_prompts=_harmful_file(tmp_path).replace("harmful", "one"),
    )
    (tmp_path / "one.txt").write_text("damn you idiot\n")
    trainer = _trainer(config)
    trainer._build()
    weak = trainer.algorithm.weak
    tester = trainer.models.tester

    def logprob() -> float:
        from astrl.lm_scoring import token_logprobs

        chat = [{"role": "user", "content": "hello"}]
        text = tester.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompt = torch.tensor(tester.tokenizer(text, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            return float(token_logprobs(tester.model, [prompt.reshape(-1)], weak.tokenize(["damn you idiot"]))[0].sum())

    before = logprob()
    rows = trainer.train()
    assert all(r["pairs_forced"] == 2 for r in rows)
    assert logprob() > before + 1.0


def test_elicitation_forces_only_texts_that_are_clean_under_the_reward_scorer(tmp_path):
    tok = _tokenizers()[0]
    scorer = KeywordScorer(["idiot", "damn"])
    source = _harmful_file(tmp_path)
    kept = WeakSupervision.from_source(source, tok, clean_under=scorer, threshold=0.25, probability=1.0, max_new_tokens=5)
    # "you idiot" (0.5) and "damn you" (0.5) are toxic themselves; the long text scores 3/13 <= 0.25
    assert kept.texts == [HARMFUL[2]]
    assert WeakSupervision.from_source(source, tok, probability=1.0, max_new_tokens=5).texts == HARMFUL
    with pytest.raises(ValueError, match="no text of .* scores <= 0.1 under 'keywords:damn,idiot'"):
        WeakSupervision.from_source(source, tok, clean_under=scorer, threshold=0.1, probability=1.0, max_new_tokens=5)
    # a run with the elicitation reward filters with its reward scorer
    config = _config(
        tmp_path,
        algorithm="ipo",
        reward="elicit",
        scorer="keywords:idiot,damn,you",  # 1.0, 1.0 and 5/13 on the three texts
        weak_supervision=1.0,
        weak_supervision_prompts=source,
        tree_width=2,
        tree_depth=1,
    )
    trainer = _trainer(config)
    trainer._build()
    assert trainer.algorithm.weak.texts == [HARMFUL[2]]
