"""The typed train batch (``megatron_acrl.batch.train_batch``), its one check, the policy's one call
that assembles it (``Policy.prepare``, on stand-in passes) and the loss adapter's bound loss."""

from __future__ import annotations

import pytest
import torch

from megatron_acrl.algo.advantages import compute_advantages
from megatron_acrl.algo.losses import rl_loss
from megatron_acrl.batch.rollout_batch import TENSOR_FIELDS, build_batch, minibatches
from megatron_acrl.batch.train_batch import TRAIN_BATCH_SPEC, TrainBatch, TrainBatchError, check_train_batch
from megatron_acrl.config import AlgorithmConfig, CorrectionConfig, config_from_dict
from megatron_acrl.correction import AcrlSignal


def rollout() -> TrainBatch:
    """Four samples of two prompts, with per-token versions: ``tokens [4, 5]``."""
    return build_batch(
        [[5, 6], [5, 6], [7], [7]],
        [[1, 2, 3], [4], [2, 2], [9]],
        [[-0.1, -0.2, -0.3], [-1.0], [-0.5, -0.4], [-2.0]],
        rewards=[1.0, 0.0, 0.5, 0.0],
        group_ids=[0, 0, 1, 1],
        pad_id=0,
        token_versions=[[3, 3, 4], [4], [4, 4], [4]],
    ).tensors()


def complete() -> TrainBatch:
    tb = rollout()
    z = torch.zeros(tb["tokens"].shape)
    tb.update(old_logprobs=z, ref_logprobs=z, values=z, returns=z, advantages=z)
    return tb


def test_the_spec_is_the_typed_dict_and_the_rollout_batch_fills_its_required_keys():
    assert list(TRAIN_BATCH_SPEC) == list(TrainBatch.__annotations__)
    assert TrainBatch.__required_keys__ == set(TENSOR_FIELDS)  # RolloutBatch.tensors() supplies them
    check_train_batch(rollout())
    check_train_batch(complete(), need=("old_logprobs", "advantages", "values", "returns"))


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda tb: tb.pop("rewards"), "rewards: missing"),
        (lambda tb: tb.update(advantage=tb["advantages"]), "advantage: not a train batch key"),
        (
            lambda tb: tb.update(old_logprobs=tb["old_logprobs"].double()),
            "old_logprobs: dtype torch.float64, expected torch.float32",
        ),
        (
            lambda tb: tb.update(loss_mask=tb["loss_mask"].bool()),
            "loss_mask: dtype torch.bool, expected torch.float32",
        ),
        (
            lambda tb: tb.update(advantages=torch.zeros(4, 6)),
            "advantages: shape [4, 6], expected [N, L] with L = 5 (from tokens)",
        ),
        (lambda tb: tb.update(rewards=torch.zeros(3)), "rewards: shape [3], expected [N] with N = 4"),
        (lambda tb: tb.update(values=torch.zeros(4)), "values: shape [4], expected [N, L]"),
        (
            lambda tb: tb.update(routed_experts=torch.zeros(4, 5, 2, dtype=torch.int16)),
            "routed_experts: shape [4, 5, 2], expected [N, L, *, *]",
        ),
        (lambda tb: tb.update(returns=[0.0] * 4), "returns: list, not a tensor"),
        (lambda tb: tb.update(tokens=tb["tokens"][:, None]), "tokens: shape [4, 1, 5], expected [N, L]"),
    ],
)
def test_the_check_names_the_bad_key(change, words):
    tb = complete()
    change(tb)
    with pytest.raises(TrainBatchError) as err:
        check_train_batch(tb)
    assert words in str(err.value)
    assert str(err.value).startswith("train batch: ")


def test_the_check_lists_every_problem_and_the_keys_a_step_needs():
    tb = rollout()
    tb["group_ids"] = tb["group_ids"].int()
    with pytest.raises(TrainBatchError) as err:
        check_train_batch(tb, need=("old_logprobs", "advantages"))
    assert str(err.value) == (
        "train batch: old_logprobs: missing; advantages: missing; "
        "group_ids: dtype torch.int32, expected torch.int64"
    )
    assert isinstance(err.value, ValueError)


def test_minibatches_keep_every_key_of_the_typed_batch():
    tb = complete()
    cfg = config_from_dict({"algorithm": {"ppo_epochs": 2, "num_minibatches": 2}})
    parts = list(minibatches(tb, cfg, seed=0))
    assert len(parts) == 4
    for mb in parts:
        check_train_batch(mb)
        assert mb.keys() == tb.keys() and mb["tokens"].shape == (2, 5)


# ------------------------------------------------------------------------------------------------
# Policy.prepare, on stand-in passes: the order, the keys, the metrics
# ------------------------------------------------------------------------------------------------


class StandIn:
    """What ``Policy.prepare`` uses of the policy (and the critic), recording each call in order."""

    def __init__(self, cfg, recorded=False):
        self.cfg, self.calls, self.recorded = cfg, [], recorded

    def forward_logprobs(self, tb, reference=False):
        self.calls.append(("ref" if reference else "old", sorted(tb)))
        out = {"logprobs": tb["rollout_logprobs"] - (0.5 if reference else 0.25)}
        if self.recorded and not reference:
            out["recorded_experts"] = torch.zeros(*tb["tokens"].shape, 1, 2, dtype=torch.int16)
        return out

    def routing_metrics(self, tb):
        self.calls.append(("routing", sorted(tb)))
        return {"routing/disagree_frac": 0.0}

    def forward_values(self, tb):
        self.calls.append(("values", sorted(tb)))
        return {"values": torch.full(tb["tokens"].shape, 0.1)}

    def update_controller(self, tb, trainer_version=None):
        self.calls.append(("controller", sorted(tb), trainer_version))
        return {"acrl/x": 1.0}


