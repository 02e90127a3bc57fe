import json

import pytest

from astrl.prompts import PromptSourceError, PromptStream, builtin_openers, load_prompts, split_prompts


def test_builtin_has_at_least_100_unique_openers():
    openers = builtin_openers()
    assert len(openers) >= 100 and len(set(openers)) == len(openers)


def test_splits_are_deterministic_disjoint_and_cover_everything():
    prompts = load_prompts("builtin")
    parts = {s: split_prompts(prompts, s, seed=3) for s in ("train", "dev", "test")}
    assert parts == {s: split_prompts(prompts, s, seed=3) for s in ("train", "dev", "test")}
    assert not set(parts["train"]) & set(parts["test"]) and not set(parts["dev"]) & set(parts["test"])
    assert not set(parts["train"]) & set(parts["dev"])
    assert sorted(parts["train"] + parts["dev"] + parts["test"]) == sorted(prompts)
    assert split_prompts(prompts, "test", seed=4) != parts["test"]


def test_text_and_jsonl_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\nfirst\n")
    assert load_prompts(str(txt)) == ["first", "second"]
    jl = tmp_path / "p.jsonl"
    jl.write_text(
        json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n" + json.dumps({"prompt": {"text": "c"}}) + "\n"
    )
    assert load_prompts(str(jl)) == ["a", "b", "c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n")
    with pytest.raises(PromptSourceError, match="bad.jsonl:1"):
        load_prompts(str(bad))


def test_missing_source_is_a_clear_error():
    with pytest.raises(PromptSourceError, match="no/such/file.txt"):
        load_prompts("no/such/file.txt")


def test_package_sources():
    rtp = load_prompts("rtp:insult")
    assert len(rtp) == 100
    assert len(load_prompts("rtp")) > len(rtp)
    with pytest.raises(PromptSourceError, match="insult"):
        load_prompts("rtp:nonsense")
    assert len(load_prompts("chatterbot")) > 100


def test_prompt_stream_resumes_where_it_stopped():
    prompts = [f"p{i}" for i in range(7)]
    a = PromptStream(prompts, 3, seed=1)
    first = [a.next_batch() for _ in range(2)]
    state = a.state_dict()
    rest = [a.next_batch() for _ in range(3)]
    b = PromptStream(prompts, 3, seed=1)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(3)] == rest
    assert len(set(sum(first, []))) == 6  # within one epoch no prompt repeats


def test_draw_hooks_see_the_state_before_each_draw_also_through_iteration():
    prompts = [f"p{i}" for i in range(5)]
    stream, seen = PromptStream(prompts, 2, seed=3), []
    stream.on_draw(seen.append)
    states, drawn = [], []
    for draw in (stream.next_batch, lambda: next(iter(stream))["query"], stream.next_batch):  # a data loader iterates
        states.append(stream.state_dict())
        drawn.append(draw())
    assert seen == states and len({str(s) for s in seen}) == 3
    replay = PromptStream(prompts, 2, seed=3)
    replay.load_state_dict(seen[2])
    assert replay.next_batch() == drawn[2]  # a recorded state draws its batch again
