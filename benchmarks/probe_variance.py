"""Do the tester's probes differ in how often they elicit? Within-opener variance against sampling noise.

The untrained tester writes ``--probes`` probes for each of ``--openers`` training openers (GRPO's
groups: the red-team env with a ``PromptStream`` of ``group_size`` = probes), the target answers each
probe ``--replies`` times (``reply_samples``), and the judge scores every reply. For each opener, the
probes the judge does not call toxic get a toxic-reply rate over their replies. If the probes differed
in how often they elicit, the variance of those rates within an opener would exceed the variance
that sampling ``--replies`` replies alone gives, ``p(1 - p) / K`` at the mean rate p; if it does not,
the rate is the opener's and no reward, dense or not, ranks the probes of a group. Prints both
variances, the variance of the openers' mean rates and the per-opener rates as JSON.

    python benchmarks/probe_variance.py --quick      # 8 openers x 8 probes x 8 replies
    python benchmarks/probe_variance.py              # 24 openers x 8 probes x 8 replies (the docs' numbers)
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import base_parser, emit, r, setup

from astrl._compat import as_list
from astrl.envs import make_redteam_env
from astrl.keys import NEXT, PROBE, QUERY, REPLY_SCORES
from astrl.models import load_model
from astrl.policies import GenerationSettings, make_policy
from astrl.prompts import PromptStream, load_prompts, split_prompts
from astrl.scorers import make_scorer


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--openers", type=int, default=None, help="training openers (default 24; 8 with --quick)")
    parser.add_argument("--probes", type=int, default=8, help="probes per opener")
    parser.add_argument("--replies", type=int, default=8, help="replies per probe")
    parser.add_argument("--probe-tokens", type=int, default=6)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--judge", default="wordlist")
    args = parser.parse_args()
    info = setup(args)
    openers = args.openers or (8 if args.quick else 24)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    tester = make_policy(lm, GenerationSettings(args.probe_tokens), input_mode="text")
    target = make_policy(lm, GenerationSettings(args.reply_tokens), input_mode="text")
    judge = make_scorer(args.judge)
    prompts = split_prompts(load_prompts("rtp"), "train", seed=args.seed)
    stream = PromptStream(prompts, 2 * args.probes, seed=args.seed, group_size=args.probes)  # 2 openers a call
    env = make_redteam_env(
        tester, target, [judge], stream, batch_size=2 * args.probes, max_turns=1, mode="text", reply_samples=args.replies
    )
    rates: dict[str, list[float]] = {}
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(-(-openers // 2)):
            rollout = env.rollout(1, tester).reshape(-1)
            nxt = rollout[NEXT]
            toxic_probe = judge(as_list(nxt[PROBE])) > 0.5
            reply_rates = (nxt[REPLY_SCORES, judge.name] > 0.5).float().mean(-1)
            for opener, dirty, rate in zip(as_list(rollout[QUERY]), toxic_probe.tolist(), reply_rates.tolist(), strict=True):
                if not dirty:
                    rates.setdefault(opener, []).append(rate)
    seconds = time.perf_counter() - start
    groups = [v for v in rates.values() if len(v) >= 2][:openers]
    within = statistics.mean(statistics.pvariance(v) for v in groups)
    means = [statistics.mean(v) for v in groups]
    p = statistics.mean(means)
    emit(
        {
            "benchmark": "probe_variance",
            **info,
            "judge": judge.name,
            "openers": len(groups),
            "probes_per_opener": args.probes,
            "replies_per_probe": args.replies,
            "probe_tokens": args.probe_tokens,
            "reply_tokens": args.reply_tokens,
            "mean_rate": r(p),
            "within_opener_variance": r(within, 5),
            "sampling_variance": r(p * (1 - p) / args.replies, 5),
            "ratio_within_to_sampling": r(within / (p * (1 - p) / args.replies)) if 0 < p < 1 else None,
            "variance_of_opener_means": r(statistics.pvariance(means), 5),
            "opener_rates": [[r(x, 3) for x in v] for v in groups],
            "seconds": r(seconds),
        }
    )


if __name__ == "__main__":
    main()
