"""astrl.lm_scoring: the one implementation of per-token log-probs under a causal LM."""

import math

import pytest
import torch
from conftest import make_gpt2, make_llama, make_tokenizer

from astrl.lm_scoring import (
    head_gives_logits,
    nest_rows,
    nested_token_logprobs,
    score_tokens,
    select_cache_rows,
    shared_prefix_logprobs,
    token_logprobs,
)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def plain(model, prefix: torch.Tensor, cont: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs, entropies and last hidden states at the positions predicting ``cont``, from one
    unpadded forward of ``prefix + cont`` over its full logits."""
    ids = torch.cat([prefix, cont])[None]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    positions = torch.arange(len(prefix) - 1, len(prefix) - 1 + len(cont))
    logp = torch.log_softmax(out.logits[0].float(), -1)[positions]
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, cont[:, None]).squeeze(-1), entropy, out.hidden_states[-1][0, positions]


def ragged(tok, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, len(tok), (n,), generator=g) for n in lengths]


class Rescaled(torch.nn.Module):
    """A model whose logits are not its LM head on the last hidden state (as with logit soft-capping)."""

    def __init__(self, inner, head: bool = True):
        super().__init__()
        self.inner, self.head, self.calls = inner, head, []

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings() if self.head else None

    def forward(self, **kwargs):
        self.calls.append(sorted(kwargs))
        out = self.inner(**kwargs)
        out.logits = out.logits * 0.5
        return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_log_probs_entropy_and_hidden_states_match_a_plain_forward(tok, arch):
    model = make_llama(tok) if arch == "llama" else make_gpt2(tok)
    prefixes, conts = ragged(tok, (3, 9, 1)), ragged(tok, (4, 2, 7), seed=1)
    with torch.no_grad():
        scores = score_tokens(model, prefixes, conts, pad_token_id=tok.pad_token_id, entropy=True, hidden=True)
        rows = token_logprobs(model, prefixes, conts, pad_token_id=tok.pad_token_id)
    assert scores.lengths == [4, 2, 7] and scores.log_probs.shape == (3, 7) and scores.hidden.shape[:2] == (3, 7)
    assert torch.equal(scores.valid, torch.arange(7)[None] < torch.tensor([[4], [2], [7]]))
    for i, (p, c) in enumerate(zip(prefixes, conts, strict=True)):
        logp, entropy, hidden = plain(model, p, c)
        torch.testing.assert_close(scores.log_probs[i, : len(c)], logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scores.entropy[i, : len(c)], entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scores.hidden[i, : len(c)], hidden, atol=1e-5, rtol=1e-5)
        assert torch.equal(rows[i], scores.rows()[i]) and rows[i].shape == c.shape
        assert 0 < entropy.min() and entropy.max() <= math.log(len(tok))
    assert head_gives_logits(model) is True  # the head ran on the gathered positions only


def test_without_entropy_or_hidden_nothing_is_returned_and_entropy_grad_can_be_off(tok):
    model = make_llama(tok)
    prefixes, conts = ragged(tok, (3, 5)), ragged(tok, (2, 4), seed=1)
    bare = score_tokens(model, prefixes, conts)
    assert bare.entropy is None and bare.hidden is None and bare.log_probs.requires_grad
    scores = score_tokens(model, prefixes, conts, entropy=True, entropy_grad=False)
    assert scores.log_probs.requires_grad and not scores.entropy.requires_grad


def test_prefixes_are_clipped_to_max_length_and_an_empty_prefix_gives_nan(tok):
    model = make_llama(tok)
    prefix, cont = torch.arange(10, 40), torch.arange(50, 55)
    with torch.no_grad():
        (row,) = token_logprobs(model, [prefix], [cont], max_length=12)
        torch.testing.assert_close(row, plain(model, prefix[-7:], cont)[0], atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="max_length=3"):
            token_logprobs(model, [prefix], [cont], max_length=3)
        # the whole window for the continuation: its first token has nothing to be predicted from
        (row,) = token_logprobs(model, [prefix], [cont], max_length=5)
        (alone,) = token_logprobs(model, [torch.tensor([], dtype=torch.long)], [cont])
    assert math.isnan(row[0]) and torch.isfinite(row[1:]).all()
    torch.testing.assert_close(row, alone, equal_nan=True)
    torch.testing.assert_close(row[1:], plain(model, cont[:1], cont[1:])[0], atol=1e-5, rtol=1e-5)
    assert token_logprobs(model, [], []) == []
    with pytest.raises(ValueError, match="2 prefixes but 1 continuations"):
        token_logprobs(model, [prefix, prefix], [cont])


@pytest.mark.parametrize("head", [True, False], ids=["rescaled-logits", "no-output-embeddings"])
def test_a_head_that_does_not_give_the_logits_falls_back_to_the_full_logits(tok, head):
    model = Rescaled(make_llama(tok, seed=4), head=head)
    prefixes, conts = ragged(tok, (6, 2)), ragged(tok, (5, 3), seed=1)
    for _ in range(2):  # the first call finds the mismatch, the second goes to the full logits directly
        with torch.no_grad():
            scores = score_tokens(model, prefixes, conts, entropy=True, hidden=True)
        for i, (p, c) in enumerate(zip(prefixes, conts, strict=True)):
            logp, entropy, hidden = plain(model, p, c)  # the rescaled logits: what the model gives
            torch.testing.assert_close(scores.log_probs[i, : len(c)], logp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(scores.entropy[i, : len(c)], entropy, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(scores.hidden[i, : len(c)], hidden, atol=1e-5, rtol=1e-5)
    assert head_gives_logits(model) is False
    # after the check, the forward asks for no more than it needs: no hidden states unless wanted
    with torch.no_grad():
        token_logprobs(model, prefixes, conts)
    assert model.calls[-1] == ["attention_mask", "input_ids"]


def test_the_head_is_checked_once_per_model_and_then_keeps_one_logit(tok):
    model = make_llama(tok)
    calls = []
    model.register_forward_pre_hook(lambda _, args, kwargs: calls.append(kwargs.get("logits_to_keep")), with_kwargs=True)
    prefixes, conts = ragged(tok, (4, 2)), ragged(tok, (3, 3), seed=1)
    assert head_gives_logits(model) is None
    with torch.no_grad():
        first = token_logprobs(model, prefixes, conts)
        assert head_gives_logits(model) is True
        second = token_logprobs(model, prefixes, conts)
    assert calls == [None, 1]  # full logits once, for the check; then only the last one
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert head_gives_logits(make_llama(tok)) is None  # the answer belongs to the model it was found for


def test_gradients_reach_the_model_through_the_gathered_head(tok):
    model = make_llama(tok)
    prefixes, conts = ragged(tok, (3, 5)), ragged(tok, (2, 4), seed=1)
    for _ in range(2):  # the checking call and the fast one
        model.zero_grad()
        torch.cat(token_logprobs(model, prefixes, conts)).sum().backward()
        grad = model.get_output_embeddings().weight.grad
        assert grad is not None and grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_shared_prefix_logprobs_equal_independent_rows(tok, arch):
    model = make_llama(tok) if arch == "llama" else make_gpt2(tok, n_positions=40)
    lengths = [(1, 5, 1), (7, 2, 6), (4, 3, 3), (12, 6, 2), (0, 4, 3), (30, 8, 5), (9, 0, 4)]  # prefix, cont 1, cont 2
    prefixes = ragged(tok, [p for p, _, _ in lengths], seed=3)
    first = ragged(tok, [a for _, a, _ in lengths], seed=4)
    second = ragged(tok, [b for _, _, b in lengths], seed=5)
    # rows 4 (empty prefix), 5 (clipped by max_length=36) and 6 (empty continuation) are scored as plain rows
    with torch.no_grad():
        shared = shared_prefix_logprobs(model, prefixes, [first, second], pad_token_id=tok.pad_token_id, max_length=36)
        for k, conts in enumerate((first, second)):
            alone = token_logprobs(model, prefixes, conts, pad_token_id=tok.pad_token_id, max_length=36)
            for i, (a, b) in enumerate(zip(shared[k], alone, strict=True)):
                assert a.shape == b.shape, (k, i)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
            for i in (0, 1, 2, 3):  # and each row that fits the window equals a plain unpadded forward
                torch.testing.assert_close(shared[k][i], plain(model, prefixes[i], conts[i])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_nested_rows_read_from_the_longer_row_equal_rows_scored_alone(tok, arch):
    model = make_llama(tok) if arch == "llama" else make_gpt2(tok, n_positions=40)
    a, b, c, d, e = ragged(tok, [6, 4, 5, 3, 7], seed=6)
    # a conversation: turn 2 starts with turn 1's prompt + response, turn 3 with turn 2's
    turn1, turn2, turn3 = (a, b), (torch.cat([a, b, c]), d), (torch.cat([a, b, c, d, e]), ragged(tok, [4], seed=7)[0])
    other = (ragged(tok, [5], seed=8)[0], ragged(tok, [3], seed=9)[0])  # not nested in anything
    empty = (torch.cat([a, b]), a[:0])  # an empty response inside turn 2's row
    long_ = (torch.cat([a, b, c, d, e, a, b]), torch.cat([c, d, e]))  # 43 tokens: beyond max_length=36
    inside_long = (torch.cat([a, b, c, d, e, a]), b)  # begins the long row: must not be read from its clipped forward
    rows = [turn3, other, turn1, empty, turn2, long_, inside_long]
    prefixes, conts = [p for p, _ in rows], [q for _, q in rows]
    calls = []
    original = model.forward
    model.forward = lambda *args, **kw: calls.append(kw["input_ids"].shape) or original(*args, **kw)
    with torch.no_grad():
        nested = nested_token_logprobs(model, prefixes, conts, pad_token_id=tok.pad_token_id, max_length=36)
        assert calls[-1][0] == 4  # one forward over turn 3, other, long and inside_long (turn 1, 2, empty read from turn 3)
        alone = token_logprobs(model, prefixes, conts, pad_token_id=tok.pad_token_id, max_length=36)
    for i, (x, y) in enumerate(zip(nested, alone, strict=True)):
        assert x.shape == y.shape == conts[i].shape, i
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nested[2], plain(model, a, b)[0], rtol=1e-5, atol=1e-5)
    assert nested_token_logprobs(model, [], []) == []
    with pytest.raises(ValueError, match="got 1 prefixes but 2 continuations"):
        nested_token_logprobs(model, [a], [b, c])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_nested_scoring_gives_the_same_outputs_and_gradients_from_the_longest_rows(tok, arch):
    model = make_llama(tok) if arch == "llama" else make_gpt2(tok, n_positions=40)
    a, b, c, d, e = ragged(tok, [6, 4, 5, 3, 7], seed=6)
    turn1, turn2 = (a, b), (torch.cat([a, b, c]), d)  # turn 2's row begins with turn 1's
    other = (e, c)
    long_ = (torch.cat([a, b, c, d, e, a, b]), torch.cat([c, d]))  # 41 tokens: clipped at max_length=36
    inside_long = (torch.cat([a, b, c, d, e, a]), b)  # begins the long row: scored on its own
    rows = [turn2, other, turn1, long_, inside_long]
    prefixes, conts = [p for p, _ in rows], [q for _, q in rows]
    kw = dict(pad_token_id=tok.pad_token_id, max_length=36, entropy=True, hidden=True)
    calls, original = [], model.forward
    model.forward = lambda *args, **k: calls.append(k["input_ids"].shape) or original(*args, **k)
    outputs, grads = {}, {}
    for name in ("nested", "alone"):
        model.zero_grad()
        out = score_tokens(model, prefixes, conts, nested=name == "nested", **kw)
        per_token = out.log_probs.nan_to_num() + out.entropy + (out.hidden**2).mean(-1)  # what lies past valid is junk
        loss = torch.where(out.valid, per_token, 0.0).sum()
        loss.backward()
        outputs[name] = out
        grads[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert calls[0][0] == 3 and calls[1][0] == 5  # turns 1 and 2 read inside inside_long's row, which begins with them
    nested, alone = outputs["nested"], outputs["alone"]
    assert nested.lengths == alone.lengths == [3, 5, 4, 8, 4]
    assert torch.equal(nested.valid, alone.valid) and nested.log_probs.shape == alone.log_probs.shape
    for field in ("log_probs", "entropy", "hidden"):
        x, y = getattr(nested, field), getattr(alone, field)
        torch.testing.assert_close(x[nested.valid], y[alone.valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nested.log_probs[2, :4], plain(model, a, b)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads["nested"], grads["alone"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="nothing to score"):
        score_tokens(model, [], [], nested=True)


def brute_nesting(rows, adopters):
    """The rule compared row by row with every root: longest first, a row joins the first root so far
    among the adopters that begins with it."""
    roots, owner = [], [0] * len(rows)
    for i in sorted(range(len(rows)), key=lambda i: -len(rows[i])):
        home = next((r for r in roots if r in adopters and torch.equal(rows[r][: len(rows[i])], rows[i])), None)
        if home is None:
            roots.append(i)
            home = i
        owner[i] = home
    return sorted(roots), owner


def test_rows_nest_in_the_first_longer_row_that_begins_with_them():
    a, b, c = torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([5, 6, 1])
    rows = [a, torch.cat([a, b]), c, a.clone(), torch.cat([a, b, b]), torch.cat([c, b])]
    # by hand: the longest (4, [5 6 7 8 9 8 9]) begins rows 0, 1 and 3; row 5 ([5 6 1 8 9]) begins row 2
    assert nest_rows(rows, set(range(6))) == ([4, 5], [4, 4, 5, 4, 4, 5])
    # a row that may not adopt (clipped) stays a root, and the rows it begins join the next that may
    assert nest_rows(rows, {1, 2, 5}) == ([1, 4, 5], [1, 1, 5, 1, 4, 5])
    assert nest_rows([a, a.clone()], {0, 1}) == ([0], [0, 0])  # equal rows: the first taken owns both


def test_nesting_by_hashed_prefixes_is_the_row_by_row_rule():
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(60):  # conversations of one to three turns over a few shared openers
        turn = torch.randint(0, 4, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            rows.append(turn)
            turn = torch.cat([turn, torch.randint(0, 4, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g)])
    order = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[i] for i in order]
    adopters = {i for i in range(len(rows)) if int(torch.randint(0, 5, (1,), generator=g))}
    roots, owner = nest_rows(rows, adopters)
    assert (roots, owner) == brute_nesting(rows, adopters)
    assert len(roots) < len(rows)  # rows did nest
    assert all(torch.equal(rows[owner[i]][: len(row)], row) for i, row in enumerate(rows))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rows_with_one_prefix_read_it_once_and_equal_rows_scored_alone(tok, arch):
    model = make_llama(tok) if arch == "llama" else make_gpt2(tok, n_positions=40)
    opener, other = ragged(tok, [9, 4], seed=10)
    # a GRPO group: four conversations of one opener (two of them two turns deep), and one of another opener
    tails = ragged(tok, [3, 5, 2, 6, 4, 3], seed=11)
    conts = ragged(tok, [4, 2, 5, 3, 4, 2], seed=12)
    prefixes = [opener, opener, torch.cat([opener, tails[0], tails[1]]), opener, other, torch.cat([other, tails[2]])]
    calls = []
    original = model.forward
    model.forward = lambda *args, **kw: calls.append(kw["input_ids"].shape) or original(*args, **kw)
    scores = {}
    for share in (False, True):
        model.zero_grad()
        rows = token_logprobs(model, prefixes, conts, pad_token_id=tok.pad_token_id, share_prefix=share)
        torch.cat(rows).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        scores[share] = (rows, grads)
    assert calls[-2][0] == 4 and calls[-1][0] == 6  # the distinct prefixes (but their last token), then every row's tail
    assert calls[-2][1] == 9 + 3 + 5 - 1  # the longest distinct prefix, without its last token
    for a, b in zip(scores[True][0], scores[False][0], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores[True][0][3], plain(model, opener, conts[3])[0], rtol=1e-5, atol=1e-5)
    assert len(scores[True][1]) == len(scores[False][1]) > 0  # gradients reach the same weights, with the same values
    for a, b in zip(scores[True][1], scores[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # nothing to share (distinct prefixes, or one of a single token): the row-by-row forward
        calls.clear()
        token_logprobs(model, [opener, other], conts[:2], share_prefix=True)
        token_logprobs(model, [opener[:1], opener[:1]], conts[:2], share_prefix=True)
        assert [c[0] for c in calls] == [2, 2]
    # the hidden states a value head reads come from the tails' forward too (PPO passes use_cache=False)
    outputs = {}
    with torch.no_grad():
        for share in (False, True):
            calls.clear()
            kw = dict(pad_token_id=tok.pad_token_id, entropy=True, hidden=True, use_cache=False)
            outputs[share] = score_tokens(model, prefixes, conts, share_prefix=share, **kw)
            assert [c[0] for c in calls] == ([4, 6] if share else [6])
    for field in ("log_probs", "entropy", "hidden"):
        a, b = getattr(outputs[True], field), getattr(outputs[False], field)
        torch.testing.assert_close(a[outputs[True].valid], b[outputs[False].valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs[True].hidden[3, :3], plain(model, opener, conts[3])[2], rtol=1e-5, atol=1e-5)


def test_rows_read_after_a_shared_head_give_the_same_gradients_every_time(tok):
    """The head's cache is gathered to its rows with index_select: ``keys[index]``'s backward adds a shared
    head's gradients with parallel atomics on CPU once the cache is large, so two backward passes of one
    batch differed in the last bits (and a resumed run parted from an uninterrupted one)."""
    model = make_llama(tok)
    with torch.no_grad():
        cache = model(input_ids=torch.stack(ragged(tok, [5, 5], seed=20)), use_cache=True).past_key_values
    keys = [layer.keys.clone() for layer in cache.layers]
    index = torch.tensor([1, 0, 1, 1])
    select_cache_rows(cache, index)
    for layer, before in zip(cache.layers, keys, strict=True):
        assert torch.equal(layer.keys, before[index])  # row i is row index[i]
    # 64 rows on one 64-token head: each layer's gathered cache holds 64 x 2 x 64 x 16 values, past the
    # size where the indexing backward goes parallel
    opener = ragged(tok, [64], seed=21)[0]
    conts = ragged(tok, [3] * 64, seed=22)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(4):
            model.zero_grad()
            rows = token_logprobs(model, [opener] * 64, conts, pad_token_id=tok.pad_token_id, share_prefix=True)
            torch.cat(rows).sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(grads[0], g) for g in grads[1:])


@pytest.mark.parametrize("share", [False, True])
def test_nested_rows_with_entropy_give_the_same_log_probs_and_each_position_s_entropy(tok, share):
    model = make_llama(tok)
    a, b, c, d = ragged(tok, [6, 4, 5, 3], seed=13)
    # two conversations of one opener (a GRPO group), turn 2 of the first nesting its turn 1
    prefixes, conts = [a, torch.cat([a, b, c]), a], [b, d, c]
    kw = dict(pad_token_id=tok.pad_token_id, share_prefix=share)
    with torch.no_grad():
        plain_rows = nested_token_logprobs(model, prefixes, conts, **kw)
        rows, entropies = nested_token_logprobs(model, prefixes, conts, entropy=True, **kw)
        for prefix, cont, row, want, entropy in zip(prefixes, conts, rows, plain_rows, entropies, strict=True):
            torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)
            full = torch.cat([prefix, cont])
            logits = model(input_ids=full[None]).logits[0, len(prefix) - 1 : len(full) - 1].float()
            hand = torch.distributions.Categorical(logits=logits).entropy()  # -sum_v p_v log p_v at each position
            assert entropy.shape == cont.shape
            torch.testing.assert_close(entropy, hand, rtol=1e-4, atol=1e-5)
        assert token_logprobs(model, [], [], entropy=True) == ([], [])


def test_mean_logprobs_are_float32_row_means_with_the_empty_value_unrounded():
    from astrl.lm_scoring import mean_logprobs

    rows = [torch.tensor([-1.0, -3.0]), torch.zeros(0, dtype=torch.bfloat16), torch.tensor([-2.5], dtype=torch.bfloat16)]
    means = mean_logprobs(rows, -7.3)
    assert means.dtype == torch.float32 and means.device.type == "cpu"
    assert means.tolist() == pytest.approx([-2.0, -7.3, -2.5], abs=1e-6)  # -7.3 in bf16 would be -7.3125
    assert mean_logprobs([], -7.3).shape == (0,)
