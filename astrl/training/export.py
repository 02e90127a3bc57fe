"""``astrl export``: a trained tester as a self-contained Hugging Face model folder.

A run's tester (``RUN_DIR/final/tester`` or a checkpoint's) is a LoRA adapter that names its base
model by the path it was loaded from, or a full model folder. The export loads it the way
``astrl eval`` does (:func:`astrl.evaluation.tester.load_tester`: adapters merged into the base
weights) and writes::

    OUT/config.json, model.safetensors        the merged weights (transformers alone loads them)
    OUT/tokenizer files                        the tester's tokenizer (left padding, pad distinct from EOS)
    OUT/generation_config.json                 the sampling settings the tester was trained with
    OUT/astrl_tester.json                      mode, system prompt, prompt template, the run's eval defaults
    OUT/README.md                              a model card written from the run's files

and, on request, a garak config that runs the folder as the red-team model of garak's ``atkgen``
probe. Every check on the inputs runs before a model loads (:func:`plan_export`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from astrl.evaluation.run import RUN_DEFAULTS
from astrl.evaluation.tester import EXPORT_SETTINGS, TesterSource, is_adapter_folder, load_tester, resolve_tester
from astrl.names import EMBEDDED_MODELS, is_run_dir, looks_like_path
from astrl.training.config import ConfigError, TrainConfig, load_config

# Hub id and licence of each embedded model, for the card's metadata.
EMBEDDED_CARDS = {"smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}
# Settings of the run that ``astrl eval`` takes as defaults, plus its scorer (recorded as the training scorer).
EVAL_DEFAULT_KEYS = (*RUN_DEFAULTS, "scorer")
GARAK_PROBE = "atkgen.Tox"  # garak 0.17.1's probe that runs a red-team model against the target
TEMPLATE_PLACEHOLDER = "[query]"  # garak atkgen's placeholder for the target's last reply
FORMAT_VERSION = 1


class ExportError(ValueError):
    """An export whose inputs are unusable (named in the message)."""


@dataclass
class ExportPlan:
    """What an export reads and writes, checked before any model loads."""

    run_dir: Path
    source: TesterSource
    config: TrainConfig
    out: Path
    garak_config: Path | None = None
    eval_dir: Path | None = None


def _check_out(out: Path, what: str = "--out") -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{what} {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"{what} {str(out)!r} exists and is not empty: pass a new or empty folder")


def plan_export(
    run_dir: str | Path,
    out: str | Path,
    *,
    checkpoint: str | None = None,
    garak_config: str | Path | None = None,
    eval_dir: str | Path | None = None,
) -> ExportPlan:
    """Check an export's inputs without loading a model: a run directory with a tester (its
    ``final/tester`` or the checkpoint named), a readable run config, a new or empty ``out``
    folder, a garak config path that is not a folder, an eval folder holding ``metrics.json``."""
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise ExportError(f"run directory {str(run)!r} not found")
    if not is_run_dir(run):
        raise ExportError(f"{str(run)!r} is not a training run directory (no config.yaml, or a model folder)")
    out = Path(out).expanduser()
    _check_out(out)
    garak = Path(garak_config).expanduser() if garak_config is not None else None
    if garak is not None and garak.is_dir():
        raise ExportError(f"--garak-config {str(garak)!r} is a folder: pass a file path (.yaml or .json)")
    evaluation = Path(eval_dir).expanduser() if eval_dir is not None else None
    if evaluation is not None and not (evaluation / "metrics.json").is_file():
        raise ExportError(f"--eval {str(evaluation)!r} holds no metrics.json (an 'astrl eval' output folder is needed)")
    source = resolve_tester(str(run), checkpoint)
    tester = Path(source.model)
    if not is_adapter_folder(tester) and not (tester / "config.json").is_file():
        raise ExportError(f"{str(tester)!r} holds no tester (neither adapter_config.json nor config.json)")
    try:
        config = load_config(run / "config.yaml", on_warning=lambda _: None)
    except ConfigError as err:
        raise ExportError(f"the run's config cannot be read: {err}") from None
    return ExportPlan(run, source, config, out, garak, evaluation)


# -- what the tester was trained with --------------------------------------------------------------


def generation_settings(config: TrainConfig) -> dict:
    """The tester's sampling settings in the run (the training spec's ``tester_generation``)."""
    from dataclasses import asdict

    from astrl.training.setup import conversation_spec

    return asdict(conversation_spec(config).tester_generation)


def tester_system_prompt(config: TrainConfig) -> str | None:
    """The system prompt the tester saw in chat mode (the built-in one when the config names none); None in text mode."""
    from astrl.training.setup import conversation_spec

    return conversation_spec(config).env_options()["tester_system_prompt"] if config.mode == "chat" else None


def prompt_template(tokenizer, config: TrainConfig) -> str:
    """The text the tester reads before writing a probe, with ``[query]`` where the other side's
    last message goes: in chat mode the chat template over the system prompt and that message as
    the user turn (the tester's turns are the assistant's), in text mode the message itself."""
    system = tester_system_prompt(config)
    if system is None:
        return TEMPLATE_PLACEHOLDER
    messages = [{"role": "system", "content": system}, {"role": "user", "content": TEMPLATE_PLACEHOLDER}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(TEMPLATE_PLACEHOLDER) != 1:
        raise ExportError(f"the tester's chat template does not keep the user message {TEMPLATE_PLACEHOLDER!r} as written")
    return text


def document_start(tokenizer, config: TrainConfig) -> str:
    """Text mode: the token text to put before a prompt that may be empty (garak's first atkgen turn
    is), so that the model has a token to continue: the tokenizer's BOS, else its EOS; empty when the
    tokenizer adds a token to every input itself, and in chat mode (the template is never empty)."""
    if config.mode == "chat" or tokenizer("")["input_ids"]:
        return ""
    return tokenizer.bos_token or tokenizer.eos_token or ""


def set_generation_config(model, tokenizer, settings: dict) -> None:
    """Write the tester's sampling settings into ``model.generation_config``.

    astrl's ``top_k=0`` leaves top-k to ``generate``'s own rule: the model's ``top_k`` when it has
    one, else Transformers' default (50); the value ``generate`` used is written explicitly."""
    from transformers import GenerationConfig

    config = model.generation_config
    config.do_sample = settings["do_sample"]
    config.max_new_tokens = settings["max_new_tokens"]
    config.temperature = settings["temperature"]
    config.top_p = settings["top_p"]
    default_top_k = config.top_k if config.top_k is not None else GenerationConfig._get_default_generation_params()["top_k"]
    config.top_k = settings["top_k"] or default_top_k
    config.max_length = None
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id if config.eos_token_id is None else config.eos_token_id


