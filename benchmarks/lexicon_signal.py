"""How well one reply predicts a probe's elicitation rate: its sampled score against its lexicon estimate.

The untrained tester writes ``--probes`` one-turn probes on RealToxicityPrompts openers (the demo's
text-mode setting); the target answers each ``--replies`` times in the red-team env (``reply_samples``),
which also writes every reply's lexicon estimate (``target_lexicon``, 1 - prod_t (1 - m_t) from the
target's own logits) for the ``scorer`` lexicon (the target's vocabulary words the profanity scorer
alone scores above 0.9); from the same logits, the ``wordlist`` lexicon (the judge's own list). The
quantity to predict is each probe's
empirical toxic-reply rate over replies 2..K, under the training scorer (profanity) and under the
distinct judge (wordlist); the predictors are computed from reply 1 only:

* the training scorer's probability of reply 1 (the sampled reward of one reply),
* reply 1 judged toxic (score > 0.5),
* reply 1's lexicon estimate (each lexicon),
* for reference, the mean lexicon estimate over all K replies.

Prints Pearson correlations, the base rates and the timing as JSON.

    python benchmarks/lexicon_signal.py --quick      # 32 probes x 8 replies
    python benchmarks/lexicon_signal.py              # 128 probes x 8 replies
"""

from __future__ import annotations

import time

import torch
from _common import base_parser, emit, r, setup

from astrl.envs import make_redteam_env
from astrl.envs.transforms import clean_responses
from astrl.keys import REPLY_SCORES, TARGET_LEXICON
from astrl.models import load_model
from astrl.policies import GenerationSettings, make_policy
from astrl.prefill import turn_cache_of
from astrl.prompts import PromptStream, load_prompts, split_prompts
from astrl.rewards.lexicon import reply_lexicon
from astrl.scorers import make_scorer


def pearson(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Pearson's correlation, rounded; None when either side is constant."""
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    norm = float(a.norm() * b.norm())
    return r(float((a * b).sum()) / norm) if norm > 0 else None


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=None, help="probes (default 128; 32 with --quick)")
    parser.add_argument("--replies", type=int, default=8, help="replies sampled per probe (>= 2)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16, help="probes per env call")
    args = parser.parse_args()
    info = setup(args)
    probes = args.probes or (32 if args.quick else 128)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    generation = GenerationSettings(args.new_tokens)
    tester = make_policy(lm, generation, input_mode="text")
    target = make_policy(lm, generation, input_mode="text")
    scorers = {"profanity": make_scorer("profanity"), "wordlist": make_scorer("wordlist")}
    openers = PromptStream(split_prompts(load_prompts("rtp"), "train", seed=args.seed), args.batch, seed=args.seed)
    env = make_redteam_env(
        tester, target, scorers, openers, batch_size=args.batch, max_turns=1, mode="text", reward="elicit",
        reward_options={"lexicon": 1.0, "lexicon_source": "scorer"}, reply_samples=args.replies,
    )  # fmt: skip
    # the wordlist lexicon on the very same replies: an observer of the target's generate reads the same logits
    wordlist = reply_lexicon("wordlist", lm.tokenizer)
    second: list[torch.Tensor] = []

    def observe(out) -> None:
        if out.sequences.shape[0] != args.batch * args.replies:  # the tester's call (it shares the model), not the target's
            return
        steps = len(out.logits)
        mass = torch.stack([wordlist.mass(step) for step in out.logits], dim=1)
        _, _, mask = clean_responses(list(out.sequences[:, -steps:]), lm.tokenizer, steps)
        second.append(wordlist.estimate(mass, mask).reshape(-1, args.replies))

    turn_cache_of(target.model).observers.append(observe)
    samples = {name: [] for name in scorers}
    estimates = []
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(-(-probes // args.batch)):
            nxt = env.rollout(1, tester)["next"].reshape(-1)
            for name in scorers:
                samples[name].append(nxt[REPLY_SCORES, name])
            estimates.append(nxt[TARGET_LEXICON])
    seconds = time.perf_counter() - start
    training = torch.cat(samples["profanity"])[:probes]
    lexicons = {"scorer": torch.cat(estimates)[:probes], "wordlist": torch.cat(second)[:probes]}
    results = {}
    for judge in scorers:
        rest = (torch.cat(samples[judge])[:probes][:, 1:] > 0.5).float().mean(-1)  # the rate over replies 2..K
        row = {
            "mean_rate": r(float(rest.mean())),
            "one_reply_profanity_score": (pearson(training[:, 0], rest)),
            "one_reply_toxic_under_profanity": (pearson((training[:, 0] > 0.5).float(), rest)),
        }
        for source, values in lexicons.items():
            row[f"one_reply_lexicon_{source}"] = pearson(values[:, 0], rest)
            row[f"mean_lexicon_{source}_over_k"] = pearson(values.mean(-1), rest)
        results[f"rate_under_{judge}"] = row
    emit(
        {
            "benchmark": "lexicon_signal",
            **info,
            "probes": probes,
            "replies": args.replies,
            "new_tokens": args.new_tokens,
            "lexicon_words": {"scorer": len(env.reply_lexicon.words), "wordlist": len(wordlist.words)},
            "lexicon_tokens": {"scorer": len(env.reply_lexicon), "wordlist": len(wordlist)},
            "seconds": r(seconds),
            **results,
        }
    )


if __name__ == "__main__":
    main()
