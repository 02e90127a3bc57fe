"""Collection over Ray workers (CPU, local Ray with 2 CPUs) and the scale-out settings."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from astrl._compat import as_list
from astrl.backends import CollectionSettings, MissingExtraError, init_ray, require_ray
from astrl.distributed import WorkerSpec
from astrl.envs import ConversationSpec
from astrl.policies import GenerationSettings
from astrl.prompts import PromptStream

ray = pytest.importorskip("ray")
KEYWORDS = "keywords:the,you,hello,how,are"


@pytest.fixture(scope="module")
def local_ray():
    """A small local Ray instance for this module (2 CPUs, no dashboard, 100 MB object store)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def _spec(folder, num_workers=2, **overrides) -> WorkerSpec:
    generation = GenerationSettings(max_new_tokens=4)
    settings = dict(
        tester=str(folder),
        target=str(folder),
        scorers=[KEYWORDS],
        batch_size=4,
        group_size=2,
        turns=2,
        tester_generation=generation,
        target_generation=generation,
    )
    return WorkerSpec(ConversationSpec(**{**settings, **overrides}), num_workers=num_workers)


# -- no Ray needed -----------------------------------------------------------------------------------
def test_prompt_shards_split_each_batch_into_whole_groups():
    prompts = [f"p{i}" for i in range(7)]
    stream, a, b = (PromptStream(prompts, 4, seed=3, group_size=2) for _ in range(3))
    shards = [a.shard(0, 2), b.shard(1, 2)]
    for _ in range(5):  # across an epoch boundary
        full = stream.next_batch()
        parts = [s.next_batch() for s in shards]
        assert parts[0] + parts[1] == full and parts[0][0] == parts[0][1]
    with pytest.raises(ValueError, match="cannot be split into 3 shards of whole groups"):
        stream.shard(0, 3)


def test_scale_settings_are_validated_with_the_offending_value(tmp_path):
    with pytest.raises(ValueError, match="collector must be one of .* got 'dask'"):
        CollectionSettings(collector="dask").check_collection()
    with pytest.raises(ValueError, match="num_collectors=2 needs collector 'ray'"):
        CollectionSettings(num_collectors=2).check_collection()
    with pytest.raises(ValueError, match="collector_cpus must be > 0, got 0"):
        CollectionSettings(collector="ray", num_collectors=2, collector_cpus=0).check_collection()
    with pytest.raises(ValueError, match="cannot be split into 3 workers of whole groups"):
        _spec(tmp_path, num_workers=3)
    from astrl.rollout import RolloutConfig

    with pytest.raises(ValueError, match="batch_size 3 must be a multiple of num_collectors 2"):
        RolloutConfig(collector="ray", num_collectors=2, batch_size=3)


def test_missing_ray_gives_the_install_command(monkeypatch):
    import astrl.backends as backends

    monkeypatch.setattr(backends, "_has", lambda package: package != "ray")
    with pytest.raises(MissingExtraError, match=r"pip install 'astrl\[ray\]'"):
        require_ray()
    with pytest.raises(MissingExtraError, match=r"astrl\[ray\]"):
        init_ray()