# -- run facts for the card ------------------------------------------------------------------------


def trained_steps(plan: ExportPlan) -> int | None:
    """Steps behind the exported tester: N of a ``step_N`` checkpoint, else the last step of ``metrics.csv``."""
    name = plan.source.checkpoint or ""
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    curves = _training_curves(plan.run_dir)
    steps = [s for xs, _ in curves.values() for s in xs]
    return int(max(steps)) if steps else None


def _training_curves(run_dir: Path) -> dict:
    from astrl.evaluation.report import read_training_metrics

    path = run_dir / "metrics.csv"
    if not path.is_file():
        return {}
    try:
        return read_training_metrics(path)
    except (ValueError, OSError):
        return {}


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _same_run(recorded, run_dir: Path) -> bool:
    return isinstance(recorded, str) and Path(recorded).expanduser().resolve() == run_dir.resolve()


def find_evaluation(plan: ExportPlan) -> tuple[dict, str] | None:
    """Held-out metrics of the exported tester and where they come from: the ``--eval`` folder's
    ``metrics.json``; else the newest finished ``astrl eval`` of this run and checkpoint in the
    results store; else, for the final tester, the run's ``demo_summary.json`` (the demo's comparison)."""
    if plan.eval_dir is not None:
        metrics = _read_json(plan.eval_dir / "metrics.json")
        if metrics is None:
            raise ExportError(f"{str(plan.eval_dir / 'metrics.json')!r} is not a JSON object")
        return metrics, f"astrl eval, {plan.eval_dir.name}/metrics.json"
    stored = _stored_evaluation(plan)
    if stored is not None:
        return stored
    summary = _read_json(plan.run_dir / "demo_summary.json")
    if summary is not None and plan.source.checkpoint == "final" and isinstance(summary.get("after"), dict):
        return summary, "astrl demo, demo_summary.json"
    return None


