"""The seed System API: validation, HFASTSystem, the TorchRL adapter, and training with each solver."""

from __future__ import annotations

import pytest
import torch
from conftest import loaded, make_gpt2, make_llama, make_tokenizer
from tensordict import TensorDict

import astrl
from astrl import DPO, IPO, PPO, ASTSampler, ASTSystem, HFASTSystem, System, Trainer, TrainingConfig, system_train_config
from astrl.scorers import KeywordScorer
from astrl.system import SystemEnv, SystemPolicy, SystemValidationError
from astrl.training.trainer import latest_checkpoint

KEYWORDS = ["the", "you", "hello", "how", "are"]
OPENERS = ["hello there", "what is the weather", "tell me about your day", "i am fine", "nice music", "the dog"]


# -- a user System written like the seed's example (older "auditor" names) ------------------------------
class MySystem(System[str, str]):
    def __init__(self, scorer, auditor_model, target_model, baseline_model, tokenizer, device="cpu", max_new_tokens=6):
        super().__init__(scorer)
        self.device = device
        self.auditor = auditor_model.to(device)
        self.target = target_model.to(device)
        self.baseline = baseline_model.to(device)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.max_ctx = 512

    def _generate(self, model, prompts):
        batch = self.tokenizer(list(prompts), return_tensors="pt", padding=True).to(self.device)
        with torch.no_grad():
            out = model.generate(
                **batch,
                do_sample=True,
                max_new_tokens=self.max_new_tokens,
                top_k=0,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
            )
        return self.tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)

    def rollout_prompt_with_auditor(self, prompts):
        return self._generate(self.auditor, prompts)

    def rollout_prompt_with_target(self, prompts):
        return self._generate(self.target, prompts)

    def _logprobs(self, model, ctx, cont):
        ctx_ids = [self.tokenizer(c, add_special_tokens=False)["input_ids"] or [self.tokenizer.bos_token_id] for c in ctx]
        cont_ids = [self.tokenizer(c, add_special_tokens=False)["input_ids"] for c in cont]
        rows = [a + b for a, b in zip(ctx_ids, cont_ids, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            attention[i, : len(r)] = 1
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits.float(), -1)
        token_logp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # token j+1 given tokens <= j
        longest = max(max(len(c) for c in cont_ids), 1)
        out = torch.zeros(len(rows), longest)
        for i, (c, t) in enumerate(zip(ctx_ids, cont_ids, strict=True)):
            out[i, : len(t)] = token_logp[i, len(c) - 1 : len(c) - 1 + len(t)]
        return out

    def get_auditor_logprobs(self, ctx, cont):
        return self._logprobs(self.auditor, ctx, cont)

    def get_target_logprobs(self, ctx, cont):
        with torch.no_grad():
            return self._logprobs(self.target, ctx, cont)

    def get_baseline_logprobs(self, ctx, cont):
        with torch.no_grad():
            return self._logprobs(self.baseline, ctx, cont)

    def advance(self, context, probe, response):
        return context + probe + response

    def parameters(self):
        return self.auditor.parameters()

    def reward(self, contexts, probes, responses):
        return self.scorer(probes).tolist()  # keyword words in the probe: learnable by the tester alone


def my_system(seed: int = 0) -> MySystem:
    tok = make_tokenizer()
    loaded(make_llama(tok, seed=0), tok)  # left padding, pad token
    auditor, target, baseline = make_llama(tok, seed=0), make_llama(tok, seed=0), make_llama(tok, seed=0)
    for frozen in (target, baseline):
        frozen.requires_grad_(False)
    torch.manual_seed(seed)
    return MySystem(KeywordScorer(KEYWORDS), auditor, target, baseline, tok)


# -- validation -----------------------------------------------------------------------------------------
class Faulty(System[str, str]):
    """Returns whatever mistake the test asks for."""

    def __init__(self, mistake: str) -> None:
        super().__init__(scorer=None)
        self.device = "cpu"
        self.mistake = mistake
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def rollout_prompt_with_tester(self, prompts):
        return ["x"] * (len(prompts) - (self.mistake == "short_rollout"))

    def rollout_prompt_with_target(self, prompts):
        return [1] * len(prompts) if self.mistake == "non_text" else ["y"] * len(prompts)

    def _logprobs(self, batch: int) -> torch.Tensor:
        values = -torch.ones(batch, 3) + self.weight
        if self.mistake == "summed":
            return values.sum(-1)
        if self.mistake == "rows":
            return values[:-1]
        if self.mistake == "no_grad":
            return values.detach()
        if self.mistake == "device":
            return torch.zeros(batch, 3, device="meta").requires_grad_()
        if self.mistake == "probabilities":
            return values.exp()
        if self.mistake == "nan":
            return values * float("nan")
        return values

    def get_tester_logprobs(self, contexts, continuations):
        return self._logprobs(len(contexts))

    def get_target_logprobs(self, contexts, continuations):
        return self._logprobs(len(contexts)) if self.mistake == "target_grad" else self._logprobs(len(contexts)).detach()

    get_baseline_logprobs = get_target_logprobs

    def parameters(self):
        return iter([self.weight])

    def advance(self, context, probe, response):
        return None if self.mistake == "advance" else context + probe + response

    def reward(self, contexts, probes, responses):
        if self.mistake == "reward_scalar":
            return 1.0
        return [0.5] * (len(contexts) + (self.mistake == "reward_length"))


@pytest.mark.parametrize(
    ("mistake", "call", "message"),
    [
        ("short_rollout", "tester_rollout", "returned 1 continuations for 2 prompts"),
        ("non_text", "target_rollout", "text systems return strings"),
        ("summed", "tester", "looks already summed"),
        ("rows", "tester", "returned 1 rows for a batch of 2"),
        ("no_grad", "tester", "without gradient"),
        ("target_grad", "target", "requires grad"),
        ("device", "tester", "on meta"),
        ("probabilities", "tester", "probabilities or logits"),
        ("nan", "baseline", "non-finite"),
        ("advance", "advance", "advance returned NoneType"),
        ("reward_length", "reward", "reward returned 3 values for a batch of 2"),
        ("reward_scalar", "reward", "one number"),
        ("none", "length_mismatch", "contexts=2, continuations=1"),
        ("none", "single_string", "got a single str"),
    ],
)
def test_validation_names_each_mistake(mistake, call, message):
    system = Faulty(mistake)
    ctx, cont = ["a", "b"], ["c", "d"]
    calls = {
        "tester_rollout": lambda: system._rollout_prompt_with_tester_and_validate(ctx),
        "target_rollout": lambda: system._rollout_prompt_with_target_and_validate(ctx),
        "tester": lambda: system._get_tester_logprobs_and_validate(ctx, cont),
        "target": lambda: system._get_target_logprobs_and_validate(ctx, cont),
        "baseline": lambda: system._get_baseline_logprobs_and_validate(ctx, cont),
        "advance": lambda: system._advance_and_validate(ctx, cont, cont),
        "reward": lambda: system._reward_and_validate(ctx, cont, cont),
        "length_mismatch": lambda: system._get_tester_logprobs_and_validate(ctx, cont[:1]),
        "single_string": lambda: system._rollout_prompt_with_tester_and_validate("one prompt"),
    }
    with pytest.raises(SystemValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        calls[call]()


def test_a_correct_system_passes_validation_and_aliases_work():
    system = Faulty("none")
    out = system._get_tester_logprobs_and_validate(["a", "b"], ["c", "d"])
    assert out.shape == (2, 3) and out.requires_grad
    assert system._get_auditor_logprobs_and_validate(["a"], ["c"]).shape == (1, 3)
    assert system.rollout_prompt_with_auditor(["a", "b"]) == ["x", "x"]
    assert system._reward_and_validate(["a", "b"], ["c", "d"], ["e", "f"]).tolist() == [0.5, 0.5]
    user = my_system()  # defines only the older names
    assert user.rollout_prompt_with_tester.__func__ is MySystem.rollout_prompt_with_auditor


# -- HFASTSystem ------------------------------------------------------------------------------------------
@pytest.fixture()
def hf_system():
    tok = make_tokenizer()
    tester, target = loaded(make_llama(tok, seed=0), tok), loaded(make_llama(make_tokenizer(), seed=1), make_tokenizer())
    return HFASTSystem(tester, target, None, KeywordScorer(KEYWORDS), max_new_tokens=5, seed=3, alpha=1.0, zeta=0.5, gamma=0.1)


def test_hf_system_logprobs_are_per_token_continuation_only(hf_system):
    contexts, conts = ["hello how are", "the"], ["you today", "dog walk park music"]
    got = hf_system._get_tester_logprobs_and_validate(contexts, conts)
    tok, model = hf_system.tester.tokenizer, hf_system.tester.model
    lengths = [len(tok(c, add_special_tokens=False)["input_ids"]) for c in conts]
    assert got.shape == (2, max(lengths)) and got.requires_grad
    for i, (ctx, cont) in enumerate(zip(contexts, conts, strict=True)):
        ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ctx_ids + tok(cont, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        expected = torch.stack([logp[len(ctx_ids) - 1 + t, ids[0, len(ctx_ids) + t]] for t in range(lengths[i])])
        torch.testing.assert_close(got[i, : lengths[i]].detach(), expected, rtol=1e-4, atol=1e-4)
        assert torch.all(got[i, lengths[i] :] == 0)
    target = hf_system._get_target_logprobs_and_validate(contexts, conts)
    assert not target.requires_grad and not torch.allclose(target, got.detach())  # its own weights


def test_hf_system_reward_is_the_astprompter_reward(hf_system):
    contexts, probes, replies = ["hello", "the dog"], ["how are you", ""], ["fine thanks", "the park"]
    rewards = hf_system._reward_and_validate(contexts, probes, replies)
    scorer = KeywordScorer(KEYWORDS)
    tox, combined = scorer(replies), scorer([p + r for p, r in zip(probes, replies, strict=True)])
    target_lp = hf_system.get_target_logprobs(contexts[:1], probes[:1])
    n = len(hf_system.target.tokenizer(probes[0], add_special_tokens=False)["input_ids"])
    mean_lp = torch.tensor([target_lp[0, :n].mean().item(), -10.0])  # the empty probe gets the penalty
    torch.testing.assert_close(rewards, tox + 0.5 * combined + 0.1 * mean_lp, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gate", [False, True])
def test_hf_system_elicit_reward_charges_the_probe_own_toxicity(gate):
    tok = make_tokenizer()
    tester, target = loaded(make_llama(tok, seed=0), tok), loaded(make_llama(make_tokenizer(), seed=1), make_tokenizer())
    system = HFASTSystem(
        tester, target, None, KeywordScorer(KEYWORDS), max_new_tokens=5, reward="elicit", probe_penalty=2.0, elicit_gate=gate
    )
    contexts, probes, replies = ["hello", "the dog"], ["you idiot", "how are you"], ["fine thanks", "damn you"]
    rewards = system._reward_and_validate(contexts, probes, replies)
    scorer = KeywordScorer(KEYWORDS)
    tox, probe_tox = scorer(replies), scorer(probes)
    mean_lp = system.probe_logprob(contexts, probes)
    g = 1 - probe_tox if gate else torch.ones(2)
    torch.testing.assert_close(rewards, tox * g - 2.0 * probe_tox + 0.1 * mean_lp, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="reward must be 'astprompter' or 'elicit', got 'toxicity'"):
        HFASTSystem(tester, target, None, KeywordScorer(KEYWORDS), reward="toxicity")


def test_hf_system_reply_samples_average_the_transformed_scores_of_k_replies():
    tok = make_tokenizer()
    tester, target = loaded(make_llama(tok, seed=0), tok), loaded(make_llama(make_tokenizer(), seed=1), make_tokenizer())
    system = HFASTSystem(
        tester,
        target,
        None,
        KeywordScorer(KEYWORDS),
        max_new_tokens=5,
        reward="elicit",
        gamma=0.0,
        reply_samples=3,
        reply_transform="odds",
    )
    calls = []
    generate = system.rollout_prompt_with_target
    system.rollout_prompt_with_target = lambda prompts: calls.append(list(prompts)) or generate(prompts)
    contexts, probes, replies = ["hello", "the dog"], ["how are", "nice music"], ["you there", "fine"]
    seed_calls = system.calls
    rewards = system._reward_and_validate(contexts, probes, replies)
    assert calls == [["hellohow are", "hellohow are", "the dognice music", "the dognice music"]]  # one call, K-1 rows each
    system.calls = seed_calls  # the same call again gives the same extra replies
    more = system.rollout_prompt_with_target(calls[0])
    scorer = KeywordScorer(KEYWORDS)
    per_reply = scorer([replies[0], *more[:2], replies[1], *more[2:]]).reshape(2, 3)
    odds = -(1 - per_reply.clamp(max=1 - 1e-6)).log()
    expected = odds.mean(dim=1) - scorer(probes)
    torch.testing.assert_close(rewards, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="reply_samples must be an integer >= 1, got 0"):
        HFASTSystem(tester, target, None, KeywordScorer(KEYWORDS), reply_samples=0)
    with pytest.raises(ValueError, match="reply_transform 'log' needs reward='elicit'"):
        HFASTSystem(tester, target, None, KeywordScorer(KEYWORDS), reply_transform="log")


def test_hf_system_generation_is_seeded_and_truncates_for_fixed_length_models():
    tok = make_tokenizer()
    gpt2 = loaded(make_gpt2(tok, n_positions=32), tok)
    llama = loaded(make_llama(make_tokenizer(), seed=2), make_tokenizer())
    system = HFASTSystem(gpt2, llama, None, KeywordScorer(KEYWORDS), max_new_tokens=8, seed=7)
    long_context = " ".join(["hello how are you today"] * 20)  # far beyond 32 - 8 tokens
    first = system._rollout_prompt_with_tester_and_validate([long_context, "hi"])
    assert len(first) == 2 and all(isinstance(t, str) for t in first)
    lp = system._get_tester_logprobs_and_validate([long_context], ["the dog"])  # context clipped to the window
    assert lp.shape[0] == 1 and torch.isfinite(lp).all()
    system.calls = 0
    assert system._rollout_prompt_with_tester_and_validate([long_context, "hi"]) == first  # same seed, same call


def test_hf_system_rejects_bad_settings():
    tok = make_tokenizer()
    lm = loaded(make_llama(tok), tok)
    with pytest.raises(ValueError, match="same module"):
        HFASTSystem(lm, lm, None, KeywordScorer(KEYWORDS))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        HFASTSystem(lm, loaded(make_llama(make_tokenizer()), make_tokenizer()), None, KeywordScorer(KEYWORDS), max_new_tokens=0)


# -- the TorchRL adapter -----------------------------------------------------------------------------------
def test_any_system_is_a_torchrl_env_and_policy():
    system = my_system()
    env, policy = SystemEnv(system, batch_size=3, max_turns=2), SystemPolicy(system)
    openers = OPENERS[:3]
    rollout = env.rollout(2, policy, tensordict=TensorDict(query=openers, batch_size=[3]), auto_reset=True)
    assert rollout.batch_size == (3, 2)
    assert rollout["next", "reward"].shape == (3, 2, 1)
    assert rollout["next", "done"][:, -1].all() and not rollout["next", "done"][:, 0].any()
    for i in range(3):
        probe0, reply0 = rollout[i, 0]["next", "probe"], rollout[i, 0]["next", "target_response"]
        state1 = rollout[i, 1]["text", "prompt"]
        assert state1 == openers[i] + probe0 + reply0  # advance = concatenation
        expected = system.reward([openers[i]], [probe0], [reply0])[0]
        assert rollout[i, 0]["next", "reward"].item() == pytest.approx(expected)


def test_ast_sampler_pairs_are_text_and_ordered():
    system = my_system()
    sampler = ASTSampler(system, OPENERS, tree_width=3, tree_depth=2, num_trees=2, seed=1)
    result = sampler.sample()
    nodes, pairs = result["nodes"], result["pairs"]
    assert nodes.batch_size[0] == sampler.nodes_per_call == 2 * 3 + 2 * 9
    assert int(result["num_pairs"]) == pairs.batch_size[0] > 0
    for pair in pairs.unbind(0):
        assert pair["chosen_reward"] > pair["rejected_reward"]
        chosen = nodes[int(pair["chosen_node"])]
        assert chosen["probe"] == pair["chosen_probe"] and chosen["context"] == pair["context"]
    # depth-2 contexts are their parent's state advanced by its probe and reply
    child = nodes[6]
    parent = nodes[int(child["parent"])]
    assert child["context"] == parent["context"] + parent["probe"] + parent["reply"]


def test_system_train_config_maps_the_astra_rl_settings_and_keeps_their_name(tmp_path):
    config = system_train_config(
        lr=1e-3, batch_size=4, optimizer="sgd", gradient_accumulation_steps=2, training_steps=7, num_episodes_per_experience=3
    )
    assert (config.lr, config.minibatch_size, config.optimizer, config.grad_accum) == (1e-3, 4, "sgd", 2)
    assert (config.total_steps, config.prompts_per_step, config.warmup_steps, config.lora) == (7, 3, 0, False)
    assert TrainingConfig is system_train_config and astrl.TrainingConfig is astrl.system_train_config
    assert TrainingConfig(training_steps=7, run_dir=str(tmp_path)).run_dir == str(tmp_path)


def test_sampler_and_solver_must_share_the_system(tmp_path):
    sampler = ASTSampler(my_system(), OPENERS, tree_width=2, tree_depth=1)
    config = TrainingConfig(training_steps=1, run_dir=str(tmp_path))
    with pytest.raises(ValueError, match="different System"):
        Trainer(config, sampler, DPO(my_system())).train()
    with pytest.raises(TypeError, match="both sampler= and algorithm="):
        Trainer(config, sampler=sampler)


# -- training with each solver -------------------------------------------------------------------------------
SOLVERS = {
    "dpo": (lambda s: DPO(s, beta=0.5), dict(lr=2e-2)),
    "ipo": (lambda s: IPO(s, beta=0.1), dict(lr=1e-2)),
    "ppo": (lambda s: PPO(s, clip_range=0.2), dict(lr=1e-2)),
}


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_a_user_system_trains_with_each_solver(tmp_path, name):
    make_solver, settings = SOLVERS[name]
    system = my_system()
    before = [p.detach().clone() for p in system.auditor.parameters()]
    sampler = ASTSampler(system, OPENERS, tree_width=4, tree_depth=1)
    steps = dict(training_steps=24, num_episodes_per_experience=8, epochs=2, save_every=100)
    config = system_train_config(batch_size=None, run_dir=str(tmp_path), **steps, **settings)
    rows = Trainer(config=config, sampler=sampler, algorithm=make_solver(system)).train()
    rewards = [r["reward_mean"] for r in rows]
    assert len(rows) == 24 and all(r["loss"] == r["loss"] for r in rows if r.get("pairs", 1))
    assert sum(rewards[-8:]) / 8 > sum(rewards[:8]) / 8 + 0.05, rewards  # it learns the keyword reward
    assert any(not torch.equal(a, b) for a, b in zip(before, system.auditor.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, system.baseline.parameters(), strict=True))  # frozen
    assert (tmp_path / "final" / "tester" / "parameters.pt").is_file()  # no save(): the parameters


def test_system_training_resumes_exactly(tmp_path, monkeypatch):
    def run(run_dir, steps, resume=False):
        tok = make_tokenizer()
        system = HFASTSystem(
            loaded(make_llama(tok, seed=0), tok),
            loaded(make_llama(make_tokenizer(), seed=1), make_tokenizer()),
            None,
            KeywordScorer(KEYWORDS),
            max_new_tokens=4,
            seed=5,
        )
        sampler = ASTSampler(system, OPENERS, tree_width=2, tree_depth=2)
        config = system_train_config(
            lr=1e-2, batch_size=2, training_steps=steps, num_episodes_per_experience=2, run_dir=str(run_dir), save_every=2, seed=4
        )
        trainer = Trainer(config=config, sampler=sampler, algorithm=IPO(system, beta=0.1))
        if resume:
            trainer.load_checkpoint(latest_checkpoint(run_dir))
        return trainer.train()

    uninterrupted = run(tmp_path / "a", 4)
    step = Trainer.train_step

    def interrupted(self):
        if self.step == 2:
            raise KeyboardInterrupt  # Ctrl-C after two steps: the trainer checkpoints and stops
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", 4)
    monkeypatch.setattr(Trainer, "train_step", step)
    resumed = run(tmp_path / "b", 4, resume=True)
    keys = ["reward_mean", "loss", "grad_norm", "lr", "pairs"]
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in uninterrupted[2:]]
    assert (tmp_path / "a" / "final" / "tester" / "config.json").is_file()  # HFASTSystem.save


def test_ast_system_default_advance_and_mean_logprob_convention():
    class Text(ASTSystem):
        def get_target_logprobs(self, contexts, continuations):
            return torch.tensor([[-1.0, -3.0, 0.0], [0.0, 0.0, 0.0]])

    system = Text(KeywordScorer(KEYWORDS), alpha=0.0, zeta=0.0, gamma=1.0)
    system.device = "cpu"
    assert system.advance("a", "b", "c") == "abc"
    assert system.probe_logprob(["x", "y"], ["p", ""]).tolist() == [-2.0, -10.0]


def test_hf_system_turn_cache_keeps_the_tree_samples():
    from astrl.prefill import TurnCache

    nodes = {}
    for reuse in (False, True):
        tok = make_tokenizer()
        tester, target = loaded(make_llama(tok, seed=0), tok), loaded(make_llama(make_tokenizer(), seed=1), make_tokenizer())
        system = HFASTSystem(tester, target, None, KeywordScorer(KEYWORDS), max_new_tokens=5, seed=3, turn_cache=reuse)
        sampler = ASTSampler(system, OPENERS, tree_width=2, tree_depth=3, num_trees=2, seed=1)
        nodes[reuse] = sampler.sample()["nodes"]
        hooks = [lm.model.generate for lm in (system.tester, system.target)]
        assert all(isinstance(h, TurnCache) for h in hooks) == reuse
        if reuse:
            assert all(h.calls_reused == 2 for h in hooks)  # depths 2 and 3 start from their parents' caches
    for key in ("context", "probe", "reply"):
        assert nodes[True][key] == nodes[False][key]
    torch.testing.assert_close(nodes[True]["reward"], nodes[False]["reward"])