# -- local Ray ----------------------------------------------------------------------------------------
@pytest.mark.slow  # starts a local Ray instance
def test_ray_workers_collect_what_the_local_collector_collects_and_take_weight_updates(local_ray, tiny_model_dir):
    from torchrl.collectors.llm import LLMCollector

    from astrl.distributed import RayCollectors, build_worker, trainable_weights

    spec = _spec(tiny_model_dir, lora={"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["q_proj"]})
    env, policy = build_worker(replace(spec, num_workers=1))  # the same recipe, one local collector
    local = LLMCollector(
        env,
        policy=policy,
        dialog_turns_per_batch=spec.conversation.batch_size * spec.conversation.turns,
        yield_completed_trajectories=True,
    )
    local_batches = [next(iter(local)).reshape(-1) for _ in range(2)]

    collectors = RayCollectors(spec, num_cpus=1)
    try:
        batches = [collectors.next() for _ in range(2)]
        for mine, theirs in zip(batches, local_batches, strict=True):
            assert mine.shape == theirs.shape == (spec.conversation.batch_size * spec.conversation.turns,)
            assert as_list(mine["query"]) == as_list(theirs["query"])  # same openers, same order
            assert mine["step_count"].reshape(-1).tolist() == theirs["step_count"].reshape(-1).tolist()
            same_keys = set(theirs["next"].keys(True, True)) | {"policy_version"}
            assert set(mine["next"].keys(True, True)) == same_keys and "reward" in same_keys
        assert as_list(batches[0]["query"]) != as_list(batches[1]["query"])  # the stream advances
        assert collectors.policy_version == 0 and batches[0]["next", "policy_version"].unique().tolist() == [0]

        weights = trainable_weights(policy)
        names = list(weights.keys(True, True))
        assert names and all("lora" in ".".join(k) for k in names)
        weights.apply_(lambda w: w.fill_(0.25))
        collectors.update_policy_weights_(weights)
        assert collectors.policy_version == 1
        state = collectors.worker_weights(1)
        lora = {k: v for k, v in state.items() if "lora_A" in k}
        assert lora and all(torch.all(v == 0.25) for v in lora.values())
        # every turn generated after the update carries the new version
        assert collectors.next()["next", "policy_version"].unique().tolist() == [1]
    finally:
        collectors.shutdown()


@pytest.mark.slow  # starts a local Ray instance
def test_rollout_over_ray_writes_the_local_number_of_records(local_ray, tiny_model_dir, tmp_path):
    from astrl.rollout import RolloutConfig, run_rollout

    generation = GenerationSettings(max_new_tokens=4)
    settings = dict(
        tester=str(tiny_model_dir),
        target=str(tiny_model_dir),
        scorers=[KEYWORDS],
        num_conversations=6,
        batch_size=4,
        turns=2,
        tester_generation=generation,
        target_generation=generation,
    )
    local = run_rollout(RolloutConfig(**settings), tmp_path / "local.jsonl", progress=False)
    remote = run_rollout(RolloutConfig(**settings, collector="ray", num_collectors=2), tmp_path / "ray.jsonl", progress=False)
    assert local["turns"] == remote["turns"] == 12 and local["conversations"] == remote["conversations"] == 6
    import json

    records = [json.loads(line) for line in (tmp_path / "ray.jsonl").read_text().splitlines()]
    assert [(r["conversation"], r["turn"]) for r in records] == [(c, t) for c in range(6) for t in range(2)]
    assert all(isinstance(r["probe"], str) and len(r["scores"]) == 1 for r in records)


@pytest.mark.slow  # starts a local Ray instance
def test_trainer_consumes_ray_collection_and_logs_the_policy_version(local_ray, tiny_model_dir, tmp_path):
    import csv

    from astrl.training import TrainConfig, Trainer

    config = TrainConfig(
        tester=str(tiny_model_dir),
        target=str(tiny_model_dir),
        scorer=KEYWORDS,
        reward="astprompter",  # never an all-zero reward: the update moves the adapters
        total_steps=3,
        save_every=3,
        prompts_per_step=2,
        group_size=2,
        turns=2,
        max_new_tokens=4,
        lr=3e-3,
        warmup_steps=1,
        lora_targets=["q_proj", "v_proj"],
        collector="ray",
        num_collectors=2,
        run_dir=str(tmp_path / "run"),
    )
    trainer = Trainer(config, progress=False)
    rows = trainer.train()
    assert [r["turns"] for r in rows] == [config.batch_size * config.turns] * 3
    assert [r["policy_version"] for r in rows] == [0, 1, 2]  # each step's data comes from the weights after the last update
    written = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert [int(r["policy_version"]) for r in written] == [0, 1, 2]
    assert trainer.algorithm.collector.collectors == []  # workers stopped at the end
