import re

import pytest
import torch
from conftest import make_llama, make_tokenizer

from astrl.scorers import ChatJudgeScorer, HFClassifierScorer, KeywordScorer, ScorerError, WordListScorer, make_scorer


def test_profanity_scores_profane_text_higher_and_stays_in_unit_interval():
    scorer = make_scorer("profanity")
    scores = scorer(["have a lovely afternoon", "you are a fucking idiot, shit"])
    assert scores.shape == (2,) and scores.dtype == torch.float32
    assert 0 <= scores.min() and scores.max() <= 1
    assert scores[1] > 0.5 > scores[0]


def test_wordlist_flags_listed_words_and_their_leetspeak_spellings():
    scorer = make_scorer("wordlist")
    assert scorer.name == "wordlist"
    texts = ["you are a fucking idiot", "have a lovely afternoon", "sh1t happens", "an assessment of the class", "SHIT"]
    scores = scorer(texts)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]  # whole words only: "assessment" and "class" are clean
    empty = scorer([])
    assert empty.shape == (0,) and empty.dtype == torch.float32
    assert scorer(["", "shit", "shit"]).tolist() == [0.0, 1.0, 1.0]


def test_wordlist_answers_as_the_library_does_on_its_own_list():
    from better_profanity import Profanity

    from astrl.prompts import load_prompts

    library = Profanity()  # its own word list, unindexed
    listed = [str(w) for w in library.CENSOR_WORDSET[::7]]
    texts = load_prompts("rtp")[:300] + load_prompts("builtin")
    texts += [f"so {w} there" for w in listed] + [f"{w}ing it" for w in listed] + [w.upper() for w in listed]
    texts += ["sh1t", "$hit", "f u c k", "what a b!tch", "son of a bitch", "p0rn star", "a55 hat", "dumb ass", "@ss"]
    scorer = WordListScorer()
    ours = scorer(texts).tolist()
    assert ours == [1.0 if library.contains_profanity(t) else 0.0 for t in texts]
    assert 0 < sum(ours) < len(texts)  # both kinds of text are there
    assert scorer(texts).tolist() == ours  # remembered answers are the same


def test_wordlist_can_leave_listed_words_out():
    full, without = make_scorer("wordlist"), make_scorer("wordlist:-god,-Damn")
    assert without.name == "wordlist:-damn,-god" and without.left_out == ("damn", "god")
    texts = ["oh my god", "Oh my GOD", "damn it", "g0d", "what the fuck", "oh my god, shit", "hello there"]
    assert full(texts).tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert without(texts).tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]  # leetspeak of a left-out word too
    assert make_scorer("wordlist:-god")(["goddamn"]).tolist() == [1.0]  # other listed words that hold it stay


def test_wordlist_strict_keeps_vulgar_words_slurs_and_insults_and_leaves_ordinary_words_out():
    from astrl.names import parse_scorer, wordlist_preset, wordlist_words

    assert parse_scorer("wordlist:-Damn, strict") == ("wordlist", ("strict", "-damn"))
    strict, both = make_scorer("wordlist:strict"), make_scorer("wordlist:-Damn, strict")
    assert strict.name == "wordlist:strict" and strict.preset == "strict" and strict.left_out == ()
    assert both.name == "wordlist:strict,-damn" and both.left_out == ("damn",)
    texts = ["you stupid bitch", "what the fuck", "sh1t", "a brutal murder", "oh my god", "gay rights",
             "he got drunk", "the sex scene", "a fat cat", "hello there"]  # fmt: skip
    assert make_scorer("wordlist")(texts).tolist() == [1.0] * 9 + [0.0]
    assert strict(texts).tolist() == [1.0, 1.0, 1.0] + [0.0] * 7  # leetspeak of a kept word still counts
    left_out = wordlist_preset("strict")
    listed = {w.lower() for w in wordlist_words()}
    assert set(left_out) <= listed  # every entry is one the list holds: none is a no-op
    assert {"murder", "kill", "god", "hell", "gay", "queer", "drunk", "rum", "sex", "fat"} <= set(left_out)
    assert not {"fuck", "shit", "bitch", "cunt", "stupid", "moron", "faggot", "slut", "bastard"} & set(left_out)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("wordlist:loose", "a preset (strict) and words to leave out of its list, each as -WORD"),
        ("wordlist:god", "each as -WORD (e.g. wordlist:-god, wordlist:strict), got 'god'"),
        ("wordlist:-god,", "got ''"),
        ("wordlist:-", "got '-'"),
        ("wordlist:-gdo", "'gdo' not in the word list"),
    ],
)
def test_a_bad_wordlist_option_is_refused_with_the_item_named(name, message):
    from astrl.names import parse_scorer

    with pytest.raises(ScorerError, match=re.escape(message)):
        parse_scorer(name)
    with pytest.raises(ScorerError, match=re.escape("'gdo' not in the word list")):
        WordListScorer(["gdo"])(["text"])


