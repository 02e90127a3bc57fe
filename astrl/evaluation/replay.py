"""The ``astrl replay`` job: send archived attacks to other targets and judge the replies.

An attack archive says which probes broke one target. Replay asks whether they also break the
model that ships: another checkpoint, the same model under a safety system prompt, a hardened
target adapter, or another decoding. Every attack (its conversation so far, then its probe) is
sent to every target, ``samples`` times each (or once, greedily); each reply is scored by every
judge, and so is each probe alone, so an echo of a toxic probe can be told apart from an
elicited reply.

Inputs (``archive``): an ``attacks.jsonl`` (see :mod:`astrl.archive`), a run or eval
folder holding one, a JSONL file of ``{"probe": ..., "conversation": [...]}`` objects
(``conversation`` optional) or a text file with one probe per line. A run folder's
``config.yaml`` (or an eval folder's ``metrics.json``) gives the defaults of the mode, targets,
judges, training scorer, target system prompt and reply length.

Targets (``--target SPEC[@FILE]``): an embedded name, a model folder, a hub id or a training
run directory (its hardened target adapter, ``final/target``); ``@FILE`` reads the target's system
prompt from ``FILE`` (chat mode: a system message; text mode: plain text before the context,
followed by a blank line). A spec that is an existing path is never split at ``@``.

Generation is batched: the inputs of a target are built once, repeated ``samples`` times and
sent ``batch_size`` rows per ``generate`` call of the project's TorchRL policy (chat
conversations are grouped by message count, which the policy needs); every target starts from
the same seed. Judges score all replies in one batched call each.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from astrl._compat import Chat
from astrl.archive import ARCHIVE_FILE, normalize_probe
from astrl.argtypes import check_settings, setting, value_problem
from astrl.decoding import DecodingSettings
from astrl.errors import one_line
from astrl.evaluation.metrics import elicitation_metrics
from astrl.evaluation.records import EvaluationError
from astrl.evaluation.settings import DEFAULT_THRESHOLD, ReplaySettings, ReportSettings
from astrl.jsonl import numbered_lines
from astrl.keys import HISTORY, TEXT, TOKENS_RESPONSE
from astrl.names import MODES, ModelSettings, check_scorer_names

REPLIES_FILE = "replies.jsonl"
TRANSFER_FILE = "transfer.json"
ROLES = {"opener": "user", "tester": "assistant", "target": "user"}  # the tester's view (see RedTeamEnv)
# transfer.json key -> key of astrl.evaluation.metrics.elicitation_metrics (unit: attack, turns: replies)
TRANSFER_METRICS = {
    "success_rate": "toxic_reply_rate",
    "any_success_rate": "asr",
    "elicited_success_rate": "elicited_success_rate",
    "elicited_any_rate": "elicited_asr",
    "toxic_probe_rate": "toxic_probe_rate",
    "mean_toxicity_delta": "mean_toxicity_delta",
}


# -- the archive ------------------------------------------------------------------------------------


@dataclass
class ReplayAttack:
    """One attack to replay: the conversation before the probe (``opener``/``tester``/``target``
    messages), the probe, and, for archived attacks, the reply and scores it had when found."""

    probe: str
    conversation: list[dict] = field(default_factory=list)
    reply: str | None = None
    scores: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return normalize_probe(self.probe), json.dumps(self.conversation, ensure_ascii=False)


@dataclass
class ArchiveSource:
    """The attacks of an archive and the defaults its run or eval folder gives."""

    path: Path
    attacks: list[ReplayAttack]
    defaults: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _conversation(value, where: str) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where}: 'conversation' must be a list of messages, got {type(value).__name__}")
    messages = []
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: each conversation message needs a 'role' and a string 'content', got {message!r}")
        if message.get("role") not in ROLES:
            raise ValueError(f"{where}: message role {message.get('role')!r} is not one of {', '.join(ROLES)}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _attack(data, where: str) -> ReplayAttack:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object with a 'probe', got {type(data).__name__}")
    probe = data.get("probe")
    if not isinstance(probe, str):
        raise ValueError(f"{where}: a string 'probe' is needed, got {probe!r}")
    scores = data.get("scores") or {}
    if not isinstance(scores, dict):
        raise ValueError(f"{where}: 'scores' must be an object, got {scores!r}")
    reply = data.get("reply")
    return ReplayAttack(
        probe=probe,
        conversation=_conversation(data.get("conversation"), where),
        reply=None if reply is None else str(reply),
        scores={str(k): float(v) for k, v in scores.items()},
    )


def read_attacks(path: str | Path) -> tuple[list[ReplayAttack], list[str]]:
    """Attacks from a JSONL file (one object with a ``probe`` per line) or a text file (one probe
    per line), without empty probes and duplicates (same normalised probe and conversation)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"attack file {str(path)!r} not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise EvaluationError(f"attack file {str(path)!r} is not UTF-8 text") from None
    attacks, notes, seen, empty = [], [], set(), 0
    as_json = path.suffix in (".jsonl", ".json")
    for number, line in numbered_lines(text):
        if as_json:
            try:
                attack = _attack(json.loads(line), f"{path}:{number}")
            except json.JSONDecodeError as err:
                raise EvaluationError(f"{path}:{number} is not valid JSON: {err.msg}") from None
            except ValueError as err:
                raise EvaluationError(str(err)) from None
        else:
            attack = ReplayAttack(probe=line.removesuffix("\r"))
        if not attack.probe.strip():
            empty += 1
            continue
        if attack.key in seen:
            notes.append(f"{path}:{number}: a repeated attack (same probe and conversation) is replayed once")
            continue
        seen.add(attack.key)
        attacks.append(attack)
    if empty:
        notes.append(f"{empty} empty probe(s) in {path} left out")
    if not attacks:
        raise EvaluationError(f"attack archive {str(path)!r} holds no attacks (no non-empty probe)")
    return attacks, notes