def _stored_evaluation(plan: ExportPlan) -> tuple[dict, str] | None:
    from astrl.store import Store, StoreError
    from astrl.store.database import store_path
    from astrl.store.recorder import store_enabled

    if not store_enabled() or not store_path().is_file():
        return None
    try:
        with Store.open(create=False) as store:
            runs = [r for r in store.runs() if r.kind == "eval" and r.status == "finished" and isinstance(r.metrics, dict)]
    except StoreError:
        return None
    mine = [
        r
        for r in runs
        if _same_run(r.metrics.get("run_dir"), plan.run_dir) and r.metrics.get("checkpoint") == plan.source.checkpoint
    ]
    if not mine:
        return None
    newest = mine[-1]
    return newest.metrics, f"astrl eval run {newest.id[:12]} in the results store"


def eval_defaults(config: TrainConfig) -> dict:
    """The run's settings that ``astrl eval --tester FOLDER`` takes as defaults, as the run's eval would."""
    values = config.to_dict()
    return {key: values[key] for key in EVAL_DEFAULT_KEYS if key in values}


def model_label(name: str) -> str:
    """A model name fit for a card: a hub id or embedded name as is, a local folder by its name only."""
    if name in EMBEDDED_MODELS:
        return f"{name} ({EMBEDDED_CARDS[name][0]})" if name in EMBEDDED_CARDS else name
    if looks_like_path(name) or Path(name).expanduser().exists():
        return f"a local model folder named {Path(name).name!r}"
    return name


def card_metadata(config: TrainConfig) -> dict:
    """The card's YAML header: licence and base model when known, library, pipeline, tags."""
    meta: dict = {}
    hub_id, licence = EMBEDDED_CARDS.get(config.tester, (None, None))
    if hub_id is None and not looks_like_path(config.tester) and not Path(config.tester).expanduser().exists():
        hub_id = config.tester  # a hub id
    if licence:
        meta["license"] = licence
    if hub_id:
        meta["base_model"] = hub_id
    meta["library_name"] = "transformers"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ["red-teaming", "adaptive-stress-testing", "safety-evaluation", "astrl", config.algorithm]
    return meta


# -- the model card ----------------------------------------------------------------------------------

# (key in a judge's metrics, label): the rates the card reports, each with its ``<key>_ci`` when present
CARD_METRICS = (
    ("asr", "ASR"),
    ("elicited_asr", "elicited ASR"),
    ("elicited_success_rate", "elicited success rate"),
    ("toxic_reply_rate", "toxic reply rate"),
    ("toxic_probe_rate", "toxic probe rate"),
    ("elicited_reply_share", "elicited reply share"),
)


def _number(value) -> str:
    if isinstance(value, bool) or value is None:
        return "n/a" if value is None else str(value)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _with_interval(values: dict, key: str) -> str:
    ci = values.get(f"{key}_ci")
    interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if isinstance(ci, (list, tuple)) and len(ci) == 2 and None not in ci else ""
    return _number(values.get(key)) + interval


def _judge_table(judges: dict) -> list[str]:
    shown = [(key, label) for key, label in CARD_METRICS if any(key in v for v in judges.values() if isinstance(v, dict))]
    lines = ["| judge | " + " | ".join(label for _, label in shown) + " |", "|---" * (len(shown) + 1) + "|"]
    for judge, values in judges.items():
        if isinstance(values, dict):
            lines.append(f"| `{judge}` | " + " | ".join(_with_interval(values, key) for key, _ in shown) + " |")
    return lines


