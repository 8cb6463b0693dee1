"""The rollout phase and the sync producer on the fake backend (tests/fake_backend.py): seconds, no
server, no torchrun, no process group."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from fake_backend import CharTokenizer, FakeBackend, addition_answer, make_ctx

from megatron_acrl.rollout.backend import RolloutBackend
from megatron_acrl.rollout.evaluate import evaluate
from megatron_acrl.rollout.phase import collect_rollouts, sample_groups
from megatron_acrl.rollout.producer import SyncProducer, make_producer
from megatron_acrl.run.resume import DriverState


def test_the_fake_is_a_rollout_backend() -> None:
    backend: RolloutBackend = FakeBackend()  # what mypy checks; and at run time, every method:
    missing = [m for m in RolloutBackend.__dict__ if not m.startswith("_") and not hasattr(backend, m)]
    assert missing == []


def test_sample_groups_scores_n_samples_per_prompt() -> None:
    ctx = make_ctx(FakeBackend())
    prompts = [next(ctx.prompt_stream) for _ in range(3)]  # type: ignore[arg-type]
    b = sample_groups(ctx, prompts, first_group=10)
    assert len(b) == 3 * 2 and b.group_ids.tolist() == [10, 10, 11, 11, 12, 12]
    assert b.rewards.tolist() == [1.0, 0.0] * 3  # sample 0 right, sample 1 off by one
    assert b.finish_reasons == ["stop"] * 6
    assert b.token_versions is not None and (b.token_versions[b.token_versions >= 0] == 0).all()


def test_collect_rollouts_returns_the_steps_batch() -> None:
    backend = FakeBackend()
    ctx, state = make_ctx(backend), DriverState()
    batch, metrics = collect_rollouts(ctx, state, 0, restore=lambda: pytest.fail("nothing failed"))
    assert len(batch) == 4 and state.prompts_consumed == 2
    assert metrics["rollout/server_restarts"] == 0 and metrics["rollout/refill_rounds"] == 0
    assert metrics["reward/mean"] == 0.5


def test_a_dead_server_is_restarted_and_the_step_retried_with_the_same_prompts() -> None:
    backend = FakeBackend()
    backend.fail_next("gone")  # dies after the first token of the first request
    ctx, state = make_ctx(backend), DriverState()
    restores: list[int] = []
    batch, metrics = collect_rollouts(ctx, state, 0, restore=lambda: restores.append(backend.restarts))
    assert restores == [1]  # restarted, then the served weights re-sent, once
    assert backend.restarts == 1 and not backend.dead_servers()
    assert len(backend.requests) == 2 and backend.requests[0] == backend.requests[1]  # the same prompts
    assert state.prompts_consumed == 2 and len(batch) == 4  # nothing lost, nothing drawn twice
    assert metrics["rollout/server_restarts"] == 1


def test_dynamic_sampling_refills_constant_reward_groups() -> None:
    def answer(prompt: Sequence[int], k: int) -> list[int]:
        a, b = CharTokenizer().decode(prompt).rstrip("=").split("+")
        # an even sum is always answered right (constant reward: dropped), an odd one half right
        return addition_answer(prompt, 0 if (int(a) + int(b)) % 2 == 0 else k)

    ctx, state = make_ctx(FakeBackend(answer), ["algorithm.dynamic_sampling=true"]), DriverState()
    batch, metrics = collect_rollouts(ctx, state, 0, restore=lambda: None)
    rewards = batch.rewards.view(-1, 2)
    kept_mixed = (rewards[:, 0] != rewards[:, 1]).sum().item()
    assert len(batch) == 4 and batch.group_ids.unique().numel() == 2
    assert metrics["rollout/refill_rounds"] >= 1 and state.prompts_consumed > 2  # refilled
    # every group the refills could find is mixed; only an exhausted refill tops up constant ones
    assert kept_mixed == 2 or metrics["rollout/refill_rounds"] == ctx.cfg.algorithm.max_refill_rounds - 1


def test_sync_producer_serves_each_published_version() -> None:
    backend = FakeBackend()
    ctx, state = make_ctx(backend), DriverState()
    producer = make_producer(ctx, state, None)
    assert isinstance(producer, SyncProducer) and backend.updates == ["step-0"]
    first, _ = producer.next_batch(state, 0)
    producer.publish(1)
    second, metrics = producer.next_batch(state, 1)
    producer.close()
    assert backend.updates == ["step-0", "step-1"]
    assert set(first.weight_versions) == {"step-0"} and set(second.weight_versions) == {"step-1"}
    assert state.prompts_consumed == 4 and metrics["rollout/num_sequences"] == 4
    assert not set(first.group_ids.tolist()) & set(second.group_ids.tolist())
    versions = second.token_versions
    assert versions is not None and torch.equal(versions[versions >= 0].unique(), torch.tensor([1]))


def test_evaluation_generates_through_the_backend() -> None:
    backend = FakeBackend()
    ctx = make_ctx(backend, ["task.heldout_fraction=0.2", "task.eval_size=3", "training.eval_samples=2"])
    m = evaluate(ctx, 0, "step-0")
    assert m["eval/accuracy"] == 1.0 and m["eval/sampled_reward"] == 0.5  # greedy is sample 0: right
    assert m["eval/response_length"] >= 2  # a digit or two, then EOS
    assert [len(r) for r in backend.requests] == [3, 3]  # the held-out prompts, the fixed train ones