def test_wordlist_loads_once_and_can_be_shared_between_threads():
    from concurrent.futures import ThreadPoolExecutor

    scorer = WordListScorer()
    assert scorer._matcher is None  # nothing loaded before the first call
    batches = [["damn you", "good morning"], ["what the hell", "b1tch"], ["fine", "thanks"]] * 4
    with ThreadPoolExecutor(4) as pool:
        results = [r.tolist() for r in pool.map(scorer, batches)]
    assert results == [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]] * 4


def test_wordlist_without_the_package_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "better_profanity" else real(name, *a))
    with pytest.raises(ScorerError, match="better-profanity==0.7.0"):
        make_scorer("wordlist")


def test_keyword_share_values():
    scorer = make_scorer("keywords:damn,Hell")
    torch.testing.assert_close(scorer(["Damn it to hell now", "nothing", ""]), torch.tensor([0.4, 0.0, 0.0]))
    assert scorer.name == "keywords:damn,hell"


@pytest.mark.parametrize("name", ["toxicity", "hf:", "judge:", "profanity:x", "keywords"])
def test_unknown_scorer_names_list_the_valid_forms(name):
    with pytest.raises(ScorerError, match="valid forms"):
        make_scorer(name)


def test_keyword_scorer_needs_words():
    with pytest.raises(ScorerError):
        KeywordScorer([" "])
    for name in ("keywords:", "keywords: , ,"):
        with pytest.raises(ScorerError, match=f"scorer {name!r}: the 'keywords' scorer needs at least one word"):
            make_scorer(name)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("detoxify:huge", "detoxify variant must be one of"),
        ("hf:/nonexistent/clf", "classifier folder '/nonexistent/clf' not found"),
        ("judge:/nonexistent/judge@guard", "judge folder '/nonexistent/judge' not found"),
        ("hf:@toxic", "names no model"),
    ],
)
def test_scorer_names_are_checked_without_loading_anything(name, message):
    from astrl.names import parse_scorer

    with pytest.raises(ScorerError, match=message):
        parse_scorer(name)


def test_scorer_names_parse_into_kind_and_arguments():
    from astrl.names import parse_scorer

    assert parse_scorer("profanity") == ("profanity", ())
    assert parse_scorer("detoxify") == ("detoxify", ("original",))
    assert parse_scorer("keywords:damn, hell,") == ("keywords", ("damn", "hell"))
    assert parse_scorer("hf:org/clf@toxic") == ("hf", ("org/clf", "toxic"))
    assert parse_scorer("judge:org/guard@guard") == ("judge", ("org/guard", "guard"))
    assert parse_scorer("judge:org/model") == ("judge", ("org/model", "auto"))


def test_spellings_of_one_scorer_parse_alike_and_are_built_once(monkeypatch):
    import astrl.scorers
    from astrl.names import parse_scorer
    from astrl.scorers import make_scorers

    spellings = {"keywords:Hell,damn": "keywords:damn,hell", "wordlist:-god,strict": "wordlist:strict,-god"}
    for spelled, canonical in spellings.items():
        assert parse_scorer(spelled) == parse_scorer(canonical)
        assert make_scorer(spelled).name == canonical  # the built scorer's name parses to the same pair
    assert parse_scorer("keywords:damn") != parse_scorer("keywords:damn,hell")
    calls = []
    monkeypatch.setattr(astrl.scorers, "make_scorer", lambda name, **kw: calls.append(name) or make_scorer(name, **kw))
    built = make_scorers(["keywords:hell,damn", "wordlist", "keywords:Damn, hell", "wordlist:strict"])
    assert list(built) == ["keywords:damn,hell", "wordlist", "wordlist:strict"]  # first place kept
    assert calls == ["keywords:hell,damn", "wordlist", "wordlist:strict"]  # the second spelling loads nothing


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder = tmp_path_factory.mktemp("clf")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "damn", "you", "nice"]
    (folder / "vocab.txt").write_text("\n".join(vocab))
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
        id2label={0: "neutral", 1: "toxic"},
        label2id={"neutral": 0, "toxic": 1},
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_judges_naming_one_scorer_twice_are_an_error_before_or_once_built(classifier_dir, monkeypatch):
    import astrl.scorers
    from astrl.scorers import make_judges

    judges = make_judges(["keywords:damn", "wordlist:strict", f"hf:{classifier_dir}@toxic"])
    assert list(judges) == ["keywords:damn", "wordlist:strict", f"hf:{classifier_dir}@toxic"]
    built = []
    monkeypatch.setattr(astrl.scorers, "make_scorer", lambda name, **kw: built.append(name) or make_scorer(name, **kw))
    with pytest.raises(ScorerError, match=r"judges 'wordlist:-god,strict' and 'wordlist:strict,-god' name one scorer"):
        make_judges(["wordlist:-god,strict", "keywords:damn", "wordlist:strict,-god"])
    assert built == []  # the names told: nothing loaded
    with pytest.raises(ScorerError, match=r"both resolve to 'hf:.*@toxic'"):  # its default label is the model's to say
        make_judges([f"hf:{classifier_dir}", f"hf:{classifier_dir}@toxic"])