def _prepare(policy, tb, **kw):
    from megatron_acrl.megatron.policy import Policy

    return Policy.prepare(policy, tb, **kw)


def test_prepare_assembles_the_train_batch_in_one_call():
    """GRPO with a KL term and R2: pi_old (and its routing), the routing metrics, the reference, the
    advantages, the controller last, on the complete batch; the caller's batch is left as it was."""
    cfg = config_from_dict({"algorithm": {"kl_coef": 0.1}})
    policy, tb = StandIn(cfg, recorded=True), rollout()
    out, metrics = _prepare(policy, tb, trainer_version=4)
    assert [c[0] for c in policy.calls] == ["old", "routing", "ref", "controller"]
    assert "old_logprobs" not in tb  # a new dict
    assert set(out) == set(tb) | {"old_logprobs", "recorded_experts", "ref_logprobs", "advantages"}
    assert policy.calls[1][1] == sorted(set(tb) | {"old_logprobs", "recorded_experts"})
    assert policy.calls[-1] == ("controller", sorted(out), 4)
    torch.testing.assert_close(out["old_logprobs"], tb["rollout_logprobs"] - 0.25, rtol=0, atol=0)
    torch.testing.assert_close(out["ref_logprobs"], tb["rollout_logprobs"] - 0.5, rtol=0, atol=0)
    want = compute_advantages(out, cfg)
    assert torch.equal(out["advantages"], want.advantages)
    assert metrics == {"routing/disagree_frac": 0.0} | want.metrics | {"acrl/x": 1.0}


def test_prepare_with_the_critic_adds_values_and_returns():
    cfg = config_from_dict({"algorithm": {"name": "ppo"}})
    policy, critic = StandIn(cfg), StandIn(cfg)
    out, metrics = _prepare(policy, rollout(), trainer_version=0, critic=critic)
    assert [c[0] for c in critic.calls] == ["values"]
    assert "ref_logprobs" not in out and "recorded_experts" not in out
    want = compute_advantages(out, cfg)
    assert want.returns is not None and torch.equal(out["returns"], want.returns)
    assert torch.equal(out["values"], torch.full(out["tokens"].shape, 0.1))
    assert "critic/returns_mean" in metrics


def test_prepare_checks_the_batch_it_made():
    class Wide(StandIn):
        def forward_logprobs(self, tb, reference=False):
            return {"logprobs": torch.zeros(tb["tokens"].shape[0], 9)}

    with pytest.raises(TrainBatchError, match=r"old_logprobs: shape \[4, 9\], expected \[N, L\] with L = 5"):
        _prepare(Wide(config_from_dict({})), rollout(), trainer_version=0)


# ------------------------------------------------------------------------------------------------
# The loss adapter runs the bound loss exactly as it ran rl_loss
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_the_adapter_gives_todays_loss_and_logit_gradients_bit_for_bit(agg):
    """LossAdapter.train_loss_func with its default (bound) loss against the call the adapter made
    before the loss was bound: rl_loss with every argument spelt out, the same scaling."""
    from megatron_acrl.megatron.loss_adapter import LossAdapter, megatron_loss_scale

    g = torch.Generator().manual_seed(11)
    b, t, v = 3, 5, 10
    tb = complete()
    micro = {k: x[:b, :t].clone() for k, x in tb.items() if x.dim() == 2}
    micro["tokens"] = torch.randint(0, v, (b, t), generator=g)
    micro["old_logprobs"] = -torch.rand(b, t, generator=g)
    micro["rollout_logprobs"] = micro["old_logprobs"] + 0.1 * torch.randn(b, t, generator=g)
    micro["ref_logprobs"] = -torch.rand(b, t, generator=g)
    micro["advantages"] = torch.randn(b, t, generator=g) * micro["loss_mask"]
    logits = torch.randn(b, t, v, generator=g)
    alg = AlgorithmConfig(loss_agg=agg, kl_coef=0.05, entropy_coef=0.01)
    cfg = CorrectionConfig(method="acrl", kernel="torch")
    sig, n_tok, n_seq = AcrlSignal(x=0.03, y=0.07), torch.tensor(7.0), torch.tensor(3.0)
    adapter = LossAdapter(
        algorithm=alg, correction=cfg, tp_group=None, vocab_size=v, norm_len=4, device="cpu"
    )
    x1 = logits.clone().requires_grad_()
    loss, n_local, metrics = adapter.train_loss_func(
        micro, acrl=sig, num_tokens=n_tok, num_seqs=n_seq, num_microbatches=2, dp_size=3
    )(x1)
    (grad,) = torch.autograd.grad(loss, x1)

    x2 = logits.clone().requires_grad_()
    lp, ent = adapter.token_logprobs(x2, micro["tokens"], with_entropy=True)
    mask = micro["loss_mask"].float()
    want, want_metrics = rl_loss(
        lp, micro["old_logprobs"], micro["rollout_logprobs"], micro["advantages"], mask, algorithm=alg,
        correction=cfg, acrl=sig, num_tokens=n_tok, num_seqs=n_seq, fused=False, entropy=ent,
        ref_logprobs=micro["ref_logprobs"], norm_len=4,
    )  # fmt: skip
    want_n, undo = megatron_loss_scale(mask, 2, 3)
    (want_grad,) = torch.autograd.grad(want * undo, x2)
    assert torch.equal(loss, want * undo) and torch.equal(n_local, want_n)
    assert torch.equal(grad, want_grad) and grad.abs().sum() > 0
    assert metrics.keys() == want_metrics.keys()
    assert all(torch.equal(metrics[k], want_metrics[k]) for k in metrics)