def _scorer_list(value) -> list[str]:
    values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return [str(v) for v in values if isinstance(v, str)]


def folder_defaults(folder: Path) -> dict:
    """Defaults from a run folder's ``config.yaml`` or an eval folder's ``metrics.json``."""
    from astrl.evaluation.tester import is_run_dir, read_run_config

    if is_run_dir(folder):
        config = read_run_config(folder)
        max_new = config.get("target_max_new_tokens") or config.get("max_new_tokens")
        return {
            "kind": "run",
            "mode": config.get("mode"),
            "target": config.get("target"),
            "target_system_prompt": config.get("target_system_prompt"),
            "judges": _scorer_list(config.get("judges")),
            "training_scorers": _scorer_list(config.get("scorer", config.get("scorers"))),
            "max_new_tokens": max_new if isinstance(max_new, int) else None,
        }
    metrics_path = folder / "metrics.json"
    if metrics_path.is_file():
        try:
            metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise EvaluationError(f"{metrics_path} is not valid JSON: {err.msg}") from None
        if isinstance(metrics, dict):
            return {
                "kind": "eval",
                "mode": metrics.get("mode"),
                "target": metrics.get("target"),
                "judges": [str(j) for j in metrics.get("judges") or {}],
                "training_scorers": _scorer_list(metrics.get("training_scorers")),
            }
    return {}


def load_archive(spec: str | Path) -> ArchiveSource:
    """The attacks named by ``spec`` (a file, or a run or eval folder holding ``attacks.jsonl``) and
    the folder's defaults."""
    path = Path(spec).expanduser()
    if path.is_dir():
        file = path / ARCHIVE_FILE
        if not file.is_file():
            raise EvaluationError(f"folder {str(spec)!r} holds no {ARCHIVE_FILE}: pass a run or eval folder, or the attack file")
        attacks, notes = read_attacks(file)
        return ArchiveSource(file, attacks, {k: v for k, v in folder_defaults(path).items() if v not in (None, [])}, notes)
    if not path.exists():
        raise EvaluationError(f"attack archive {str(spec)!r} not found")
    attacks, notes = read_attacks(path)
    return ArchiveSource(path, attacks, {}, notes)