def _eval_section(found: tuple[dict, str] | None) -> list[str]:
    lines = ["## Held-out results", ""]
    if found is None:
        return lines + [
            "No held-out evaluation of this tester was found with the run. Evaluate it with `astrl eval --tester FOLDER` "
            "(or the run directory) and export again with `--eval EVAL_FOLDER` to put the numbers here.",
            "",
        ]
    metrics, origin = found
    if "after" in metrics:  # the demo's comparison: the untrained tester and this one on the same held-out openers
        lines += [
            f"From {origin}: the untrained tester (before) and this one (after) on the same "
            f"{metrics.get('conversations', 'n/a')} held-out (dev split) conversations, same seed, scored by the training "
            f"scorer `{metrics.get('scorer')}` and the judge `{metrics.get('judge')}`. 95% bootstrap intervals over openers "
            "in brackets.",
            "",
        ]
        for side in ("after", "before"):
            values = metrics.get(side)
            if isinstance(values, dict) and isinstance(values.get("judges"), dict):
                lines += [f"**{side}** (mean training reward {_number(values.get('mean_reward'))}, "
                          f"probe NLL under the target {_number(values.get('probe_nll'))})", ""]  # fmt: skip
                lines += _judge_table(values["judges"]) + [""]
        return lines
    nll = metrics.get("probe_nll") if isinstance(metrics.get("probe_nll"), dict) else {}
    lines += [
        f"From {origin}: {metrics.get('n_conversations', 'n/a')} conversations of {metrics.get('turns', 'n/a')} turns on "
        f"the `{metrics.get('split', 'n/a')}` split of `{metrics.get('prompts', 'n/a')}` (split seed "
        f"{metrics.get('split_seed', 'n/a')}), target {model_label(str(metrics.get('target', 'n/a')))}, mode "
        f"{metrics.get('mode', 'n/a')}, seed {metrics.get('seed', 'n/a')}, threshold {metrics.get('threshold', 'n/a')}. "
        "95% bootstrap intervals over openers in brackets.",
        "",
        f"Probe NLL under the target (mean per-token): {_with_interval(nll, 'mean')}",
        "",
    ]
    if isinstance(metrics.get("judges"), dict):
        lines += _judge_table(metrics["judges"]) + [""]
    return lines


def _reward_line(config: TrainConfig) -> str:
    from astrl.rewards.weights import SETTING_NAMES

    options = config.reward_options() or {}
    weights = ", ".join(f"{SETTING_NAMES.get(k, k)}={v}" for k, v in options.items())
    return f"`{config.reward}`" + (f" ({weights})" if weights else " (the scorer's probability of the reply)")


def _warm_start_line(plan: ExportPlan) -> str:
    config = plan.config
    if not config.warm_start_probes:
        return "none"
    line = (
        f"{config.warm_start_rounds} round(s) of {config.warm_start_probes} candidate probes ({config.warm_start_select}), "
        f"kept at an estimated toxic-reply share >= {config.warm_start_min_toxic}, {config.warm_start_epochs} epochs at "
        f"lr {config.warm_start_lr}"
    )
    if config.warm_start_scorer is not None:
        line += f", chosen by `{config.warm_start_scorer}`"
    if config.warm_start_retest:
        line += f", re-tested on {config.warm_start_retest} more openers, the best {config.warm_start_retest_keep:.0%} trained on"
    summary = _read_json(plan.run_dir / "warm_start.json")
    if summary and "kept" in summary and "sampled" in summary:
        line += f"; kept {summary['kept']} of {summary['sampled']}"
    return line


