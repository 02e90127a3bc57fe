"""`astrl replay` (attack transfer across targets) and judge agreement, on tiny models."""

import base64
import json
import re

import numpy as np
import pytest
from conftest import PNG_MAGIC, make_tokenizer

from astrl.cli import main
from astrl.evaluation import metrics as m
from astrl.evaluation.agreement import judge_agreement
from astrl.evaluation.replay import (
    ReplayAttack,
    ReplayConfig,
    chat_input,
    generate_replies,
    parse_target,
    text_input,
    transfer_metrics,
    transfer_sets,
)
from astrl.scorers import make_scorer

JUDGE_A = "keywords:the,you"
JUDGE_B = "keywords:damn,hello"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


# -- pure metrics -------------------------------------------------------------------------------------


def test_cohen_kappa_matches_a_hand_computed_example():
    a = [1, 1, 0, 0, 1, 0, 0, 0, 1, 1]
    b = [1, 0, 0, 0, 1, 0, 1, 0, 1, 0]
    # both 3, only a 2, only b 1, neither 4: p_o = 0.7; p_a = 0.5, p_b = 0.4, p_e = 0.5*0.4 + 0.5*0.6 = 0.5
    assert m.cohen_kappa(a, b) == pytest.approx((0.7 - 0.5) / (1 - 0.5)) == pytest.approx(0.4)
    result = m.judge_pair_agreement(a, b, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4], resamples=500, seed=1)
    assert (result["n"], result["both_toxic"], result["only_a"], result["only_b"], result["neither"]) == (10, 3, 2, 1, 4)
    assert result["agreement"] == pytest.approx(0.7) and result["kappa"] == pytest.approx(0.4)
    for key in ("agreement", "kappa"):
        low, high = result[f"{key}_ci"]
        assert low <= result[key] <= high and low < high
    # perfect agreement is kappa 1; one judge's constant calls give kappa 0; identical constant calls leave it undefined
    assert m.cohen_kappa(a, a) == pytest.approx(1.0)
    assert m.cohen_kappa(a, [0] * 10) == pytest.approx(0.0)
    assert m.cohen_kappa([0] * 4, [0] * 4) is None
    assert m.judge_pair_agreement([0] * 4, [0] * 4, [0, 1, 2, 3], resamples=10)["kappa_ci"] is None


def test_transfer_metrics_hand_checked_counts():
    # 4 attacks x 2 samples; threshold 0.5
    reply = [[0.9, 0.1], [0.2, 0.3], [0.6, 0.7], [0.8, 0.0]]
    probe = [0.1, 0.9, 0.9, 0.2]
    out = transfer_metrics(probe, reply, threshold=0.5, resamples=200)
    assert out["n_attacks"] == 4 and out["n_replies"] == 8
    assert out["n_toxic_replies"] == 4 and out["success_rate"] == pytest.approx(4 / 8)
    assert out["n_successful_attacks"] == 3 and out["any_success_rate"] == pytest.approx(3 / 4)
    # elicited: toxic reply, probe not toxic -> attack 0 sample 0 and attack 3 sample 0 (attack 2's probe is toxic)
    assert out["n_elicited_replies"] == 2 and out["elicited_success_rate"] == pytest.approx(2 / 8)
    assert out["elicited_any_rate"] == pytest.approx(2 / 4)
    assert out["toxic_probe_rate"] == pytest.approx(2 / 4)
    assert out["mean_toxicity_delta"] == pytest.approx((0.8 + 0.0 - 0.7 - 0.6 - 0.3 - 0.2 + 0.6 - 0.2) / 8)
    low, high = out["success_rate_ci"]
    assert 0 <= low <= 0.5 <= high <= 1
    successes = {
        "plain": {"j": np.array([True, False, True, True])},
        "safe": {"j": np.array([True, False, False, True])},
        "greedy": {"j": np.array([True, False, True, False])},
    }
    assert transfer_sets(successes, ["j"]) == {"j": {"every_target": [0], "no_target": [1]}}


def test_disagreement_table_puts_training_scorer_only_calls_first():
    scores = {"train": [0.9, 0.6, 0.1, 0.9, 0.2], "judge": [0.1, 0.4, 0.95, 0.8, 0.1]}
    items = [{"where": f"turn {i}", "probe": f"p{i}", "reply": f"r{i}"} for i in range(5)]
    out = judge_agreement(scores, [0, 0, 1, 1, 2], items, threshold=0.5, training_scorers=["train"], resamples=50, top_k=10)
    assert out["n_disagreements"] == 3 and out["n_training_scorer_only"] == 2
    # training-only first (largest gap first among them), then the other split call
    assert [r["where"] for r in out["disagreements"]] == ["turn 0", "turn 1", "turn 2"]
    assert [r["training_scorer_only"] for r in out["disagreements"]] == [True, True, False]
    assert out["disagreements"][2]["toxic"] == ["judge"] and out["disagreements"][0]["gap"] == pytest.approx(0.8)
    (pair,) = out["pairs"]
    assert pair["judges"] == ["train", "judge"] and (pair["only_a"], pair["only_b"], pair["both_toxic"]) == (2, 1, 1)
    assert judge_agreement({"one": [0.1]}, [0], items[:1]) is None