def test_hf_classifier_picks_the_harmful_label_and_matches_a_manual_softmax(classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    scorer = make_scorer(f"hf:{classifier_dir}")
    assert scorer.name.endswith("@toxic")
    texts = ["hello nice", "damn you damn"]
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    enc = AutoTokenizer.from_pretrained(classifier_dir)(texts, padding=True, return_tensors="pt")
    expected = model(**enc).logits.softmax(-1)[:, 1]
    torch.testing.assert_close(scorer(texts), expected.detach())
    neutral = HFClassifierScorer(str(classifier_dir), "NEUTRAL")
    torch.testing.assert_close(neutral(texts) + scorer(texts), torch.ones(2))
    with pytest.raises(ScorerError, match="toxic"):
        HFClassifierScorer(str(classifier_dir), "insult")


def test_chat_judge_is_p_unsafe_over_safe_at_the_next_token(tmp_path):
    tok = make_tokenizer()
    model = make_llama(tok)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    judge = ChatJudgeScorer(str(tmp_path), style="guard", unsafe_token="bad", safe_token="good", batch_size=1)
    texts = ["you idiot", "hello friend how are you today"]
    scores = judge(texts)
    # independent computation, one text at a time, no padding
    unsafe = tok("bad", add_special_tokens=False)["input_ids"][0]
    safe = tok("good", add_special_tokens=False)["input_ids"][0]
    for text, score in zip(texts, scores, strict=False):
        chat = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": text}]
        ids = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(ids, add_special_tokens=False)["input_ids"]])
        logits = model(ids).logits[0, -1]
        expected = torch.stack([logits[unsafe], logits[safe]]).softmax(-1)[0]
        torch.testing.assert_close(score, expected.detach(), atol=1e-5, rtol=1e-4)
    batched = ChatJudgeScorer(str(tmp_path), style="guard", unsafe_token="bad", safe_token="good", batch_size=8)(texts)
    torch.testing.assert_close(batched, scores, atol=1e-4, rtol=1e-3)


def test_instruct_judge_asks_the_judging_prompt_and_sums_the_spellings(tmp_path):
    from astrl.scorers import JUDGE_PROMPT

    tok = make_tokenizer()
    model = make_llama(tok)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    judge = make_scorer(f"judge:{tmp_path}")  # a ChatML template without "unsafe": a plain instruct model
    assert judge.style == "instruct" and judge.name == f"judge:{tmp_path}"
    assert set(judge.unsafe_ids).isdisjoint(judge.safe_ids) and judge.unsafe_ids and judge.safe_ids
    first = {w: tok(w, add_special_tokens=False)["input_ids"][0] for w in ("unsafe", "Unsafe", " unsafe", " Unsafe")}
    assert set(judge.unsafe_ids) <= set(first.values())
    texts = ["you idiot", "hello friend how are you today", "good"]
    scores = judge(texts)
    assert scores.shape == (3,) and ((scores > 0) & (scores < 1)).all()
    for text, score in zip(texts, scores, strict=True):
        chat = [{"role": "user", "content": JUDGE_PROMPT.format(text=text)}]
        prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        assert "Answer with one word: safe or unsafe." in tok.decode(ids)
        probs = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        unsafe, safe = probs[judge.unsafe_ids].sum(), probs[judge.safe_ids].sum()
        torch.testing.assert_close(score, (unsafe / (unsafe + safe)).detach(), atol=1e-5, rtol=1e-4)
    assert judge([]).shape == (0,)
    guard = make_scorer(f"judge:{tmp_path}@guard")
    assert guard.style == "guard" and guard.name == f"judge:{tmp_path}@guard"
    assert make_scorer(f"judge:{tmp_path}@instruct").name == f"judge:{tmp_path}@instruct"
    with pytest.raises(ScorerError, match="judge style"):
        ChatJudgeScorer(str(tmp_path), style="loud")


def test_judge_style_auto_picks_guard_for_a_guard_template(tmp_path):
    tok = make_tokenizer()
    tok.chat_template = tok.chat_template + "{# answer 'safe' or 'unsafe' #}"
    make_llama(tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert ChatJudgeScorer(str(tmp_path)).style == "guard"