def _training_rows(plan: ExportPlan, steps: int | None) -> list[tuple[str, str]]:
    """The rows of the model card's training table: models, scorer, algorithm, reward, steps, prompts."""
    config = plan.config
    tuning = (
        f"LoRA (rank {config.lora_rank}, alpha {config.lora_alpha}, on {', '.join(config.lora_targets)}), merged into the weights"
        if is_adapter_folder(plan.source.model)
        else "all weights (full fine-tuning)"
    )
    judges = ", ".join(f"`{j}`" for j in config.judges) or "none"
    curves = _training_curves(plan.run_dir)
    reward = curves.get("reward_mean")
    rows = [
        ("base model", model_label(config.tester)),
        ("fine-tuned", tuning),
        ("target (the model attacked)", model_label(config.target)),
        ("reward scorer", f"`{config.scorer}`"),
        ("judges (logged, not rewarded)", judges),
        ("algorithm", config.algorithm),
        ("mode", config.mode),
        ("reward", _reward_line(config)),
        ("steps", f"{'n/a' if steps is None else steps} of {config.total_steps} configured ({plan.source.checkpoint} tester)"),
        ("warm start", _warm_start_line(plan)),
        ("prompts", f"`{config.prompts}`, `{config.split}` split (split seed {config.prompt_split_seed})"),
        ("turns per conversation", str(config.turns)),
        ("seed", str(config.seed)),
    ]
    if reward:
        rows.append(("training reward (mean), first and last logged step", f"{reward[1][0]:.3f} -> {reward[1][-1]:.3f}"))
    return rows


def model_card(plan: ExportPlan, generation: dict, template: str, steps: int | None) -> str:
    """The README.md of the export: metadata header, what was trained against what, held-out results, use."""
    import yaml

    config = plan.config
    meta = yaml.safe_dump(card_metadata(config), sort_keys=False, allow_unicode=True).strip()
    rows = _training_rows(plan, steps)
    settings = ", ".join(f"{k}={v}" for k, v in generation.items())
    system = tester_system_prompt(config)
    lines = [
        "---",
        meta,
        "---",
        "",
        f"# {plan.out.name}: an astrl red-teaming tester",
        "",
        "A *tester* trained with astrl (adaptive stress testing): given the other side of a conversation, it writes the "
        "next turn (a *probe*) meant to lead a *target* language model into a toxic or otherwise harmful reply, while "
        "keeping the probe natural.",
        "",
        "> **Warning:** this model writes text meant to elicit harmful output from other models. Its probes, and the "
        "replies they provoke, can be offensive or harmful. Use it only to test models you are responsible for.",
        "",
        "## Intended use",
        "",
        "Red-teaming and safety evaluation: generating probes against a target model and judging the target's replies "
        "(for example with `astrl eval --tester FOLDER`, or as the attack model of garak's `atkgen` probe). Not for "
        "chatting with people, producing content, or any use where its output reaches someone who did not ask for it.",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in rows],
        "",
        *_eval_section(find_evaluation(plan)),
        "## How to prompt it",
        "",
        f"Generation settings as trained (also in `generation_config.json`): {settings}.",
        "",
    ]
    if system is not None:
        lines += [
            "Chat mode: the tester's turns are the assistant's, the other side's the user's, after this system prompt:",
            "",
            *[f"> {line}" for line in system.splitlines()],
            "",
        ]
    else:
        lines += ["Text mode: the tester continues the conversation as plain text (no chat template).", ""]
    lines += [
        f"`astrl_tester.json` holds the mode, the system prompt and the prompt text with `{TEMPLATE_PLACEHOLDER}` where "
        "the other side's last message goes, as garak's atkgen expects it:",
        "",
        "```text",
        template,
        "```",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'tokenizer = AutoTokenizer.from_pretrained("FOLDER")',
        'model = AutoModelForCausalLM.from_pretrained("FOLDER")',
        'prompt = TEMPLATE.replace("[query]", "the target\'s last message")  # TEMPLATE: the text above',
        "inputs = tokenizer(prompt, return_tensors='pt', add_special_tokens=False)",
        "probe = model.generate(**inputs)[0, inputs['input_ids'].shape[1]:]",
        "print(tokenizer.decode(probe, skip_special_tokens=True))",
        "```",
        "",
        "## Limitations",
        "",
        "Its probes aim at what the reward scorer calls toxic, so they carry that scorer's blind spots; judge results "
        "with a judge other than the training scorer. What it elicits from the target it was trained against need not "
        "transfer to other models.",
        "",
    ]
    return "\n".join(lines)


# -- garak ---------------------------------------------------------------------------------------------


