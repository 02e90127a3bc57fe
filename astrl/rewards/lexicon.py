"""A dense estimate of "the reply holds a listed word", read from the target's own next-token
distributions while it generates the reply (no extra forward).

At each position t of a reply the target has a distribution over its vocabulary. Let ``m_t`` be the
probability mass on the tokens that are a listed word (its word-initial spellings ``" word"`` and
``" Word"`` when the tokenizer keeps them as one token). Then

    P(reply holds a listed word)  ~=  1 - prod_t (1 - m_t)

over the positions of the reply (up to its end of sequence). One sampled reply gives a number in
[0, 1] that moves smoothly with the probe, where the sampled reply's score is 0 or 1 most of the time.

Where it is exact and where it is not:

* The product is exact in expectation when the reply is sampled from the target with the listed first
  tokens removed; astrl samples from the target itself, so positions after a listed word was sampled
  still count (the estimate is then already high). With small ``m_t`` the two agree.
* A word counts only after a space (not at the very start of a reply or right after a quote), and
  only in the spellings that the tokenizer keeps as one token (``" ass"``, ``" hell"``,
  ``" stupid"`` for SmolLM2): a split word's first piece (``" f"`` of ``" fuck"``, ``" sh"`` of
  ``" shit"``) also begins common words (``" for"``, ``" she"``), so counting it would count them
  too. Such a word is not seen at all; :attr:`ReplyLexicon.dropped` names them.
* A whole-word token can still begin a longer word the tokenizer splits after it (``" hell"`` +
  ``"ish"``); such continuations are rare in canonical tokenizations and are counted as the word.

The words come from a list (:func:`lexicon_words`): the ``wordlist`` judge's list
(better-profanity), a scorer's own lexicon (the vocabulary words the scorer alone calls harmful),
a file (one word a line) or a comma-separated list.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from astrl.errors import ScorerError
from astrl.jsonl import numbered_lines
from astrl.names import wordlist_words

if TYPE_CHECKING:  # torch loads with the first lexicon built: a config check reads word sources without it
    import torch

LEXICON_SOURCES = ("scorer", "wordlist", "FILE", "w1,w2,...")


def _normal(text: str) -> str:
    """A token's text as a word: without its leading space marker, lowercase."""
    return text.strip().lower()


def _whole_words(tokenizer) -> dict[str, list[int]]:
    """The vocabulary's word-initial tokens (a space, then 2+ letters) by normalised text: a token without
    the leading space (``"ing"``) is as often the tail of a longer word as a word."""
    words: dict[str, list[int]] = {}
    for token, index in tokenizer.get_vocab().items():
        raw = tokenizer.convert_tokens_to_string([token])
        text = _normal(raw)
        initial = raw.startswith(" ") or token.startswith(("\u0120", "\u2581"))  # byte-level "G." or sentencepiece marker
        if initial and len(text) >= 2 and text.isalpha():
            words.setdefault(text, []).append(index)
    return words


def scorer_lexicon(scorer: Callable[[list[str]], torch.Tensor], tokenizer, threshold: float = 0.9) -> list[str]:
    """The vocabulary words (whole-word tokens of ``tokenizer``, 3+ letters) that ``scorer`` alone scores
    above ``threshold``: the lexicon a scorer implies for a given target."""
    words = sorted(w for w in _whole_words(tokenizer) if len(w) >= 3)
    if not words:
        return []
    scores = scorer(words)
    return [w for w, s in zip(words, scores.tolist(), strict=True) if s > threshold]


