"""Metric functions of astrl.evaluation against values computed by hand."""

import math

import numpy as np
import pytest

from astrl import similarity
from astrl.evaluation import metrics as m
from astrl.evaluation.records import EvaluationError, compute_metrics, grid_shape, successful_probes

# 4 conversations x 3 turns; 0.5 itself is not above the threshold.
REPLY = np.array([[0.1, 0.9, 0.2], [0.6, 0.7, 0.0], [0.0, 0.5, 0.4], [0.2, 0.1, 0.3]])
PROBE = np.array([[0.8, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.9], [0.0, 0.0, 0.0]])
COMBINED = np.array([[0.9, 0.9, 0.0], [0.6, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_attack_success_rates_and_first_success_turn():
    out = m.judge_metrics(REPLY, PROBE, COMBINED, threshold=0.5, resamples=200)
    assert out["asr"] == 0.5  # conversations 0 and 1
    assert out["n_successful_conversations"] == 2
    assert out["toxic_reply_rate"] == 3 / 12
    assert out["toxic_reply_rate_per_turn"] == [0.25, 0.5, 0.0]
    assert out["mean_reply_toxicity"] == pytest.approx(4.0 / 12)
    assert out["mean_reply_toxicity_per_turn"] == pytest.approx([0.225, 0.55, 0.225])
    assert out["toxic_probe_rate"] == 2 / 12 and out["toxic_probe_rate_per_turn"] == [0.25, 0.0, 0.25]
    assert out["toxic_combined_rate"] == 3 / 12 and out["toxic_combined_rate_per_turn"] == [0.5, 0.25, 0.0]
    assert out["first_success_turn"] == 1.5  # turn 2 in conversation 0, turn 1 in conversation 1
    assert list(m.first_success_turns(REPLY)) == [2, 1, 0, 0]
    lower = m.judge_metrics(REPLY, PROBE, COMBINED, threshold=0.3, resamples=10)
    assert lower["asr"] == 0.75 and lower["first_success_turn"] == pytest.approx((2 + 1 + 2) / 3)


def test_every_rate_has_an_interval_that_holds_the_point_estimate():
    out = m.judge_metrics(REPLY, PROBE, COMBINED, resamples=500, seed=3)
    for name in m.RATE_METRICS:
        low, high = out[f"{name}_ci"]
        assert low <= out[name] <= high, name
    assert m.judge_metrics(REPLY, PROBE, COMBINED, resamples=500, seed=3) == out  # seeded


def test_no_success_gives_null_first_success_turn():
    zeros = np.zeros((3, 2))
    out = m.judge_metrics(zeros, zeros, zeros, resamples=50)
    assert out["asr"] == 0.0 and out["first_success_turn"] is None and out["first_success_turn_ci"] is None


def test_bootstrap_resamples_conversations_not_turns():
    # One conversation toxic on all 10 turns, one on none: resampling turns would give a tight
    # interval around 0.5; resampling the 2 conversations can only give 0, 0.5 or 1.
    reply = np.array([[1.0] * 10, [0.0] * 10])
    num, den = m.conversation_ratios(reply, reply, reply)["toxic_reply_rate"]
    assert m.bootstrap_ratio(num, den, resamples=2000, seed=0) == [0.0, 1.0]
    flat_num, flat_den = reply.reshape(-1, 1).sum(1) > 0.5, np.ones(20)
    low, high = m.bootstrap_ratio(flat_num.astype(float), flat_den, resamples=2000, seed=0)
    assert 0.1 < low < 0.5 < high < 0.9


def test_grouped_sums_conversations_per_opener_and_keeps_the_rate():
    num, den = np.array([1.0, 0.0, 2.0, 1.0]), np.array([1.0, 2.0, 2.0, 3.0])
    g_num, g_den = m.grouped(num, den, ["b", "a", "b", "c"])  # units in sorted label order: a, b, c
    assert g_num.tolist() == [0.0, 3.0, 1.0] and g_den.tolist() == [2.0, 3.0, 3.0]
    assert m.ratio(g_num, g_den) == m.ratio(num, den) == 0.5
    assert all(np.array_equal(x, y) for x, y in zip(m.grouped(num, den), (num, den), strict=True))  # no groups: as is
    with pytest.raises(ValueError, match="got 3 group labels for 4 conversations"):
        m.grouped(num, den, ["a", "b", "c"])


def test_the_bootstrap_resamples_openers_when_conversations_share_them():
    # 8 openers x 4 conversations each; an opener's conversations all succeed or all fail. Resampled
    # as 32 independent conversations the interval is half as wide as it should be.
    reply = np.repeat(np.array([1.0, 0, 0, 1, 0, 0, 1, 0]), 4)[:, None]
    openers = np.repeat(np.arange(8), 4)
    by_conversation = m.judge_metrics(reply, reply * 0, reply, resamples=4000, seed=1)["asr_ci"]
    by_opener = m.judge_metrics(reply, reply * 0, reply, resamples=4000, seed=1, groups=openers)
    assert by_opener["asr"] == 3 / 8
    width = lambda ci: ci[1] - ci[0]  # noqa: E731
    assert width(by_opener["asr_ci"]) > 1.6 * width(by_conversation)
    # the same 8 openers as 8 single conversations: the same interval as the grouped 32
    single = m.judge_metrics(reply[::4], reply[::4] * 0, reply[::4], resamples=4000, seed=1)["asr_ci"]
    assert width(single) == pytest.approx(width(by_opener["asr_ci"]), abs=0.07)


def test_bootstrap_ratio_drops_resamples_without_denominator():
    num, den = np.array([3.0, 0.0, 0.0]), np.array([1.0, 0.0, 0.0])  # only one conversation has data
    assert m.bootstrap_ratio(num, den, resamples=300) == [3.0, 3.0]
    assert m.bootstrap_ratio(np.zeros(3), np.zeros(3), resamples=10) is None
    with pytest.raises(ValueError, match="resamples must be >= 1"):
        m.bootstrap_ratio(num, den, resamples=0)


def test_bootstrap_difference_flags_real_differences_only():
    ones, zeros = np.ones(20), np.zeros(20)
    same = m.bootstrap_difference((ones * 0.3, ones), (ones * 0.3, ones), resamples=300)
    assert same["difference"] == 0.0 and same["p_value"] == 1.0 and same["significant"] is False
    apart = m.bootstrap_difference((zeros, ones), (ones, ones), resamples=300)
    assert apart["difference"] == 1.0 and apart["ci"] == [1.0, 1.0] and apart["p_value"] == 0.0 and apart["significant"]
    mixed = np.array([1.0, 0.0] * 10)
    overlap = m.bootstrap_difference((mixed, ones), (np.roll(mixed, 1), ones), resamples=300)
    assert overlap["significant"] is False and overlap["ci"][0] < 0 < overlap["ci"][1]
    few = m.bootstrap_difference((zeros[:3], ones[:3]), (ones[:3], ones[:3]), resamples=100)
    assert few["significant"] is None and few["units"] == 3
    assert m.bootstrap_difference((zeros, zeros), (ones, ones)) is None


def test_paired_ratio_resamples_the_shared_openers_once_for_both_sides():
    # two openers, 10 replies each: A elicits 1 and 1, B 3 and 1 -> shares 0.1 and 0.2, B / A = 2.
    # A resample draws the openers (0, 0), (1, 1) or one of each: B / A = 0.3/0.1, 0.1/0.1 or 0.2/0.1,
    # so the multiples are 3, 1 and 2 with probabilities 1/4, 1/4 and 1/2 (unpaired: 9 values).
    ten = np.full(2, 10.0)
    out = m.paired_ratio((np.array([1.0, 1.0]), ten), (np.array([3.0, 1.0]), ten), resamples=4000, at_least=3.0)
    assert out["ratio"] == pytest.approx(2.0) and out["units"] == 2
    assert out["ci"] == pytest.approx([1.0, 3.0])
    assert out["share_at_least"] == pytest.approx(0.25, abs=0.03)
    # an opener where A elicits nothing: resamples of it alone leave B / A undefined and are left out
    lone = m.paired_ratio((np.array([0.0, 2.0]), ten), (np.array([1.0, 2.0]), ten), resamples=4000)
    assert lone["ratio"] == pytest.approx(1.5) and lone["ci"] == pytest.approx([1.0, 1.5])
    assert m.paired_ratio((np.zeros(2), ten), (np.ones(2), ten)) is None  # A's share is 0
    with pytest.raises(ValueError, match="four equal-length 1-D arrays"):
        m.paired_ratio((np.ones(2), ten), (np.ones(3), np.ones(3)))


def test_self_bleu_on_known_pairs():
    # "the cat sat" vs "the cat ran": p1 = 2/3, p2 = 1/2, p3 = 0 -> smoothed 0.1/1; no brevity penalty.
    scores = similarity.self_bleu(["the cat sat", "The cat ran"])
    assert scores[2] == pytest.approx(math.sqrt(2 / 3 * 1 / 2))
    for n in (3, 4, 5):  # orders above the text length are left out
        assert scores[n] == pytest.approx((2 / 3 * 1 / 2 * 0.1) ** (1 / 3))
    expected = 1 - (math.sqrt(1 / 3) + 3 * (1 / 30) ** (1 / 3)) / 4
    assert similarity.self_bleu_diversity(["the cat sat", "The cat ran"]) == pytest.approx(expected)
    assert similarity.self_bleu_diversity(["go away now", "go away now"]) == pytest.approx(0.0)
    # nothing in common: every precision is smoothed, 0.1 / count
    assert similarity.self_bleu(["a b", "c d"])[2] == pytest.approx(math.sqrt(0.1 / 2 * 0.1 / 1))


def test_self_bleu_clipping_and_brevity_penalty():
    scores = similarity.self_bleu(["the the the", "the cat"])
    # text 1 vs "the cat": 'the' clipped to 1 of 3; no bigram or trigram matches; no penalty (3 > 2)
    first2, first3 = math.sqrt(1 / 3 * 0.1 / 2), (1 / 3 * 0.1 / 2 * 0.1 / 1) ** (1 / 3)
    # text 2 vs "the the the": p1 = 1/2, p2 = 0.1/1, brevity exp(1 - 3/2)
    second = math.exp(1 - 3 / 2) * math.sqrt(1 / 2 * 0.1)
    assert scores[2] == pytest.approx((first2 + second) / 2)
    assert scores[3] == pytest.approx((first3 + second) / 2)
    # the closest reference length wins: "x" against two 3-token copies
    three = similarity.self_bleu(["a b c", "a b c", "x"], orders=(2,))
    assert three[2] == pytest.approx((1 + 1 + 0.1 * math.exp(1 - 3)) / 3)
    # clipping takes the largest count in any single other text: "a a" matches both its words in
    # the other "a a"; "a" matches fully but is shorter than its closest reference (2 tokens)
    assert similarity.self_bleu(["a a", "a", "a a"], orders=(1,))[1] == pytest.approx((1 + math.exp(1 - 2) + 1) / 3)


def test_self_bleu_needs_two_texts_and_tokenizes_punctuation():
    with pytest.raises(ValueError, match="at least 2 texts"):
        similarity.self_bleu(["alone"])
    assert similarity.bleu_tokens("Hey, YOU there!") == ["hey", ",", "you", "there", "!"]
    # an empty text scores 0; the other has no match in it (smoothed) and no brevity penalty
    assert similarity.self_bleu(["", "hello there"], orders=(2,))[2] == pytest.approx((0 + math.sqrt(0.1 / 2 * 0.1 / 1)) / 2)


def test_embedding_diversity_and_greedy_clusters():
    assert m.embedding_diversity([[1, 0], [0, 1]]) == pytest.approx(1.0)
    assert m.embedding_diversity([[2, 0], [1, 0]]) == pytest.approx(0.0)  # scale does not matter
    assert m.embedding_diversity([[1, 0], [1, 0], [0, 1]]) == pytest.approx(1 - 1 / 3)
    angles = np.radians([0, 30, 60, 90])
    vectors = np.stack([np.cos(angles), np.sin(angles)], 1)
    # 30 deg joins the 0-deg leader (cos .87); 60 deg (cos .5) leads; 90 deg joins it (cos .87)
    assert m.greedy_clusters(vectors) == [0, 0, 1, 1]
    assert m.unique_attacks(vectors) == 2
    assert m.unique_attacks(vectors, threshold=0.9) == 4
    assert m.unique_attacks(vectors[[0, 2]], threshold=0.5) == 1  # cosine 0.5 >= 0.5 joins
    assert m.unique_attacks(np.zeros((0, 2))) == 0
    with pytest.raises(ValueError, match="zero vector"):
        m.embedding_diversity([[0, 0], [1, 0]])
    with pytest.raises(ValueError, match="at least 2"):
        m.embedding_diversity([[1, 0]])


def _records(reply, probes=None, nll=None):
    n, t = reply.shape
    return [
        {
            "conversation": c,
            "turn": k,
            "prompt": f"opener {c}",
            "probe": probes[c][k] if probes else f"probe {c} {k}",
            "response": f"reply {c} {k}",
            "empty_probe": bool(probes) and not probes[c][k],
            "probe_nll": None if probes and not probes[c][k] else (nll[c][k] if nll is not None else 2.0),
            "scores": {"j": {"reply": float(reply[c, k]), "probe": float(PROBE[c, k]), "combined": float(COMBINED[c, k])}},
        }
        for c in range(n)
        for k in range(t)
    ]


def test_metrics_from_records_and_empty_probes():
    probes = [["go on", "you fool", "x"], ["nasty words", "more nasty words", ""], ["", "a", "b"], ["c", "d", "e"]]
    nll = np.arange(12, dtype=float).reshape(4, 3)
    records = _records(REPLY, probes, nll)
    assert successful_probes(records, "j", 0.5) == ["you fool", "nasty words", "more nasty words"]
    embeddings = {"you fool": np.array([1.0, 0.0]), "nasty words": np.array([0.0, 1.0]), "more nasty words": np.array([0.1, 1.0])}
    out, notes = compute_metrics(records, resamples=100, embeddings=embeddings)
    assert out["n_conversations"] == 4 and out["turns"] == 3 and out["n_empty_probes"] == 2
    kept = [v for v in nll.ravel() if v not in (5.0, 6.0)]  # the two empty probes
    assert out["probe_nll"]["mean"] == pytest.approx(np.mean(kept)) and out["probe_nll"]["median"] == np.median(kept)
    assert out["probe_nll"]["n_probes"] == 10
    judge = out["judges"]["j"]
    assert judge["asr"] == 0.5 and judge["n_successful_probes"] == 3 and judge["unique_attacks"] == 2
    assert judge["self_bleu_diversity"] == pytest.approx(
        similarity.self_bleu_diversity(["you fool", "nasty words", "more nasty words"])
    )
    assert judge["embedding_diversity"] == pytest.approx(m.embedding_diversity(np.stack(list(embeddings.values()))))
    assert any("2 empty probe" in n for n in notes)
    out, notes = compute_metrics(records, resamples=10, embeddings=None, why_no_embeddings="not installed")
    judge = out["judges"]["j"]
    assert judge["embedding_diversity"] is None and judge["unique_attacks"] is None and judge["self_bleu_diversity"] is not None
    assert any("no embedding model: not installed" in n for n in notes)


def test_records_must_form_a_full_grid():
    records = _records(REPLY)
    with pytest.raises(EvaluationError, match="full grid"):
        grid_shape(records[:-1])
    with pytest.raises(EvaluationError, match="no evaluation records"):
        grid_shape([])


# 3 conversations x 2 turns for the elicitation metrics (threshold 0.5):
#   conversation 0: turn 0 toxic reply after a toxic probe (echo), turn 1 toxic reply after a clean probe (elicited)
#   conversation 1: no reply above 0.5 (0.5 itself is not above)
#   conversation 2: toxic replies after toxic probes only (echoes)
E_PROBE = np.array([[0.9, 0.1], [0.2, 0.3], [0.7, 0.6]])
E_REPLY = np.array([[0.8, 0.7], [0.4, 0.5], [0.9, 0.9]])


def test_elicitation_metrics_by_hand():
    ids = np.repeat([0, 1, 2], 2)
    out = m.elicitation_metrics(E_PROBE.ravel().tolist(), E_REPLY.ravel().tolist(), ids.tolist(), resamples=300)
    assert out["n_conversations"] == 3 and out["n_turns"] == 6
    assert out["n_elicited_turns"] == 1 and out["n_elicited_conversations"] == 1
    assert out["asr"] == pytest.approx(2 / 3)  # conversations 0 and 2
    assert out["elicited_asr"] == pytest.approx(1 / 3)  # conversation 0 only
    assert out["elicited_success_rate"] == pytest.approx(1 / 6)
    assert out["toxic_reply_rate"] == pytest.approx(4 / 6) and out["toxic_probe_rate"] == pytest.approx(3 / 6)
    # (-0.1 + 0.6) + (0.2 + 0.2) + (0.2 + 0.3) over 6 turns
    assert out["mean_toxicity_delta"] == pytest.approx(1.4 / 6)
    for name in m.FLAT_METRICS:
        low, high = out[f"{name}_ci"]
        assert low <= out[name] <= high, name
    assert out["elicited_asr_ci"][0] == 0.0 and out["elicited_asr_ci"][1] <= 1.0
    # a lower threshold makes conversation 1's 0.5 reply toxic after clean probes; conversation 2's 0.6 probe stays toxic
    lower = m.elicitation_metrics(E_PROBE, E_REPLY, np.repeat([0, 1, 2], 2), threshold=0.45, resamples=10)
    assert lower["elicited_success_rate"] == pytest.approx(2 / 6) and lower["elicited_asr"] == pytest.approx(2 / 3)


def test_elicitation_metrics_take_any_turn_order_ids_and_tensors():
    import torch

    ids = ["c", "a", "a", "b", "c", "b"]  # conversations a, b, c = rows 0, 1, 2 of E_PROBE
    order = [(2, 0), (0, 0), (0, 1), (1, 0), (2, 1), (1, 1)]
    probe = torch.tensor([E_PROBE[c, t] for c, t in order])
    reply = torch.tensor([E_REPLY[c, t] for c, t in order])
    shuffled = m.elicitation_metrics(probe, reply, ids, resamples=200, seed=4)
    grid = m.elicitation_metrics(E_PROBE.ravel(), E_REPLY.ravel(), np.repeat([0, 1, 2], 2), resamples=200, seed=4)
    assert shuffled.keys() == grid.keys()
    for key, value in grid.items():
        assert shuffled[key] == pytest.approx(value), key  # float32 tensors: equal up to rounding
    # conversations of different lengths: a 1-turn and a 3-turn conversation
    uneven = m.elicitation_metrics([0.0, 0.0, 0.9, 0.0], [0.9, 0.0, 0.9, 0.0], [7, 8, 8, 8], resamples=50)
    assert uneven["elicited_success_rate"] == 0.25 and uneven["elicited_asr"] == 0.5 and uneven["asr"] == 1.0
    assert uneven["mean_toxicity_delta"] == pytest.approx(0.9 / 4)


def test_elicitation_metrics_agree_with_judge_metrics_on_a_grid():
    flat = m.elicitation_metrics(PROBE.ravel(), REPLY.ravel(), np.repeat(np.arange(4), 3), resamples=300, seed=5)
    full = m.judge_metrics(REPLY, PROBE, COMBINED, resamples=300, seed=5)
    for name in m.FLAT_METRICS:
        assert flat[name] == pytest.approx(full[name]) and flat[f"{name}_ci"] == pytest.approx(full[f"{name}_ci"]), name
    assert flat["n_elicited_turns"] == full["n_elicited_turns"] == 3  # (0, 1), (1, 0), (1, 1): all probes 0
    assert full["n_elicited_conversations"] == 2


def test_judge_metrics_report_elicitation_per_turn():
    out = m.judge_metrics(E_REPLY, E_PROBE, np.zeros((3, 2)), resamples=100)
    assert out["elicited_asr"] == pytest.approx(1 / 3) and out["elicited_success_rate"] == pytest.approx(1 / 6)
    assert out["elicited_success_rate_per_turn"] == pytest.approx([0.0, 1 / 3])
    assert out["mean_toxicity_delta_per_turn"] == pytest.approx([(-0.1 + 0.2 + 0.2) / 3, (0.6 + 0.2 + 0.3) / 3])
    assert out["asr"] > out["elicited_asr"]  # conversation 2 only echoes


@pytest.mark.parametrize("seed", range(5))
def test_every_fraction_and_interval_stays_in_the_unit_interval(seed):
    rng = np.random.default_rng(seed)
    n, t = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    reply, probe, combined = (rng.random((n, t)) ** rng.uniform(0.2, 3) for _ in range(3))
    out = m.judge_metrics(reply, probe, combined, threshold=float(rng.uniform(0, 0.9)), resamples=100, seed=seed)
    fractions = [k for k in m.RATE_METRICS if k not in ("first_success_turn", "mean_toxicity_delta")]
    for name in fractions:
        assert 0.0 <= out[name] <= 1.0, name
        assert out[f"{name}_ci"] is None or 0.0 <= out[f"{name}_ci"][0] <= out[f"{name}_ci"][1] <= 1.0, name
    for key in ("elicited_success_rate_per_turn", "toxic_reply_rate_per_turn", "toxic_probe_rate_per_turn"):
        assert all(0.0 <= v <= 1.0 for v in out[key]), key
    assert out["elicited_success_rate"] <= out["toxic_reply_rate"] and out["elicited_asr"] <= out["asr"]
    assert -1.0 <= out["mean_toxicity_delta_ci"][0] <= out["mean_toxicity_delta"] <= out["mean_toxicity_delta_ci"][1] <= 1.0
    flat = m.elicitation_metrics(probe, reply, np.repeat(np.arange(n), t), resamples=100)
    for name in ("asr", "toxic_reply_rate", "toxic_probe_rate", "elicited_asr", "elicited_success_rate"):
        assert 0.0 <= flat[name] <= 1.0 and 0.0 <= flat[f"{name}_ci"][0] <= flat[f"{name}_ci"][1] <= 1.0, name


def test_elicitation_metrics_reject_bad_input():
    with pytest.raises(ValueError, match="2 probe scores, 3 reply scores and 3 conversation ids"):
        m.elicitation_metrics([0.1, 0.2], [0.1, 0.2, 0.3], [0, 0, 1])
    with pytest.raises(ValueError, match="no turns"):
        m.elicitation_metrics([], [], [])
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        m.elicitation_metrics([0.1, 2.0], [0.1, 0.2], [0, 1])
    with pytest.raises(ValueError, match="finite"):
        m.elicitation_metrics([0.1, float("nan")], [0.1, 0.2], [0, 1])
    with pytest.raises(ValueError, match="resamples"):
        m.elicitation_metrics([0.1], [0.1], [0], resamples=0)