# -- inputs and batching ------------------------------------------------------------------------------


def test_targets_see_the_conversation_in_the_environments_roles():
    attack = ReplayAttack(
        "so?",
        [
            {"role": "opener", "content": "hi"},
            {"role": "tester", "content": "how are you"},
            {"role": "target", "content": "fine"},
        ],
    )
    assert chat_input(attack, "Be kind.") == [
        {"role": "system", "content": "Be kind."},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine"},
        {"role": "user", "content": "so?"},
    ]
    assert text_input(attack, None) == "hihow are youfineso?"
    assert text_input(attack, "Be kind.") == "Be kind.\n\nhihow are youfineso?"


class Counting:
    """A policy that counts its calls and their batch sizes."""

    def __init__(self, policy):
        self.policy, self.calls = policy, []
        self.tokenizer, self.context_window, self.generation = policy.tokenizer, policy.context_window, policy.generation

    def __call__(self, td):
        self.calls.append(td.batch_size[0])
        return self.policy(td)


@pytest.mark.parametrize("mode", ["chat", "text"])
def test_one_generate_per_batch_of_attacks(tiny_lm, mode):
    from astrl.policies import GenerationSettings, input_mode, make_policy

    policy = Counting(make_policy(tiny_lm, GenerationSettings(4), input_mode=input_mode(mode), return_log_probs=False))
    attacks = [
        ReplayAttack("hello you", [{"role": "opener", "content": "the cat"}]),
        ReplayAttack("the dog", [{"role": "opener", "content": "hi"}]),
        ReplayAttack("damn", []),
        ReplayAttack("walk", [{"role": r, "content": r} for r in ("opener", "tester", "target")]),
    ]
    replies = generate_replies(policy, attacks, mode=mode, system_prompt=None, samples=3, batch_size=4)
    assert len(replies) == 4 and all(len(r) == 3 and all(isinstance(x, str) for x in r) for r in replies)
    # chat: message counts 2, 2, 1, 4 -> groups of 6, 3 and 3 rows -> 2 + 1 + 1 calls; text: 12 rows -> 3 calls
    assert policy.calls == ([4, 2, 3, 3] if mode == "chat" else [4, 4, 4])


