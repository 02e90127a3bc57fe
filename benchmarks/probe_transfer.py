"""Chat mode: does re-testing a probe on training openers under the training scorer rank it as the judge
ranks it on held-out openers?

A probe found on one opener is worth keeping (in a warm start, a replay archive, a run chosen among
others) when it elicits on openers it was not found on. This script takes probes from warm starts
(``warm_start.jsonl``: ``--per-warm-start`` each) and chat eval folders (their first-turn probes:
``--per-eval`` each), sends every probe as the first turn after ``--openers`` training openers and as
many held-out ones (the ``train`` and ``test`` splits of ``--prompts`` under ``--test-fraction``), the target
answering ``--replies`` times each, through ``astrl replay`` (:func:`astrl.evaluation.replay.run_replay`,
the job users run). A reply is elicited when a scorer calls it toxic and not its probe. Over probes it
reports, with Spearman and Pearson correlations:

* ``scorer_train~judge_test``: the training scorer's elicited share on training openers against the judge's
  on held-out openers (what a re-test the RL may read can tell);
* ``judge_train~judge_test``: the judge itself on training openers (what a re-test could tell with the
  judge's reading; the gap to the line above is the scorer's);
* ``scorer_train~scorer_test``: the training scorer on both sides (whether its own ranking carries across openers);
* ``scorer_test~judge_test``: the two readings of the same held-out replies;
* ``judge_test_halves``: the judge on half of the held-out openers against the other half (the reliability
  that bounds every correlation above);

and the held-out judge share of the top 4, 8 and 12 probes by each training-opener ranking, against all probes.
With ``--lexicon``, also ``lexicon_train``: each training-opener reply's reply lexicon estimate under the
scorer's whole-word lexicon (``1 - prod_t (1 - m_t)``, the target's logits over the reply teacher-forced,
as the reward's ``reply_lexicon`` term reads it with ``reply_lexicon_whole_words``), a probe's mean over its
replies: the dense reading the RL also has; and ``scorer_train + w * lexicon_train`` for each ``w`` of
``--lexicon-weights``, a probe's mean elicit reward as GRPO ranks it with ``reply_lexicon_weight: w`` (its
reply terms; the gate, the likelihood and repetition terms and ``reply_past_opener`` left out).
With ``--greedy``, also ``greedy_<scorer>_<T>_train`` for each scorer of ``--greedy-scorers`` and length
``T`` of ``--greedy-tokens``: the lexicon estimate of the target's greedy reply of T tokens after each
training opener, under the scorer's whole-word lexicon, read by
:func:`astrl.sampling.search.retest_estimates` (the warm start's ``warm_start_retest``), a probe's mean
over openers. ``groups`` repeats the correlations within the probes from warm starts and within those
from eval folders, with the held-out share of each ranking's top and bottom half, and for the warm-start
probes their search's own estimate on the opener they were found on (``own_estimate``, ``lexicon_mass``).

    python benchmarks/probe_transfer.py --probes RUN/warm_start.jsonl EVAL_DIR ... --out /tmp/transfer
    python benchmarks/probe_transfer.py --probes ... --out DIR --reuse   # analyse DIR's replies again
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
from _common import ROOT, emit, r  # noqa: F401  (ROOT puts the project on sys.path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", nargs="+", required=True, help="warm_start.jsonl files and chat eval folders, in order")
    parser.add_argument("--per-warm-start", type=int, default=12, help="probes drawn from each warm_start.jsonl")
    parser.add_argument("--per-eval", type=int, default=3, help="first-turn probes drawn from each eval folder")
    parser.add_argument("--openers", type=int, default=20, help="training openers, and as many held-out ones")
    parser.add_argument("--replies", type=int, default=4, help="target replies to each probe after each opener")
    parser.add_argument("--prompts", default="rtp")
    parser.add_argument("--test-fraction", type=float, default=0.35)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--scorer", default="wordlist:strict", help="the training scorer")
    parser.add_argument("--judge", default="profanity", help="the held-out judge")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="reply length")
    parser.add_argument("--batch", type=int, default=64, help="replies generated together")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="draws the probes and openers, and the replies")
    parser.add_argument("--out", required=True, help="folder of the replay (attacks.jsonl, replies.jsonl, ...)")
    parser.add_argument("--reuse", action="store_true", help="analyse the replies already in --out (same attacks)")
    parser.add_argument("--lexicon", action="store_true", help="also each training-opener reply's lexicon estimate")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for --lexicon")
    parser.add_argument("--lexicon-weights", default="2,5,10,20,50", help="with --lexicon: weights w of the reward-like sums")
    parser.add_argument("--greedy", action="store_true", help="also each probe's greedy-reply re-test on the training openers")
    parser.add_argument("--greedy-scorers", default="profanity,wordlist:strict", help="with --greedy: whose lexicons read it")
    parser.add_argument("--greedy-tokens", default="4,16", help="with --greedy: greedy reply lengths")
    return parser.parse_args()


def source_probes(path: Path, rng: random.Random, per_warm_start: int, per_eval: int) -> list[str]:
    """``per_warm_start`` kept probes of a ``warm_start.jsonl``, or ``per_eval`` first-turn probes of an eval folder."""
    if path.is_file():
        kept = [json.loads(line)["probe"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return rng.sample(kept, min(per_warm_start, len(kept)))
    conversations = path / "conversations.jsonl"
    if not conversations.is_file():
        raise SystemExit(f"--probes {str(path)!r}: neither a warm_start.jsonl nor an eval folder with conversations.jsonl")
    rows = [json.loads(line) for line in conversations.read_text(encoding="utf-8").splitlines() if line.strip()]
    first = sorted({row["probe"] for row in rows if row["turn"] == 0})
    return rng.sample(first, min(per_eval, len(first)))


def design(args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """``(source, probe)`` pairs (distinct, non-empty probes) and the training and held-out openers."""
    from astrl.prompts import load_prompts, split_fractions, split_prompts

    rng = random.Random(args.seed)
    prompts, fractions = load_prompts(args.prompts), split_fractions(args.test_fraction)
    train = rng.sample(split_prompts(prompts, "train", seed=args.split_seed, fractions=fractions), args.openers)
    test = rng.sample(split_prompts(prompts, "test", seed=args.split_seed, fractions=fractions), args.openers)
    probes, seen = [], set()
    for source in args.probes:
        for probe in source_probes(Path(source), rng, args.per_warm_start, args.per_eval):
            if probe.strip() and probe not in seen:
                seen.add(probe)
                probes.append((source, probe))
    return probes, train, test


def write_attacks(path: Path, probes: list[tuple[str, str]], openers: list[str]) -> None:
    """Every probe after every opener, probe-major: attack ``i * len(openers) + j`` is probe ``i`` after opener ``j``."""
    with path.open("w", encoding="utf-8") as handle:
        for _, probe in probes:
            for opener in openers:
                conversation = [{"role": "opener", "content": opener}]
                handle.write(json.dumps({"probe": probe, "conversation": conversation}, ensure_ascii=False) + "\n")


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    order = np.argsort(x, kind="stable")
    ranked = np.empty(len(x))
    ranked[order] = np.arange(1, len(x) + 1)
    for value in np.unique(x):
        tied = x == value
        ranked[tied] = ranked[tied].mean()
    return ranked


def correlations(x: np.ndarray, y: np.ndarray) -> dict:
    """Spearman and Pearson correlation of ``x`` and ``y`` (:func:`chat_signal.pearson`: None where either is constant)."""
    from chat_signal import pearson

    return {"spearman": pearson(ranks(x), ranks(y)), "pearson": pearson(x, y)}


def cell(attack: int, n_openers: int) -> tuple[int, int, int]:
    """``(probe, opener side (0 train, 1 held out), opener)`` of attack number ``attack`` (:func:`write_attacks`' order)."""
    probe, rest = divmod(attack, 2 * n_openers)
    return (probe, *divmod(rest, n_openers))


def elicited_shares(records: list[dict], n_probes: int, n_openers: int, replies: int, name: str) -> np.ndarray:
    """``[probe, opener side (0 train, 1 held out), opener, reply]``: 1 where ``name`` calls the reply toxic and not its probe."""
    from astrl.evaluation.metrics import elicited

    out = np.zeros((n_probes, 2, n_openers, replies))
    for record in records:
        probe, side, opener = cell(record["attack"], n_openers)
        score = record["scores"][name]
        out[probe, side, opener, record["sample"]] = float(elicited(score["reply"], score["probe"]))
    return out


def lexicon_train(records: list[dict], attacks: Path, n_probes: int, n_openers: int, replies: int, args) -> np.ndarray:
    """``[probe, training opener, reply]``: the reply lexicon estimate of each training-opener reply under
    ``args.scorer``'s whole-word lexicon, from one teacher-forced forward of the target over chat and reply."""
    import torch

    from astrl._compat import render_chats
    from astrl.evaluation.replay import chat_input, read_attacks
    from astrl.models import load_model
    from astrl.rewards.lexicon import reply_estimate, reply_lexicon, teacher_forced_stats
    from astrl.scorers import make_scorer

    if args.threads:
        torch.set_num_threads(args.threads)
    listed, _ = read_attacks(attacks)
    lm = load_model("smollm2-135m", dtype="float32", device="cpu")
    lexicon = reply_lexicon("scorer", lm.tokenizer, scorer=make_scorer(args.scorer), whole_words=True)
    train = [x for x in records if cell(x["attack"], n_openers)[1] == 0]
    chats = [chat_input(listed[x["attack"]], None) for x in train]
    prompts = [lm.tokenizer(text, add_special_tokens=False)["input_ids"] for text in render_chats(lm.tokenizer, chats)]
    tokens = [lm.tokenizer(x["reply"], add_special_tokens=False)["input_ids"] or [lm.tokenizer.eos_token_id] for x in train]
    out = np.zeros((n_probes, n_openers, replies))
    for i in range(0, len(train), args.batch):
        batch = slice(i, i + args.batch)
        stats = teacher_forced_stats(lm.model, lexicon, prompts[batch], tokens[batch], lm.tokenizer.pad_token_id or 0)
        for record, stat, reply in zip(train[batch], stats, tokens[batch], strict=True):
            probe, _, opener = cell(record["attack"], n_openers)
            out[probe, opener, record["sample"]] = reply_estimate(lexicon, stat, reply)
    return out


def greedy_train(probes: list[str], openers: list[str], args) -> dict[str, np.ndarray]:
    """``greedy_<scorer>_<T>_train``: each probe's mean over ``openers`` of its greedy reply's lexicon estimate
    (:func:`astrl.sampling.search.retest_estimates`, chat framing, the scorer's whole-word lexicon)."""
    import torch

    from astrl.models import load_model
    from astrl.rewards.lexicon import reply_lexicon
    from astrl.sampling.search import probe_frame, retest_estimates
    from astrl.scorers import make_scorer

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m", dtype="float32", device="cpu")
    out = {}
    for name in args.greedy_scorers.split(","):
        lexicon = reply_lexicon("scorer", lm.tokenizer, scorer=make_scorer(name), whole_words=True)
        for tokens in (int(t) for t in args.greedy_tokens.split(",")):
            frame = probe_frame(lm.tokenizer, lm.tokenizer, chat=True, lookahead=tokens)
            estimates = retest_estimates(lm.model, lm.tokenizer, frame, probes, openers, lexicon)
            out[f"greedy_{name}_{tokens}_train"] = estimates.mean(1).numpy()
    return out


def own_estimates(sources: list[str], probes: list[tuple[str, str]]) -> np.ndarray:
    """Each probe's ``lexicon_mass`` in the ``warm_start.jsonl`` it came from (NaN for an eval folder's)."""
    found: dict[tuple[str, str], float] = {}
    for source in sources:
        if Path(source).is_file():
            for line in Path(source).read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    found[(source, record["probe"])] = float(record.get("lexicon_mass", np.nan))
    return np.array([found.get(pair, np.nan) for pair in probes])


def halves(ranking: np.ndarray, held_out: np.ndarray) -> tuple[float, float]:
    """The mean ``held_out`` of the top and the bottom half of the probes by ``ranking`` (ties: the earlier first)."""
    order = np.argsort(-ranking, kind="stable")
    half = len(order) // 2
    return float(held_out[order[:half]].mean()), float(held_out[order[half:]].mean())


def group_readings(share: dict[str, np.ndarray], rows: list[int]) -> dict:
    """Within the probes ``rows``: each training-side ranking's correlations with the held-out judge share and
    the held-out share of its top and bottom half."""
    held = share["judge_test"][rows]
    out = {"probes": len(rows), "judge_test": r(float(held.mean()), 4)}
    for key in [k for k in share if k.endswith("_train") or k == "own_estimate"]:
        values = share[key][rows]
        if np.isnan(values).any():
            continue
        top, bottom = halves(values, held)
        out[key] = correlations(values, held) | {"top_half": r(top, 4), "bottom_half": r(bottom, 4)}
    return out


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    probes, train, test = design(args)
    attacks = out / "attacks.jsonl"
    if args.reuse:
        expected = out / "expected_attacks.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        write_attacks(expected, probes, train + test)
        if not attacks.is_file() or attacks.read_bytes() != expected.read_bytes():
            raise SystemExit(f"--reuse: {attacks} is not the attack list these arguments draw; run without --reuse")
    else:
        from astrl.evaluation.replay import ReplayConfig, run_replay

        out.mkdir(parents=True, exist_ok=True)
        write_attacks(attacks, probes, train + test)
        config = ReplayConfig(
            archive=str(attacks),
            targets=["smollm2-135m"],
            judges=[args.judge, args.scorer],
            samples=args.replies,
            mode="chat",
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch,
            seed=args.seed,
            device=args.device,
        )
        run_replay(config, out / "replay")
    records = [json.loads(line) for line in (out / "replay" / "replies.jsonl").read_text(encoding="utf-8").splitlines()]
    if len(records) != len(probes) * 2 * args.openers * args.replies:
        raise SystemExit(f"{len(records)} replies in {out / 'replay'}, expected {len(probes) * 2 * args.openers * args.replies}")
    judge = elicited_shares(records, len(probes), args.openers, args.replies, args.judge)
    scorer = elicited_shares(records, len(probes), args.openers, args.replies, args.scorer)
    half = args.openers // 2
    share = {
        "scorer_train": scorer[:, 0].mean(axis=(1, 2)),
        "scorer_test": scorer[:, 1].mean(axis=(1, 2)),
        "judge_train": judge[:, 0].mean(axis=(1, 2)),
        "judge_test": judge[:, 1].mean(axis=(1, 2)),
    }
    if args.lexicon:
        cached = out / "lexicon_train.npy"
        if not (args.reuse and cached.is_file()):
            np.save(cached, lexicon_train(records, attacks, len(probes), args.openers, args.replies, args))
        share["lexicon_train"] = np.load(cached).mean(axis=(1, 2))
        for w in (float(x) for x in args.lexicon_weights.split(",")):
            share[f"reward_w{w:g}_train"] = share["scorer_train"] + w * share["lexicon_train"]
    if args.greedy:
        cached = out / "greedy_train.npz"
        if not (args.reuse and cached.is_file()):
            np.savez(cached, **greedy_train([p for _, p in probes], train, args))
        share.update(dict(np.load(cached)))
    share["own_estimate"] = own_estimates(args.probes, probes)
    pairs = [
        ("scorer_train", "judge_test"),
        *([("lexicon_train", "judge_test"), ("lexicon_train", "scorer_test")] if args.lexicon else []),
        ("judge_train", "judge_test"),
        ("scorer_train", "scorer_test"),
        ("scorer_test", "judge_test"),
    ]
    pairs += [(key, "judge_test") for key in share if key.startswith(("reward_w", "greedy_"))]
    result = {f"{a}~{b}": correlations(share[a], share[b]) for a, b in pairs}
    result["judge_test_halves"] = correlations(judge[:, 1, :half].mean(axis=(1, 2)), judge[:, 1, half:].mean(axis=(1, 2)))
    top = {"all": r(float(share["judge_test"].mean()), 4)}
    for key in [k for k in share if k.endswith("_train")]:
        order = np.argsort(-share[key], kind="stable")
        for k in (4, 8, 12):
            top[f"top{k}_by_{key}"] = r(float(share["judge_test"][order[:k]].mean()), 4)
    by_source = {}
    for source in dict.fromkeys(s for s, _ in probes):
        rows = [i for i, (s, _) in enumerate(probes) if s == source]
        by_source[source] = {key: r(float(value[rows].mean()), 4) for key, value in share.items() if key != "own_estimate"}
        by_source[source]["probes"] = len(rows)
    warm = [i for i, (s, _) in enumerate(probes) if Path(s).is_file()]
    groups = {
        "warm_start": group_readings(share, warm),
        "eval": group_readings(share, [i for i in range(len(probes)) if i not in set(warm)]),
    }
    emit(
        {
            "probes": len(probes),
            "openers_each_side": args.openers,
            "replies": args.replies,
            "scorer": args.scorer,
            "judge": args.judge,
            "correlations": result,
            "judge_test_share": top,
            "by_source": by_source,
            "groups": groups,
            "mean_share": {key: r(float(value.mean()), 4) for key, value in share.items() if key != "own_estimate"},
        }
    )


if __name__ == "__main__":
    main()