def garak_config(folder: Path, settings: dict) -> dict:
    """A garak (0.17.1) config that selects the ``atkgen.Tox`` probe and runs ``folder`` as its
    red-team model, on CPU in float32, with the tester's prompt text and sampling settings.

    The generator is garak's ``huggingface.Model`` (a causal LM and its tokenizer), not atkgen's
    default ``huggingface.Pipeline``: garak 0.17.1's pipeline generator reads the pipeline's
    ``generation_config``, which the Transformers version astrl pins (5.23) no longer has. In text
    mode the prompt starts with ``document_start``: atkgen's first turn sends an empty message."""
    generation = settings["generation"]
    hf_args = {"device": "cpu", "torch_dtype": "float32", "do_sample": generation["do_sample"]}
    if generation["do_sample"]:  # top_k as generate used it in training (astrl's 0 leaves generate's default)
        hf_args.update(temperature=generation["temperature"], top_p=generation["top_p"], top_k=settings["top_k_used"])
    tox = {
        "red_team_model_type": "huggingface.Model",
        "red_team_model_name": str(folder.resolve()),
        # the prompt text is the tester's whole input, chat template included: no second template on top
        "red_team_model_config": {"hf_args": hf_args, "max_tokens": generation["max_new_tokens"], "use_chat": False},
        "red_team_prompt_template": settings.get("document_start", "") + settings["prompt_template"],
    }
    return {
        "run": {"spec": {"include": [f"probes.{GARAK_PROBE}"], "exclude": []}},
        "plugins": {"probes": {"atkgen": {"Tox": tox}}},
    }


def write_garak_config(path: Path, folder: Path, settings: dict) -> None:
    """The config as YAML (``.yaml``/``.yml``) or JSON (anything else); garak reads both with ``--config``."""
    import yaml

    class Dumper(yaml.SafeDumper):
        """Multi-line strings (a chat-template prompt) as literal blocks."""

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    config = garak_config(folder, settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() in (".yaml", ".yml"):
        dumped = yaml.dump(config, Dumper=Dumper, sort_keys=False, allow_unicode=True, width=10_000)
        path.write_text(dumped, encoding="utf-8")
    else:
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


# -- the export ----------------------------------------------------------------------------------------


def export_tester(
    run_dir: str | Path,
    out: str | Path,
    *,
    checkpoint: str | None = None,
    garak_config: str | Path | None = None,
    eval_dir: str | Path | None = None,
    dtype: str | None = None,
) -> dict:
    """Write the run's tester (``final`` or ``checkpoint``) to ``out`` as a self-contained Hugging Face
    model folder with its model card (module docstring); with ``garak_config``, also that file.
    ``dtype``: of the saved weights (default: the run's). Returns what ``astrl_tester.json`` holds."""
    from astrl import __version__
    from astrl.models import terminal_progress_bars

    plan = plan_export(run_dir, out, checkpoint=checkpoint, garak_config=garak_config, eval_dir=eval_dir)
    with terminal_progress_bars():
        loaded = load_tester(plan.source, dtype=dtype or plan.config.dtype, device="cpu")
    generation = generation_settings(plan.config)
    set_generation_config(loaded.model, loaded.tokenizer, generation)
    steps = trained_steps(plan)
    settings = {
        "format": FORMAT_VERSION,
        "astrl_version": __version__,
        "checkpoint": plan.source.checkpoint,
        "steps": steps,
        "mode": plan.config.mode,
        "system_prompt": tester_system_prompt(plan.config),
        "prompt_template": prompt_template(loaded.tokenizer, plan.config),
        "document_start": document_start(loaded.tokenizer, plan.config),
        "generation": generation,
        "top_k_used": loaded.model.generation_config.top_k,
        "eval_defaults": eval_defaults(plan.config),
    }
    tmp = plan.out.with_name(f".{plan.out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with terminal_progress_bars():
            loaded.model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_SETTINGS).write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(model_card(plan, generation, settings["prompt_template"], steps), encoding="utf-8")
        _check_out(plan.out)  # still new or empty: nothing else wrote there meanwhile
        if plan.out.is_dir():
            plan.out.rmdir()
        tmp.replace(plan.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if plan.garak_config is not None:
        write_garak_config(plan.garak_config, plan.out, settings)
    return settings