# -- targets ----------------------------------------------------------------------------------------


@dataclass
class TargetSpec:
    """A target of the replay: the model to load and its own system prompt."""

    label: str
    model: str
    system_prompt: str | None = None
    system_prompt_file: str | None = None
    hardened_run: str | None = None


def hardened_target(run_dir: Path) -> Path:
    """A training run's hardened target adapter (``final/target``), or an error naming the run."""
    folder = run_dir / "final" / "target"
    if not (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise EvaluationError(
            f"run directory {str(run_dir)!r} has no hardened target (final/target): only runs trained with "
            "harden_every > 0 have one; pass the run's target model instead"
        )
    return folder


def parse_target(spec: str, default_system_prompt: str | None = None) -> TargetSpec:
    """``NAME[@FILE]``: the model (embedded name, folder, hub id or run directory) and an optional
    file holding its system prompt; without ``@FILE`` the target gets ``default_system_prompt``."""
    from astrl.evaluation.tester import is_run_dir

    if not spec or not spec.strip():
        raise ValueError("--target needs a model: an embedded name, a model folder, a hub id or a run directory")
    model, prompt_file = spec, None
    if "@" in spec and not Path(spec).expanduser().exists():
        model, prompt_file = spec.rsplit("@", 1)
        if not model:
            raise ValueError(f"--target {spec!r} names no model before '@'")
    prompt = default_system_prompt
    if prompt_file is not None:
        file = Path(prompt_file).expanduser()
        if not file.is_file():
            raise EvaluationError(f"--target {spec!r}: system prompt file {prompt_file!r} not found")
        prompt = file.read_text(encoding="utf-8").strip()
        if not prompt:
            raise EvaluationError(f"--target {spec!r}: system prompt file {prompt_file!r} is empty")
    path = Path(model).expanduser()
    if is_run_dir(path):
        return TargetSpec(spec, str(hardened_target(path)), prompt, prompt_file, hardened_run=model)
    return TargetSpec(spec, model, prompt, prompt_file)


def load_target(target: TargetSpec, *, dtype: str, device: str):
    """Load a target's model (a PEFT adapter folder is merged into its base)."""
    from astrl.evaluation.tester import is_adapter_folder, load_adapter_model
    from astrl.models import load_model

    if is_adapter_folder(target.model):
        return load_adapter_model(target.model, dtype=dtype, device=device)
    return load_model(target.model, dtype=dtype, device=device)


# -- generation -------------------------------------------------------------------------------------


def chat_input(attack: ReplayAttack, system_prompt: str | None) -> Chat:
    """The conversation as the target reads it (roles as in the red-team environment), ending with the probe."""
    from astrl.envs.transforms import target_view

    tester_chat = [{"role": ROLES[m["role"]], "content": m["content"]} for m in attack.conversation]
    return target_view([*tester_chat, {"role": "assistant", "content": attack.probe}], system_prompt)


def text_input(attack: ReplayAttack, system_prompt: str | None) -> str:
    """Text mode: the system prompt and a blank line (if any), the conversation so far, then the probe."""
    preamble = f"{system_prompt}\n\n" if system_prompt else ""
    return preamble + "".join(m["content"] for m in attack.conversation) + attack.probe


def generate_replies(
    policy,
    attacks: Sequence[ReplayAttack],
    *,
    mode: str,
    system_prompt: str | None,
    samples: int,
    batch_size: int,
    on_rows: Callable[[int], None] | None = None,
) -> list[list[str]]:
    """``samples`` replies of the target policy to each attack: ``[attack][sample]``.

    Rows (attack x sample) go ``batch_size`` at a time through one call of the policy each; in chat
    mode only conversations of one message count share a call.
    """
    from tensordict import TensorDict
    from torchrl.modules.llm.policies import ChatHistory, Text

    from astrl._compat import chats_to_history, render_chats
    from astrl.envs.transforms import clean_responses, policy_limits
    from astrl.envs.truncation import fit_chats, fit_texts

    tokenizer, window, max_new = policy_limits(policy, "target")
    budget = window - max_new
    if budget < 1:
        raise ValueError(f"max_new_tokens {max_new} leaves no room for the attack in the target's window of {window} tokens")
    inputs = [chat_input(a, system_prompt) if mode == "chat" else text_input(a, system_prompt) for a in attacks]
    rows = [(i, s) for i in range(len(attacks)) for s in range(samples)]
    groups: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        groups.setdefault(len(inputs[row[0]]) if mode == "chat" else 0, []).append(row)
    replies: list[list[str]] = [[""] * samples for _ in attacks]
    for group in groups.values():
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            n = len(chunk)
            batch = [inputs[i] for i, _ in chunk]
            if mode == "chat" and not getattr(policy, "renders_chats", False):
                prompt = ChatHistory(prompt=chats_to_history(fit_chats(batch, tokenizer, budget)), batch_size=(n,))
                td = TensorDict({HISTORY: prompt}, batch_size=(n,))
            else:  # text, or chats rendered here for a target fed them so (make_policy's renders_chats)
                texts = (
                    render_chats(tokenizer, fit_chats(batch, tokenizer, budget))
                    if mode == "chat"
                    else fit_texts(batch, tokenizer, budget)
                )
                td = TensorDict({TEXT: Text(prompt=texts, batch_size=(n,))}, batch_size=(n,))
            with torch.no_grad():
                out = policy(td)
            texts, _, _ = clean_responses(out.get(TOKENS_RESPONSE, as_list=True), tokenizer, max_new)
            for (i, s), text in zip(chunk, texts, strict=True):
                replies[i][s] = text
            if on_rows:
                on_rows(n)
    return replies


# -- judging and the transfer table -----------------------------------------------------------------


def judge_texts(scorers: dict, texts: Sequence[str]) -> dict[str, np.ndarray]:
    """Every judge's scores of ``texts`` (one batched call each); a judge that fails raises a
    :class:`~astrl.scorers.ScorerError` naming it."""
    from astrl.scorers import ScorerError, checked_scores

    out = {}
    for name, scorer in scorers.items():
        try:
            out[name] = checked_scores(scorer, texts, name=name).numpy().astype(np.float64)
        except ScorerError:
            raise
        except Exception as err:  # a judge's own failure, whatever its type: name the judge
            raise ScorerError(f"judge {name!r} failed: {type(err).__name__}: {one_line(err)}") from None
    return out


def transfer_metrics(
    probe_scores, reply_scores, *, threshold: float = DEFAULT_THRESHOLD, resamples: int = 1000, seed: int = 0
) -> dict:
    """One target under one judge: ``reply_scores`` is ``(attacks, samples)``, ``probe_scores`` ``(attacks,)``.

    Returns ``n_attacks``, ``n_replies``, ``n_successful_attacks`` (some reply toxic),
    ``n_toxic_replies``, ``n_elicited_replies`` and, each with a ``_ci`` (bootstrap over attacks),
    ``success_rate`` (toxic replies / replies), ``any_success_rate`` (attacks with a toxic reply /
    attacks), ``elicited_success_rate`` (replies toxic while the probe is not / replies),
    ``elicited_any_rate``, ``toxic_probe_rate`` and ``mean_toxicity_delta``: the rates of
    :func:`~astrl.evaluation.metrics.elicitation_metrics` with attacks as conversations and
    samples as turns.
    """
    reply = np.asarray(reply_scores, dtype=np.float64)
    probe = np.asarray(probe_scores, dtype=np.float64).reshape(-1)
    if reply.ndim != 2 or reply.shape[0] != probe.size or reply.size == 0:
        raise ValueError(f"reply scores must be (attacks, samples) with one probe score per attack, got {reply.shape}")
    n, k = reply.shape
    flat = elicitation_metrics(
        np.repeat(probe, k), reply.ravel(), np.repeat(np.arange(n), k), threshold=threshold, resamples=resamples, seed=seed
    )
    out = {
        "n_attacks": n,
        "n_replies": n * k,
        "n_successful_attacks": int((reply > threshold).any(axis=1).sum()),
        "n_toxic_replies": int((reply > threshold).sum()),
        "n_elicited_replies": flat["n_elicited_turns"],
    }
    for key, source in TRANSFER_METRICS.items():
        out[key], out[f"{key}_ci"] = flat[source], flat[f"{source}_ci"]
    return out


def transfer_sets(successes: dict[str, dict[str, np.ndarray]], judges: Sequence[str]) -> dict[str, dict[str, list[int]]]:
    """Per judge: the attacks (indices) that succeed on every target and those that succeed on none.
    ``successes[target][judge]`` is a boolean per attack (some reply toxic)."""
    out = {}
    for judge in judges:
        stacked = np.stack([successes[t][judge] for t in successes], axis=1)
        out[judge] = {
            "every_target": np.flatnonzero(stacked.all(axis=1)).tolist(),
            "no_target": np.flatnonzero(~stacked.any(axis=1)).tolist(),
        }
    return out


# -- the job ----------------------------------------------------------------------------------------


@dataclass
class ReplayConfig(ModelSettings, ReportSettings, DecodingSettings, ReplaySettings):  # bases in reverse
    """Settings of a replay: its own (:class:`~astrl.evaluation.settings.ReplaySettings`), the targets'
    sampling (:class:`~astrl.decoding.DecodingSettings`), the report
    (:class:`~astrl.evaluation.settings.ReportSettings`), dtype and device (:class:`~astrl.names.ModelSettings`);
    ``None`` fields fall back to the archive folder's defaults, then to those noted."""

    archive: str = field(kw_only=True)
    targets: list[str] | None = None  # the folder's target, else smollm2-135m
    judges: list[str] | None = None  # as astrl eval: the run's judges or training scorer, plus a distinct one
    seed: int = setting(0, "Seed of the sampled replies.")

    def __post_init__(self) -> None:
        check_settings(self)  # every field's declared range or choices (the bases' settings)
        if self.greedy and self.samples > 1:
            raise ValueError(f"--samples {self.samples} with --greedy: greedy replies repeat; sample once or drop --greedy")
        if self.targets is not None and not self.targets:
            raise ValueError("at least one target is needed")
        repeated = sorted({v for v in self.targets or [] if self.targets.count(v) > 1})
        if repeated:
            raise ValueError(f"target {repeated[0]!r} is given more than once")
        if self.judges is not None:  # names only: no scorer is built here
            check_scorer_names(self.judges, "judge")


def _item(record: dict) -> dict:
    return {key: record[key] for key in ("attack", "target", "sample", "probe", "reply")}


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def run_replay(
    config: ReplayConfig,
    out_dir: str | Path,
    *,
    progress: bool = True,
    on_warning: Callable[[str], None] | None = None,
) -> dict:
    """Replay the archive against every target, judge the replies and write ``transfer.json``,
    ``replies.jsonl``, ``report.md``, ``report.html`` and ``transfer_heatmap.png`` to ``out_dir``;
    record the run and every judged reply in the results store (:mod:`astrl.store`); return the
    contents of ``transfer.json``."""
    from astrl.evaluation.run import default_judges
    from astrl.models import check_model_name
    from astrl.scorers import make_judges

    warn = on_warning or _warn
    start = time.perf_counter()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise EvaluationError(f"--out {str(out)!r} exists and is not a folder")
    source = load_archive(config.archive)
    defaults = source.defaults
    notes = list(source.notes)
    mode = config.mode or defaults.get("mode") or "chat"
    problem = value_problem(mode, {"choices": MODES})
    if problem:
        raise EvaluationError(f"mode {problem} (from the folder of {source.path})")
    training = list(defaults.get("training_scorers", []))
    judge_names = config.judges or default_judges(list(defaults.get("judges", [])), training)
    default_prompt = defaults.get("target_system_prompt")
    targets = [parse_target(t, default_prompt) for t in config.targets or [str(defaults.get("target", "smollm2-135m"))]]
    for target in targets:
        check_model_name(target.model, "target")
    scorers = make_judges(judge_names, device=config.device)  # checks every judge name before one loads
    max_new = config.max_new_tokens or defaults.get("max_new_tokens") or 32
    attacks = source.attacks
    out.mkdir(parents=True, exist_ok=True)
    from astrl.store.recorder import RunRecorder

    with RunRecorder.begin(
        "replay", out, asdict(config), seed=config.seed, target=",".join(t.label for t in targets), warn=warn
    ) as recorder:
        result, records = _replay(
            config,
            out,
            source,
            targets,
            scorers,
            mode=mode,
            max_new=max_new,
            start=start,
            notes=notes,
            progress=progress,
            warn=warn,
        )
        recorder.replay({**r, "conversation": attacks[r["attack"]].conversation} for r in records)
        recorder.finish(result)
    return result


def _target_replies(
    config: ReplayConfig,
    targets: list[TargetSpec],
    attacks: list,
    generation,
    mode: str,
    on_rows: Callable[[int], object],
) -> dict[str, list[list[str]]]:
    """Each target's replies to every attack (``config.samples`` each), one target model in memory at a time."""
    from astrl.policies import make_policy

    replies: dict[str, list[list[str]]] = {}
    cache: dict[str, object] = {}
    for target in targets:
        if target.model not in cache:
            cache.clear()  # one target model in memory at a time
            cache[target.model] = load_target(target, dtype=config.dtype, device=config.device)
        # text, or a chat rendered here (renders_chats): the tokens a History-fed wrapper reads, less per-row work
        policy = make_policy(cache[target.model], generation, input_mode="text", renders_chats=mode == "chat")
        torch.manual_seed(config.seed)  # every target draws from the same random stream
        replies[target.label] = generate_replies(
            policy,
            attacks,
            mode=mode,
            system_prompt=target.system_prompt,
            samples=config.samples,
            batch_size=config.batch_size,
            on_rows=on_rows,
        )
    cache.clear()
    return replies


def _reply_records(
    targets: list[TargetSpec], attacks: list, replies: dict, reply_scores: dict, probe_scores: dict, samples: int
) -> list[dict]:
    """One record per (target, attack, sample), in that order, with each judge's reply and probe scores."""
    records = []
    for index, target in enumerate(targets):
        for a, attack in enumerate(attacks):
            for s in range(samples):
                row = (index * len(attacks) + a) * samples + s
                records.append(
                    {
                        "attack": a,
                        "target": target.label,
                        "sample": s,
                        "probe": attack.probe,
                        "reply": replies[target.label][a][s],
                        "scores": {
                            j: {"reply": float(reply_scores[j][row]), "probe": float(probe_scores[j][a])} for j in reply_scores
                        },
                    }
                )
    return records


def _transfer(
    config: ReplayConfig, targets: list[TargetSpec], reply_scores: dict, probe_scores: dict, n: int
) -> tuple[dict[str, dict], dict[str, dict[str, np.ndarray]]]:
    """Per target and judge, the :func:`transfer_metrics` of the ``n`` attacks and which of them
    succeeded (a reply above the threshold)."""
    k = config.samples
    per_target: dict[str, dict] = {t.label: {} for t in targets}
    successes: dict[str, dict[str, np.ndarray]] = {t.label: {} for t in targets}
    for index, target in enumerate(targets):
        for judge in reply_scores:
            grid = reply_scores[judge][index * n * k : (index + 1) * n * k].reshape(n, k)
            per_target[target.label][judge] = transfer_metrics(
                probe_scores[judge], grid, threshold=config.threshold, resamples=config.resamples, seed=config.seed
            )
            successes[target.label][judge] = (grid > config.threshold).any(axis=1)
    return per_target, successes


def _write_replay(
    out: Path, result: dict, records: list[dict], attacks: list, top_attacks: int, timing: dict, start: float
) -> None:
    """Write the replies (one JSON line each), the report and ``transfer.json`` (``result`` with its timings)."""
    from astrl.evaluation.replay_report import write_replay_report

    with (out / REPLIES_FILE).open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    t0 = time.perf_counter()
    write_replay_report(out, result, attacks, top_attacks)
    timing["report"] = time.perf_counter() - t0
    timing["total"] = time.perf_counter() - start
    result["seconds"] = {key: round(value, 3) for key, value in timing.items()}
    (out / TRANSFER_FILE).write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _replay(
    config: ReplayConfig,
    out: Path,
    source: ArchiveSource,
    targets: list[TargetSpec],
    scorers: dict,
    *,
    mode: str,
    max_new: int,
    start: float,
    notes: list[str],
    progress: bool,
    warn: Callable[[str], None],
) -> tuple[dict, list[dict]]:
    """The body of :func:`run_replay` once its inputs are checked: ``(transfer.json contents, reply records)``."""
    from tqdm.auto import tqdm

    from astrl.evaluation.agreement import judge_agreement
    from astrl.policies import GenerationSettings

    defaults, attacks, samples = source.defaults, source.attacks, config.samples
    training = list(defaults.get("training_scorers", []))
    generation = GenerationSettings(max_new, config.temperature, config.top_p, config.top_k, do_sample=not config.greedy)

    bar = tqdm(total=len(targets) * len(attacks) * samples, unit="reply", disable=not progress, desc="replay")
    t0 = time.perf_counter()
    replies = _target_replies(config, targets, attacks, generation, mode, bar.update)
    timing = {"generation": time.perf_counter() - t0}
    bar.set_description("replay: judging")
    t0 = time.perf_counter()
    flat = [r for target in targets for per_attack in replies[target.label] for r in per_attack]
    reply_scores = judge_texts(scorers, flat)
    probe_scores = judge_texts(scorers, [a.probe for a in attacks])
    timing["judging"] = time.perf_counter() - t0
    bar.close()

    n, k = len(attacks), samples
    per_target, successes = _transfer(config, targets, reply_scores, probe_scores, n)
    records = _reply_records(targets, attacks, replies, reply_scores, probe_scores, k)
    agreement = judge_agreement(
        {j: reply_scores[j] for j in scorers},
        [r["attack"] for r in records],
        [{"where": f"attack {r['attack']}, {r['target']}, sample {r['sample']}", **_item(r)} for r in records],
        threshold=config.threshold,
        training_scorers=training,
        resamples=config.resamples,
        seed=config.seed,
        top_k=config.top_attacks,
        unit="attack",
    )
    same = [j for j in scorers if j in training]
    if same:
        notes.append(f"judge {same[0]!r} is the training scorer: add a different --judge to see its blind spots")
    result = {
        "archive": str(source.path),
        "archive_kind": defaults.get("kind", "file"),
        "n_attacks": n,
        "samples": k,
        "greedy": config.greedy,
        "mode": mode,
        "generation": {key: value for key, value in asdict(generation).items() if key != "do_sample"},
        "threshold": config.threshold,
        "seed": config.seed,
        "targets": [asdict(t) for t in targets],
        "judges": list(scorers),
        "training_scorers": training,
        "bootstrap": {"resamples": config.resamples, "confidence": 0.95, "unit": "attack", "seed": config.seed},
        "transfer": per_target,
        "transfer_sets": transfer_sets(successes, list(scorers)),
        **({"judge_agreement": agreement} if agreement else {}),
        "warnings": notes,
    }
    for note in notes:
        warn(note)
    _write_replay(out, result, records, attacks, config.top_attacks, timing, start)
    return result, records