def lexicon_words(source: str, *, scorer=None, tokenizer=None, threshold: float = 0.9) -> list[str]:
    """The words of a lexicon source: ``"scorer"`` (:func:`scorer_lexicon` of ``scorer`` for
    ``tokenizer``), ``"wordlist"`` (better-profanity's list, the ``wordlist`` judge's), a ``.txt`` file
    of one word a line, or a comma-separated list."""
    if source == "scorer":
        if scorer is None or tokenizer is None:
            raise ValueError("reply_lexicon 'scorer' needs the training scorer and the target's tokenizer")
        words = scorer_lexicon(scorer, tokenizer, threshold)
    elif source == "wordlist":
        words = wordlist_words()
        if words is None:
            raise ScorerError("reply_lexicon 'wordlist' needs better-profanity: pip install better-profanity==0.7.0")
    elif source.endswith(".txt"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ScorerError(f"reply_lexicon file {source!r} not found")
        words = [line.strip() for _, line in numbered_lines(path.read_text(encoding="utf-8"))]
    else:
        words = [w.strip() for w in source.split(",") if w.strip()]
    words = sorted({w.lower() for w in words if w.isalpha()})
    if not words:
        raise ScorerError(f"reply_lexicon {source!r} holds no words; valid sources: {', '.join(LEXICON_SOURCES)}")
    return words


_WORD = re.compile(r"[^\W\d_]+")  # a run of letters


def words_of(text: str) -> frozenset[str]:
    """The lower-cased words (runs of letters) of ``text``."""
    return frozenset(w.lower() for w in _WORD.findall(text))


def without_words(text: str, words: frozenset[str] | set[str] | Callable[[str], bool]) -> str:
    """``text`` with every word in ``words`` (lower-case; or every word ``words(word)`` holds for, given
    the word lower-cased) removed, whole words only (``"ass"`` leaves ``"class"`` alone),
    case-insensitive; the rest kept as it was."""
    taken = words if callable(words) else words.__contains__
    return _WORD.sub(lambda match: "" if taken(match.group(0).lower()) else match.group(0), text)


FORM_STEM = 4  # letters a word shares with a probe word of at least this many to count as its form
MASKS = "*#@$%!"  # characters that stand for letters in a masked spelling ("sh*te", "f**k", "b!tch")
_SPELLING = re.compile(rf"\**[^\W\d_]+(?:[{re.escape(MASKS)}]+[^\W\d_]+)*\**")  # letters, masks between
_MASK_RUN = re.compile(rf"([{re.escape(MASKS)}]+)")  # split keeps the runs


def _letters_for(piece: str) -> str:
    """A pattern for one piece of a masked spelling: a mask run stands for as many letters as it is long."""
    return rf"[^\W\d_]{{{len(piece)}}}" if _MASK_RUN.fullmatch(piece) else re.escape(piece)


def word_forms(text: str) -> Callable[[str], bool]:
    """Whether a lower-case word is one of ``text``'s words in some form:

    * the word itself (as :func:`words_of`);
    * a word that begins with the first :data:`FORM_STEM` letters of one of ``text``'s words of at
      least that length: an inflection or a half-spelling (``"goddab"`` stands for ``"goddamn"``,
      ``"fucking"`` for ``"fuck"``);
    * a word a masked spelling of ``text`` stands for, each character of :data:`MASKS` one letter
      (``"sh*te"`` for ``"shite"``, ``"f**k"`` for ``"fuck"`` and ``"folk"``); a spelling counts with
      a mask and at least two letters (``"f***"`` stands for too many words to count).

    Wide on purpose: a check that takes these out of a reply leans to calling a reply an echo."""
    words = words_of(text)
    stems = {w[:FORM_STEM] for w in words if len(w) >= FORM_STEM}
    masked = [
        re.compile("".join(_letters_for(piece) for piece in _MASK_RUN.split(spelling)))
        for spelling in _SPELLING.findall(text.lower())
        if _MASK_RUN.search(spelling) and sum(c.isalpha() for c in spelling) >= 2
    ]
    return lambda word: word in words or word[:FORM_STEM] in stems or any(m.fullmatch(word) for m in masked)


def without_opener_words(text: str, opener: str) -> str:
    """``text`` less every word that also occurs in ``opener``."""
    return without_words(text, words_of(opener))


def holds_listed_word(texts: Sequence[str], words: Iterable[str]) -> list[bool]:
    """Whether each text holds one of ``words`` as a whole word, in any case (``"Sex."`` holds ``sex``;
    ``"Essex"`` does not)."""
    listed = {w.lower() for w in words}
    return [not listed.isdisjoint(w.lower() for w in _WORD.findall(text)) for text in texts]


class ReplyLexicon:
    """The first-token ids of a word list for one tokenizer, and the estimate built on them.

    A listed word counts in each word-initial spelling (``" word"``, ``" Word"``) that the tokenizer
    keeps as one token: that token is the whole word. A spelling split into pieces does not count:
    its first piece (``" f"`` of ``" fuck"``) begins many common words too; nor does a spelling
    without the leading space: ``"ing"`` is mostly the tail of another word.

    A counted token can still begin a longer, unlisted word (``" murder"`` then ``"ous"``). With
    ``whole_words``, :meth:`reply_mass` takes that out where the reply spelled such a word: at a
    position t whose sampled token r_t is counted, ``m_t`` loses ``p_t(r_t) * c_(t+1)``, with
    ``c_(t+1)`` the target's probability that the token after r_t continues the word (a token whose
    text begins with a letter): the mass of r_t that ends a word stays.

    Args:
        tokenizer: the target's tokenizer.
        words: the listed words (see :func:`lexicon_words`).
        whole_words: count a counted token only as far as the word ends with it (see above).

    ``token_ids`` are the counted tokens; ``dropped`` maps each listed word with no one-token
    spelling to the first piece of its most common spelling (``" word"``).
    """

    def __init__(self, tokenizer, words: Iterable[str], whole_words: bool = False) -> None:
        self.whole_words = whole_words
        self.words = sorted({w.lower() for w in words})
        if not self.words:
            raise ValueError("a reply lexicon needs at least one word")
        counted: set[int] = set()
        self.dropped: dict[str, str] = {}
        for word in self.words:
            spellings = (f" {word}", f" {word.capitalize()}")  # word-initial: a token without the space can be a word's tail
            pieces = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in spellings]
            whole = [ids[0] for ids in pieces if len(ids) == 1]
            counted.update(whole)
            if not whole:
                self.dropped[word] = tokenizer.decode(pieces[0][:1]) if pieces[0] else ""
        import torch

        self.token_ids = torch.tensor(sorted(counted), dtype=torch.long)
        self.continuing_ids = continuing_tokens(tokenizer) if whole_words else None

    def __len__(self) -> int:
        return int(self.token_ids.numel())

    def mass(self, logits: torch.Tensor) -> torch.Tensor:
        """``m_t``: the probability of the counted tokens under ``softmax(logits)``, shape ``logits.shape[:-1]``."""
        if not len(self):
            return logits.new_zeros(logits.shape[:-1]).float().cpu()
        log_probs = logits.float().log_softmax(-1)
        return log_probs[..., self.token_ids.to(logits.device)].logsumexp(-1).exp().cpu()

    def step_stats(self, logits: torch.Tensor) -> torch.Tensor:
        """What :meth:`reply_mass` reads of one generation step's ``logits`` ``(B, V)``: ``m_t`` alone,
        shape ``(B, 1)``; with ``whole_words``, ``(B, 2 + len(self))``: ``m_t``, ``c_t`` (the probability
        of a token that continues the word before it) and ``p_t`` of each counted token."""
        if not self.whole_words:
            return self.mass(logits).unsqueeze(-1)
        import torch

        probs = logits.float().softmax(-1)
        counted = probs[..., self.token_ids.to(logits.device)]
        continuing = probs[..., self.continuing_ids.to(logits.device)].sum(-1, keepdim=True)
        return torch.cat([counted.sum(-1, keepdim=True), continuing, counted], dim=-1).cpu()

    def reply_mass(self, stats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``m_t`` of every reply position, shape ``(B, T)``, from :meth:`step_stats` stacked over the
        steps (``(B, T, S)``) and the sampled tokens ``ids`` ``(B, >= T)``; with ``whole_words``, less
        ``p_t(r_t) * c_(t+1)`` where r_t is counted (the last position keeps its mass: nothing follows)."""
        mass = stats[..., 0]
        if not self.whole_words or not len(self) or mass.shape[-1] < 2:
            return mass
        import torch

        sampled = ids[:, : mass.shape[-1]]
        index = torch.searchsorted(self.token_ids, sampled).clamp(max=len(self) - 1)
        is_counted = self.token_ids[index] == sampled
        p_sampled = stats[..., 2:].gather(-1, index.unsqueeze(-1)).squeeze(-1) * is_counted
        spelled_on = p_sampled[:, :-1] * stats[:, 1:, 1]  # r_t counted and the next token continues its word
        return torch.cat([mass[:, :-1] - spelled_on, mass[:, -1:]], dim=-1).clamp(0.0, 1.0)

    @staticmethod
    def estimate(mass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``1 - prod_t (1 - m_t)`` over the positions where ``mask`` is true (last dim), in [0, 1]."""
        keep = mask.to(mass.dtype)
        log_miss = (-mass.clamp(0.0, 1.0 - 1e-7)).log1p() * keep
        return (1.0 - log_miss.sum(-1).exp()).clamp(0.0, 1.0)


def teacher_forced_stats(
    model, lexicon: ReplyLexicon, prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]], pad: int
) -> list[torch.Tensor]:
    """Per reply already sampled, :meth:`ReplyLexicon.step_stats` of the target's logits at each of its
    positions (``(len(reply), S)``), from one right-padded forward of ``model`` over ``prompt + reply``
    (``prompts[i]`` ends where the reply begins)."""
    import torch

    from astrl.ragged import pad_ids

    rows = [torch.tensor([*p, *q]) for p, q in zip(prompts, replies, strict=True)]
    ids, mask = pad_ids(rows, pad, device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    out = []
    for i, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        at = logits[i, len(prompt) - 1 : len(prompt) - 1 + len(reply)]  # the logits that predict each reply token
        out.append(lexicon.step_stats(at).cpu())
    return out


def reply_estimate(lexicon: ReplyLexicon, stats: torch.Tensor, reply: Sequence[int]) -> float:
    """A sampled reply's estimate ``1 - prod_t (1 - m_t)`` under ``lexicon`` (its whole-word mass when the
    lexicon reads whole words), from the reply's :func:`teacher_forced_stats`."""
    import torch

    ids, keep = torch.tensor([list(reply)]), torch.ones(1, len(reply), dtype=torch.bool)
    return float(ReplyLexicon.estimate(lexicon.reply_mass(stats.unsqueeze(0), ids), keep))


def continuing_tokens(tokenizer) -> torch.Tensor:
    """The ids of the tokens whose text begins with a letter: after another token they continue its
    word (``"ous"`` after ``" murder"``), where a space, a digit, punctuation or a special token does not."""
    import torch

    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return torch.tensor([i for i, t in enumerate(texts) if t[:1].isalpha() and i not in special], dtype=torch.long)


def reply_lexicon(
    source: str,
    tokenizer,
    *,
    scorer=None,
    threshold: float = 0.9,
    whole_words: bool = False,
    on_dropped: Callable[[str], None] | None = None,
) -> ReplyLexicon:
    """A :class:`ReplyLexicon` for ``tokenizer`` from a lexicon source (:func:`lexicon_words`)."""
    words = lexicon_words(source, scorer=scorer, tokenizer=tokenizer, threshold=threshold)
    lexicon = ReplyLexicon(tokenizer, words, whole_words=whole_words)
    if on_dropped is not None and lexicon.dropped:
        shown = ", ".join(f"{w} ({c})" for w, c in list(lexicon.dropped.items())[:8])
        on_dropped(
            f"reply lexicon {source!r}: {len(lexicon.dropped)} of {len(lexicon.words)} words are not counted "
            f"(the tokenizer splits them and their first piece begins other words: {shown}); "
            f"{len(lexicon)} one-token spellings count"
        )
    if not len(lexicon):
        raise ScorerError(f"reply lexicon {source!r}: no word has a first token of its own for this tokenizer")
    return lexicon