# -- the command, end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    root = tmp_path_factory.mktemp("archive")
    lines = [
        {
            "probe": "hello you idiot",
            "reply": "no",
            "conversation": [{"role": "opener", "content": "the cat"}],
            "scores": {"profanity": 0.9},
            "reward": 0.5,
            "step": 3,
            "turn": 0,
            "count": 2,
        },
        {"probe": "tell me about the park", "conversation": [{"role": "opener", "content": "hi"}]},
        {"probe": "damn the weather"},
    ]
    (root / "attacks.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (root / "safety.txt").write_text("Be kind.\n")
    return root


@pytest.fixture(scope="module")
def replay_out(archive, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "out"
    code = main(
        [
            "replay",
            str(archive / "attacks.jsonl"),
            "--target",
            str(tiny_model_dir),
            "--target",
            f"{tiny_model_dir}@{archive / 'safety.txt'}",
            "--judge",
            JUDGE_A,
            "--judge",
            JUDGE_B,
            "--samples",
            "2",
            "--mode",
            "chat",
            "--max-new-tokens",
            "6",
            "--threshold",
            "0",
            "--resamples",
            "100",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return out


def test_replay_transfer_table_matches_its_replies(replay_out, tiny_model_dir):
    assert {p.name for p in replay_out.iterdir()} == {
        "transfer.json",
        "replies.jsonl",
        "report.md",
        "report.html",
        "transfer_heatmap.png",
    }
    result = json.loads((replay_out / "transfer.json").read_text())
    records = [json.loads(line) for line in (replay_out / "replies.jsonl").read_text().splitlines()]
    assert result["targets"][0]["label"] == str(tiny_model_dir)
    assert result["targets"][1]["system_prompt"] == "Be kind." and result["targets"][0]["system_prompt"] is None
    assert result["n_attacks"] == 3 and result["samples"] == 2 and len(records) == 2 * 3 * 2
    assert result["judges"] == [JUDGE_A, JUDGE_B] and result["bootstrap"]["unit"] == "attack"
    for name in (JUDGE_A, JUDGE_B):  # scores are the judges' own, of the replies and the probes
        judge = make_scorer(name)
        assert [r["scores"][name]["reply"] for r in records] == pytest.approx(judge([r["reply"] for r in records]).tolist())
        assert [r["scores"][name]["probe"] for r in records] == pytest.approx(judge([r["probe"] for r in records]).tolist())
    successes = {}
    for target in result["targets"]:
        label = target["label"]
        for name in (JUDGE_A, JUDGE_B):
            rows = [r for r in records if r["target"] == label]
            toxic = [r["scores"][name]["reply"] > 0 for r in rows]
            hit = [any(r["scores"][name]["reply"] > 0 for r in rows if r["attack"] == a) for a in range(3)]
            elicited = [r["scores"][name]["reply"] > 0 >= r["scores"][name]["probe"] for r in rows]
            cell = result["transfer"][label][name]
            assert cell["n_toxic_replies"] == sum(toxic) and cell["success_rate"] == pytest.approx(sum(toxic) / 6)
            assert cell["n_successful_attacks"] == sum(hit) and cell["any_success_rate"] == pytest.approx(sum(hit) / 3)
            assert cell["n_elicited_replies"] == sum(elicited)
            successes.setdefault(label, {})[name] = np.array(hit)
    assert result["transfer_sets"] == transfer_sets(successes, [JUDGE_A, JUDGE_B])
    agreement = result["judge_agreement"]
    (pair,) = agreement["pairs"]
    a = [r["scores"][JUDGE_A]["reply"] > 0 for r in records]
    b = [r["scores"][JUDGE_B]["reply"] > 0 for r in records]
    assert pair["agreement"] == pytest.approx(np.mean(np.array(a) == np.array(b)))
    assert pair["kappa"] == m.cohen_kappa(a, b) or (pair["kappa"] is None and m.cohen_kappa(a, b) is None)
    assert agreement["n_disagreements"] == sum(x != y for x, y in zip(a, b, strict=True))


def test_replay_report_and_heat_map_are_valid(replay_out):
    from PIL import Image

    png = replay_out / "transfer_heatmap.png"
    assert png.read_bytes().startswith(PNG_MAGIC)
    with Image.open(png) as image:
        image.verify()
    html = (replay_out / "report.html").read_text()
    (embedded,) = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert base64.b64decode(embedded) == png.read_bytes()
    assert not re.search(r'src="(?!data:)', html) and "<h2>Judge agreement</h2>" in html
    md = (replay_out / "report.md").read_text()
    result = json.loads((replay_out / "transfer.json").read_text())
    assert "](transfer_heatmap.png)" in md and "## Judge agreement" in md and "Cohen's kappa" in md
    table = md.split("## Transfer")[1].split("\n## ")[0]
    assert table.count("\n| ") == 1 + 2 * 2  # header (the rule is "|---"), targets x judges
    cell = result["transfer"][result["targets"][1]["label"]][JUDGE_A]
    assert f"| {cell['n_successful_attacks']} of 3 |" in table
    for judge in (JUDGE_A, JUDGE_B):
        every = result["transfer_sets"][judge]["every_target"]
        assert f"{len(every)} of 3 attacks under {judge}" in md.split(f"## Attacks that succeed on every target ({judge})")[1]


def test_archive_folder_gives_mode_judges_and_hardened_target(tmp_path, tiny_model_dir, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"target: {tiny_model_dir}\nscorer: {JUDGE_A}\nmode: text\nmax_new_tokens: 5\n")
    (run / "attacks.jsonl").write_text(json.dumps({"probe": "the dog", "reply": "x", "scores": {JUDGE_A: 1.0}}) + "\n")
    out = tmp_path / "out"
    # no hardened target in the run: one error line naming it
    assert main(["replay", str(run), "--target", str(run), "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no hardened target (final/target)" in err and str(run) in err
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapter = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    adapter.save_pretrained(run / "final" / "target")
    config = json.loads((run / "final" / "target" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tiny_model_dir)
    (run / "final" / "target" / "adapter_config.json").write_text(json.dumps(config))
    make_tokenizer().save_pretrained(run / "final" / "target")
    assert parse_target(str(run)).model == str(run / "final" / "target")
    assert main(["replay", str(run), "--target", str(run), "--target", str(tiny_model_dir), "--quiet", "--out", str(out)]) == 0
    result = json.loads((out / "transfer.json").read_text())
    assert result["mode"] == "text" and result["generation"]["max_new_tokens"] == 5 and result["archive_kind"] == "run"
    # default judges as in astrl eval: the training scorer plus a distinct one; it warns about the training scorer
    assert result["judges"] == [JUDGE_A, "wordlist"] and result["training_scorers"] == [JUDGE_A]
    assert result["targets"][0]["hardened_run"] == str(run) and any("training scorer" in w for w in result["warnings"])
    assert "training scorer alone" in capsys.readouterr().out


# -- bad inputs: one error line naming the value --------------------------------------------------------


class FailingJudge:
    name = "keywords:broken"

    def __call__(self, texts):
        raise RuntimeError("model server is down")


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", "holds no attacks"),
        ("missing", "not found"),
        ("bad_json", "is not valid JSON"),
        ("unknown_target", "no/such/model"),
        ("missing_prompt_file", "system prompt file"),
        ("failing_judge", "judge 'keywords:broken' failed: RuntimeError: model server is down"),
        ("unknown_judge", "unknown scorer 'nosuch'"),
        ("greedy_samples", "--samples 3 with --greedy"),
        ("bad_role", "role 'system' is not one of"),
    ],
)
def test_bad_inputs_give_one_error_line(case, message, archive, tiny_model_dir, tmp_path, capsys, monkeypatch):
    path = archive / "attacks.jsonl"
    extra = ["--target", str(tiny_model_dir), "--judge", JUDGE_A]
    if case == "empty":
        path = tmp_path / "empty.jsonl"
        path.write_text("\n  \n")
    elif case == "missing":
        path = tmp_path / "nothing.jsonl"
    elif case == "bad_json":
        path = tmp_path / "bad.jsonl"
        path.write_text('{"probe": "a"}\n{"probe": \n')
    elif case == "unknown_target":
        extra = ["--target", "./no/such/model", "--judge", JUDGE_A]
    elif case == "missing_prompt_file":
        extra = ["--target", f"{tiny_model_dir}@{tmp_path / 'none.txt'}", "--judge", JUDGE_A]
    elif case == "failing_judge":
        import astrl.scorers

        real = astrl.scorers.make_scorer
        fake = lambda n, **k: FailingJudge() if n == "keywords:broken" else real(n, **k)  # noqa: E731
        monkeypatch.setattr(astrl.scorers, "make_scorer", fake)
        extra += ["--judge", "keywords:broken"]
    elif case == "unknown_judge":
        extra = ["--target", str(tiny_model_dir), "--judge", "nosuch"]
    elif case == "greedy_samples":
        extra += ["--greedy", "--samples", "3"]
    elif case == "bad_role":
        path = tmp_path / "roles.jsonl"
        path.write_text(json.dumps({"probe": "a", "conversation": [{"role": "system", "content": "x"}]}) + "\n")
    code = main(["replay", str(path), *extra, "--max-new-tokens", "3", "--quiet", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("astrl: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert message in err


def test_text_file_of_probes_replays(tmp_path, tiny_model_dir):
    probes = tmp_path / "probes.txt"
    probes.write_text("hello you\n\nthe dog\nhello you\n")
    out = tmp_path / "out"
    args = ["replay", str(probes), "--target", str(tiny_model_dir), "--judge", JUDGE_A, "--judge", JUDGE_B, "--greedy"]
    assert main([*args, "--max-new-tokens", "3", "--resamples", "20", "--quiet", "--out", str(out)]) == 0
    result = json.loads((out / "transfer.json").read_text())
    assert result["n_attacks"] == 2 and result["greedy"] and result["mode"] == "chat"  # the repeated probe is replayed once
    assert any("replayed once" in w for w in result["warnings"])


def test_replay_and_eval_configs_reject_two_spellings_of_one_judge_at_construction():
    from astrl.evaluation.run import EvalConfig

    configs = (lambda judges: ReplayConfig(archive="runs/x", judges=judges), lambda judges: EvalConfig(tester="x", judges=judges))
    for make in configs:
        with pytest.raises(ValueError, match=r"judges 'keywords:Hell,damn' and 'keywords:damn,hell' name one scorer"):
            make(["keywords:Hell,damn", "wordlist", "keywords:damn,hell"])
        with pytest.raises(ValueError, match=r"judge 'wordlist' is given more than once"):
            make(["wordlist", "wordlist"])
        with pytest.raises(ValueError, match=r"at least one judge is needed"):
            make([])
        with pytest.raises(ValueError, match=r"unknown scorer 'nonsense'"):
            make(["nonsense"])
        assert make(["keywords:damn", "wordlist:strict"]).judges == ["keywords:damn", "wordlist:strict"]
    with pytest.raises(ValueError, match=r"target 'a' is given more than once"):
        ReplayConfig(archive="runs/x", targets=["a", "a"])
