"""Layout invariance of the Megatron trainer: the core test of the training half.

A single-rank fp32 run (TP=PP=EP=DP=1) of each model is the reference. Every parallel layout loads
the reference's initial weights through the HF tables, then runs forward-only log-probs, two ACRL
controller updates and one Adam step (eps >> |g|, no clipping: the update is ~ minus the gradient)
with the real loss. Loss, metrics, controller state, the forward-only log-probs and every updated
parameter (exported back to HF names) must match the reference. qwen2 also normalises the weights
(``correction.batch_normalize``) and its reference trains the batch as one micro-batch, so one mean
weight of the whole batch must reach every micro-batch of every layout. A negative control loads wrongly
sharded weights and must fail the same comparison.

The PPO critic (``megatron_acrl.megatron.critic``: value head instead of the vocab projection) gets
the same treatment: values, clipped value loss and every updated parameter vs its single-rank run,
with a negative control that reduce-scatters the value head's input gradient under SP.

Two launches in all (start-up dominates on CPU): one rank for the references, four ranks for every
layout (``destroy_model_parallel`` / ``initialize_model_parallel`` between them).
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_launch import launch, update_mismatches

# Two launches take ~40 s on an idle 2-core machine; allow for a heavily shared one.
pytestmark = pytest.mark.timeout(1800)

KINDS = ["qwen2", "qwen3", "moe", "moe_shared"]
CASES = [
    # dense, tied embeddings (qwen2)
    dict(name="qwen2_tp2_pp2", kind="qwen2", layout=dict(tp=2, pp=2)),
    dict(name="qwen2_pp2_vpp2_dp2", kind="qwen2", layout=dict(pp=2, vpp=2)),
    dict(name="qwen2_tp2_pp2_NEGATIVE", kind="qwen2", layout=dict(tp=2, pp=2), negative=True),
    # dense, untied, QK-norm, KL to a reference model (qwen3); DP with the distributed optimizer
    dict(name="qwen3_tp2_dp2_distopt", kind="qwen3", layout=dict(tp=2, distributed_optimizer=True)),
    dict(name="qwen3_dp4_distopt", kind="qwen3", layout=dict(distributed_optimizer=True)),
    # MoE (qwen3_moe + shared expert + aux loss)
    dict(name="moe_ep2_dp4", kind="moe", layout=dict(ep=2)),
    dict(name="moe_ep2_tp2_sp", kind="moe", layout=dict(ep=2, tp=2, sequence_parallel=True)),
    dict(name="moe_shared_ep2_tp2_sp", kind="moe_shared", layout=dict(ep=2, tp=2, sequence_parallel=True)),
    dict(name="moe_tp2_sp_pp2", kind="moe", layout=dict(tp=2, pp=2, sequence_parallel=True)),
    # bf16 (Float16Module, bf16 logits into the fused log-prob): close to fp32, not equal
    dict(name="qwen2_bf16_tp2_pp2", kind="qwen2", layout=dict(tp=2, pp=2), bf16=True),
]
# Token-budget micro-batches (training.max_tokens_per_microbatch) on a long-tailed batch, against
# the single-rank fixed-micro-batch run on the same batch: every aggregation, TP/PP/DP/EP/SP, the
# KL reference model, the critic. Budgets of 36-40 tokens cut the 8 sequences (5..16 tokens) into 1-3
# micro-batches of different shapes per rank (variable sequence lengths under PP).
VARLEN_REFS = {
    f"varlen_{kind}_{agg}": dict(kind=kind, agg=agg)
    for kind, agg in (
        ("qwen2", "token-mean"),
        ("qwen2", "seq-mean-token-mean"),
        ("qwen2", "seq-mean-token-sum-norm"),
        ("qwen3", "token-mean"),
        ("moe_noaux", "seq-mean-token-mean"),
    )
}
VARLEN_REFS["varlen_critic_qwen2"] = dict(kind="qwen2", critic=True)


def _budget(name: str, ref: str, budget: int, **layout: object) -> dict:
    spec = VARLEN_REFS[ref]
    layout = dict(layout, varlen=True, budget=budget, agg=spec.get("agg", "seq-mean-token-mean"))
    return dict(name=name, kind=spec["kind"], layout=layout, ref=ref, critic=spec.get("critic", False))


BUDGET_CASES = [
    _budget("budget_qwen2_dp4_tokmean", "varlen_qwen2_token-mean", 40),
    _budget(
        "budget_qwen2_tp2_pp2_seqmean", "varlen_qwen2_seq-mean-token-mean", 40, tp=2, pp=2, logprob_budget=64
    ),
    _budget("budget_qwen2_pp2_dp2_sumnorm", "varlen_qwen2_seq-mean-token-sum-norm", 36, pp=2),
    _budget(
        "budget_qwen2_tp2_sp_dp2_seqmean",
        "varlen_qwen2_seq-mean-token-mean",
        36,
        tp=2,
        sequence_parallel=True,
    ),
    _budget(
        "budget_qwen3_kl_tp2_dp2_tokmean", "varlen_qwen3_token-mean", 40, tp=2, distributed_optimizer=True
    ),
    _budget("budget_moe_ep2_dp4", "varlen_moe_noaux_seq-mean-token-mean", 40, ep=2),
    _budget(
        "budget_moe_tp2_sp_pp2",
        "varlen_moe_noaux_seq-mean-token-mean",
        40,
        tp=2,
        pp=2,
        sequence_parallel=True,
    ),
    _budget("budget_critic_qwen2_pp2_dp2", "varlen_critic_qwen2", 36, pp=2),
]
STRICT = [c["name"] for c in CASES if not c.get("bf16")]
# The PPO critic (value head instead of the vocab projection), in the same two launches.
CRITIC_KINDS = ["qwen2", "moe"]
CRITIC_CASES = [
    dict(name="critic_qwen2_tp2_pp2", kind="qwen2", layout=dict(tp=2, pp=2)),
    dict(name="critic_qwen2_pp2_vpp2_dp2", kind="qwen2", layout=dict(pp=2, vpp=2)),
    dict(
        name="critic_qwen2_tp2_sp_dp2_distopt",
        kind="qwen2",
        layout=dict(tp=2, sequence_parallel=True, distributed_optimizer=True),
    ),
    dict(name="critic_moe_ep2_tp2_sp", kind="moe", layout=dict(ep=2, tp=2, sequence_parallel=True)),
    # the value head reduce-scattering its (full, duplicated) input gradient under SP
    dict(
        name="critic_qwen2_tp2_sp_NEGATIVE",
        kind="qwen2",
        layout=dict(tp=2, sequence_parallel=True),
        negative=True,
    ),
]
for _c in CRITIC_CASES:
    _c["critic"] = True


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    reference = launch(
        "reference",
        1,
        {"kinds": KINDS, "critic_kinds": CRITIC_KINDS, "varlen": VARLEN_REFS, "tmp": str(tmp)},
        timeout=900,
    )[0]
    torch.save(reference, tmp / "reference.pt")
    cases = [dict(c) for c in CASES + CRITIC_CASES + BUDGET_CASES]
    cases[0]["checkpoint_dir"] = str(tmp / "ckpt")
    cases[len(CASES)]["checkpoint_dir"] = str(tmp / "ckpt_critic")
    ranks = launch("layouts", 4, {"reference": str(tmp / "reference.pt"), "cases": cases}, timeout=1500)
    return reference, ranks


def _compare(ref: dict, got: dict) -> list[str]:
    """Everything that differs beyond fp32 rounding (empty list = match)."""
    bad = []
    for key, value in ref["metrics"].items():
        if key.startswith("perf/") or key.startswith("critic/perf/"):  # how it was cut, not what
            continue
        other = got["metrics"].get(key)
        if other is None:
            bad.append(f"metric {key} missing")
        elif not math.isclose(value, other, rel_tol=1e-4, abs_tol=1e-6):
            bad.append(f"metric {key}: {other} != reference {value}")
    for key, value in ref.get("controller", {}).items():
        other = got["controller"][key]
        if isinstance(value, float) and not math.isclose(value, other, rel_tol=1e-5, abs_tol=1e-9):
            bad.append(f"controller {key}: {other} != {value}")
    for key in [k for k in ("old", "entropy", "values") if k in ref]:  # forward-only outputs
        err = (ref[key] - got[key]).abs().max().item()
        if err > 1e-4:
            bad.append(f"forward-only {key} differs by {err:.2e}")
    if set(ref["after"]) != set(got["after"]):
        bad.append(f"exported names differ: {sorted(set(ref['after']) ^ set(got['after']))[:5]}")
        return bad
    return bad + update_mismatches(ref, got)


@pytest.mark.parametrize("case", STRICT)
def test_layout_matches_single_rank_fp32(results, case):
    reference, ranks = results
    spec = next(c for c in CASES if c["name"] == case)
    ref = reference[spec["kind"]]
    for rank, res in enumerate(ranks):  # every rank reports the same numbers
        bad = _compare(ref, res[case])
        if spec.get("negative"):
            assert bad, (
                f"negative control on rank {rank} matched the reference: the test cannot see sharding bugs"
            )
        else:
            assert not bad, f"rank {rank}: " + "; ".join(bad[:8])


def test_bf16_is_close_to_fp32(results):
    reference, ranks = results
    ref = reference["qwen2"]
    for res in ranks:
        got = res["qwen2_bf16_tp2_pp2"]
        assert (got["old"] - ref["old"]).abs().mean().item() < 0.02
        for key in ("loss/pg_loss", "loss/entropy", "grad_norm"):
            assert math.isclose(got["metrics"][key], ref["metrics"][key], rel_tol=0.05), key
        assert all(torch.isfinite(t.float()).all() for t in got["after"].values())


def test_reference_is_not_trivial(results):
    reference, _ = results
    for kind in KINDS:
        ref = reference[kind]
        assert ref["metrics"]["grad_norm"] > 0
        assert ref["controller"]["num_updates"] == 2
        assert abs(ref["metrics"]["acrl/alpha_mean"]) > 0.1  # Y != X: the correction is active
        moved = [n for n in ref["after"] if not torch.equal(ref["after"][n], ref["init"][n])]
        assert len(moved) == len(ref["after"]), "every parameter receives a gradient"


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "moe"])
def test_exported_hf_checkpoint_matches_transformers(results, kind):
    """Our HF export, loaded by HF transformers, gives the trainer's log-probs: the name tables,
    QKV interleaving, GLU order, RoPE, QK-norm, tied embeddings and the router agree with HF."""
    reference, _ = results
    ref = reference[kind]
    err = (ref["hf_old"] - ref["old"]).abs().max().item()
    assert err < 1e-4, f"{kind}: HF transformers log-probs differ from Megatron's by {err:.2e}"


def test_per_stage_export_covers_the_model_once_across_stages(results):
    reference, ranks = results
    for case in ("qwen2_tp2_pp2", "qwen2_pp2_vpp2_dp2", "moe_tp2_sp_pp2"):
        kind = next(c["kind"] for c in CASES if c["name"] == case)
        # ranks 0/1 are stage 0 and 2/3 stage 1 for tp2_pp2; any rank of each stage will do
        stages = {tuple(res[case]["stage_names"]) for res in ranks}
        names = [n for stage in stages for n in stage]
        assert sorted(names) == sorted(reference[kind]["after"]), case
        assert len(stages) == 2, f"{case}: expected two pipeline stages with different tensors"


def test_checkpoint_resume_reproduces_next_step(results):
    _, ranks = results
    for res in ranks:
        m2, m2_again = res[CASES[0]["name"]]["resume"]
        for key, value in m2.items():
            assert math.isclose(value, m2_again[key], rel_tol=1e-6, abs_tol=1e-9), key


@pytest.mark.parametrize("case", [c["name"] for c in CRITIC_CASES])
def test_critic_layout_matches_single_rank_fp32(results, case):
    """Values, value loss, clip fraction, grad norm and every updated critic parameter (incl. the
    value head, exported as ``score.weight``) match the single-rank fp32 critic."""
    reference, ranks = results
    spec = next(c for c in CRITIC_CASES if c["name"] == case)
    ref = reference[f"critic_{spec['kind']}"]
    for rank, res in enumerate(ranks):
        bad = _compare(ref, res[case])
        if spec.get("negative"):
            assert bad, f"critic negative control on rank {rank} matched: the test cannot see SP grad bugs"
        else:
            assert not bad, f"rank {rank}: " + "; ".join(bad[:8])


def test_critic_reference_is_not_trivial(results):
    reference, _ = results
    for kind in CRITIC_KINDS:
        ref = reference[f"critic_{kind}"]
        m = ref["metrics"]
        assert 0.05 < m["critic/value_clipfrac"] < 0.95, "both branches of the clipped loss are active"
        assert m["critic/value_loss"] > 0 and m["critic/grad_norm"] > 0
        assert ref["values"].abs().max() > 0 and "score.weight" in ref["after"]
        assert not any(n.startswith("lm_head") for n in ref["after"]), "the critic has no vocab head"
        moved = [n for n in ref["after"] if not torch.equal(ref["after"][n], ref["init"][n])]
        assert len(moved) == len(ref["after"]), "every critic parameter receives a gradient"


def test_critic_checkpoint_resume_reproduces_next_step(results):
    _, ranks = results
    for res in ranks:
        m2, m2_again = res[CRITIC_CASES[0]["name"]]["resume"]
        assert set(m2) == set(m2_again)
        for key, value in m2.items():
            assert math.isclose(value, m2_again[key], rel_tol=1e-6, abs_tol=1e-9), key


@pytest.mark.parametrize("case", [c["name"] for c in BUDGET_CASES])
def test_budget_micro_batches_match_fixed_single_rank(results, case):
    """Token-budget micro-batches give the loss, metrics, forward-only outputs and every updated
    parameter of fixed micro-batches on one rank, under every layout and aggregation."""
    reference, ranks = results
    spec = next(c for c in BUDGET_CASES if c["name"] == case)
    ref = reference[spec["ref"]]
    for rank, res in enumerate(ranks):
        bad = _compare(ref, res[case])
        assert not bad, f"rank {rank}: " + "; ".join(bad[:8])
        perf = {k.removeprefix("critic/"): v for k, v in res[case]["metrics"].items() if "perf/" in k}
        fixed = {k.removeprefix("critic/"): v for k, v in ref["metrics"].items() if "perf/" in k}
        # less padding than fixed micro-batches (5..16-token sequences all padded to 16 there)
        assert perf["perf/padding_fraction"] < fixed["perf/padding_fraction"], (perf, fixed)
        assert perf["perf/dp_token_imbalance"] < 1.35, perf
