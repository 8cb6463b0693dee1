"""MoE routing replay (R3/R2) pieces that need no process group: token order, replay semantics on
Megatron's real routing function, mismatch metrics, the rollout batch, the client decoder, config
validation and the SGLang CPU allocator hook. The multi-rank and real-server proofs are in
``tests/test_megatron_layouts.py`` (layouts) and ``tests/bridge/test_r3_server.py`` (SGLang)."""

from __future__ import annotations

import base64
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_acrl.batch.rollout_batch import RolloutBatch, build_batch
from megatron_acrl.config import ConfigError, load_config
from megatron_acrl.megatron.routing_replay import (
    ObservedRouterReplay,
    micro_batch_indices,
    routing_mismatch_metrics,
    routing_mismatch_sums,
)
from sglang_bridge.client import decode_routed_experts
from sglang_bridge.cpu_compat import HOOKS_ENV, R3_HOOK_DIR, STAND_IN_DIR
from sglang_bridge.server import ServerSpec

# From the research recipe (example_r3.json): 4 routed positions, 2 layers, top-2.
EXAMPLE_B64 = "AgAAAAMAAAAAAAAAAwAAAAIAAAADAAAAAgAAAAAAAAACAAAAAAAAAAAAAAACAAAAAwAAAAIAAAACAAAAAAAAAA=="


def _encoded(b: int, s: int, layers: int, k: int) -> torch.Tensor:
    """[b, s, layers, k] whose entries name their own (sequence, position, layer, slot)."""
    j, i, l, c = torch.meshgrid(
        torch.arange(b), torch.arange(s), torch.arange(layers), torch.arange(k), indexing="ij"
    )
    return j * 1_000_000 + i * 1_000 + l * 10 + c


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_micro_batch_indices_follow_megatron_token_order(tp):
    b, s, layers, k = 3, 8, 4, 2
    routing = _encoded(b, s, layers, k)
    for rank in range(tp):
        for layer in range(layers):
            got = micro_batch_indices(routing, layer, sequence_parallel=tp > 1, tp_size=tp, tp_rank=rank)
            s_local = s // tp
            assert got.shape == (s_local * b, k) and got.dtype == torch.int64
            # The router flattens [s_local, b] hidden states: token t is position t // b (offset by
            # this rank's SP slice) of sequence t % b.
            for t in range(s_local * b):
                pos, seq = rank * s_local + t // b, t % b
                assert got[t].tolist() == routing[seq, pos, layer].tolist()


def _route(replay: ObservedRouterReplay | None, logits: torch.Tensor, topk: int = 2):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    return topk_routing_with_score_function(logits, topk, use_pre_softmax=False, router_replay=replay)


def test_replay_on_megatrons_routing_function():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    torch.manual_seed(0)
    logits = torch.randn(6, 4, requires_grad=True)
    before = len(RouterReplay.global_router_replay_instances)
    replay = ObservedRouterReplay(num_experts=4)
    assert len(RouterReplay.global_router_replay_instances) == before  # driven explicitly, not globally
    own_probs, own_map = _route(None, logits)

    # No action: the router's own choice, observed when asked.
    replay.observe = True
    probs, rmap = _route(replay, logits)
    assert torch.equal(rmap, own_map) and torch.allclose(probs, own_probs)
    assert torch.equal(replay.observed[0], torch.topk(logits, 2, dim=1).indices)

    # Forward replay: the given experts, -1 rows keep the router's own; probabilities are a softmax
    # over the router's logits at the replayed experts (so the router keeps its gradient).
    target = torch.tensor([[0, 1], [2, 3], [-1, -1], [3, 0], [1, 2], [-1, -1]])
    replay.set_target_indices(target)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, rmap = _route(replay, logits)
    for t in range(6):
        want = set(target[t].tolist()) if target[t, 0] >= 0 else set(own_map[t].nonzero().flatten().tolist())
        assert set(rmap[t].nonzero().flatten().tolist()) == want
        sel = sorted(want)
        ref = torch.softmax(logits[t, sel], -1)
        assert torch.allclose(probs[t, sel], ref)
    probs.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert len(replay.observed) == 2  # forward passes are observed (before replay)...

    # ...recompute is not, and pops the same indices FIFO.
    replay.set_target_indices(torch.tensor([[1, 0]] * 6))
    replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    _, first = _route(replay, logits.detach())
    _, second = _route(replay, logits.detach())
    assert torch.equal(first, rmap) and set(second[0].nonzero().flatten().tolist()) == {0, 1}
    assert len(replay.observed) == 2
    with pytest.raises(RuntimeError, match="FIFO empty"):
        _route(replay, logits.detach())

    # Misaligned or invalid indices are errors, never silently accepted.
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replay.set_target_indices(torch.zeros(5, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="not aligned"):
        _route(replay, logits.detach())
    replay.set_target_indices(torch.full((6, 2), 4))
    with pytest.raises(ValueError, match="outside"):
        _route(replay, logits.detach())


def test_mismatch_metrics_by_hand():
    # 1 sequence, 4 positions, 2 layers, top-2. Layer 1 disagrees at position 1 (as a set), so
    # token 2 is flipped; order within the top-k does not count; position 3 is unknown.
    own = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 0], [0, 3]], [[0, 1], [0, 1]]]])
    rollout = torch.tensor([[[[0, 1], [3, 2]], [[0, 1], [1, 3]], [[0, 1], [0, 3]], [[-1, -1], [-1, -1]]]])
    old = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    mu = torch.tensor([[0.0, -1.1, -2.5, -3.05]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    sums, flips = routing_mismatch_sums(own, rollout, old, mu, mask)
    assert flips.tolist() == [[0, 0, 1, 0]]
    assert sums[:, 0].tolist() == [3, 3]  # decisions per layer (position 3 unknown)
    assert sums[:, 1].tolist() == [0, 1]
    m = routing_mismatch_metrics(sums, flips, old, mu, mask, [0, 1])
    assert m["routing/disagree_frac"] == pytest.approx(1 / 6)
    assert m["routing/disagree_frac/layer_1"] == pytest.approx(1 / 3)
    assert m["routing/flipped_token_frac"] == pytest.approx(1 / 3)
    assert m["routing/logp_gap_flipped"] == pytest.approx(0.5)
    assert m["routing/logp_gap_agree"] == pytest.approx(0.075)
    assert m["routing/gap_share_flipped"] == pytest.approx(0.5 / 0.65)
    assert m["routing/logp_gap_flipped/layer_1"] == pytest.approx(0.5)
    assert np.isnan(m["routing/logp_gap_flipped/layer_0"])


def test_decode_routed_experts_matches_recorded_example():
    arr = decode_routed_experts(EXAMPLE_B64, num_positions=4, topk=2)
    assert arr.shape == (4, 2, 2) and arr.dtype == np.int32
    assert arr[0].tolist() == [[2, 3], [0, 3]]
    assert len(base64.b64decode(EXAMPLE_B64)) == 4 * 2 * 2 * 4
    with pytest.raises(ValueError, match="num_positions"):
        decode_routed_experts(EXAMPLE_B64, num_positions=6, topk=2)


def test_rollout_batch_carries_routed_experts(tmp_path):
    prompts, outputs = [[5, 6, 7], [8, 9]], [[1, 2], [3, 4, 5]]
    routed = [np.arange(4 * 2 * 2).reshape(4, 2, 2) % 4, np.arange(4 * 2 * 2).reshape(4, 2, 2)[::-1] % 4]
    b = build_batch(
        prompts, outputs, [[-1.0, -2.0], [-1.0, -1.0, -1.0]], rewards=[0, 1], group_ids=[0, 0], pad_id=0,
        routed_experts=routed,
    )  # fmt: skip
    assert b.routed_experts.shape == (2, 5, 2, 2) and b.routed_experts.dtype == torch.int16
    # position p holds token p's routing; the last token (never fed to the engine) and padding: -1
    assert b.routed_experts[0, :4].tolist() == routed[0].tolist()
    assert (b.routed_experts[0, 4:] == -1).all() and b.routed_experts[1, :4].tolist() == routed[1].tolist()
    assert "routed_experts" in b.tensors()
    assert torch.equal(b.select([1]).routed_experts, b.routed_experts[1:])
    wide = build_batch([[1] * 6], [[2]], [[-1.0]], rewards=[0], group_ids=[1], pad_id=0,
                       routed_experts=[np.zeros((6, 2, 2))])  # fmt: skip
    cat = RolloutBatch.concat([b, wide])
    assert cat.routed_experts.shape == (3, 7, 2, 2) and (cat.routed_experts[:2, 5:] == -1).all()
    b.save(tmp_path / "b.pt")  # --save-rollouts / --load-rollouts keep them
    assert torch.equal(RolloutBatch.load(tmp_path / "b.pt").routed_experts, b.routed_experts)
    with pytest.raises(ValueError, match="one row per position"):
        build_batch(prompts, outputs, [[-1.0, -2.0], [-1.0] * 3], rewards=[0, 1], group_ids=[0, 0], pad_id=0,
                    routed_experts=[routed[0][:3], routed[1]])  # fmt: skip
    with pytest.raises(ValueError, match="with and without"):
        RolloutBatch.concat([b, build_batch([[1]], [[2]], [[-1.0]], rewards=[0], group_ids=[1], pad_id=0)])


def test_config_switch_is_validated():
    moe = "configs/tiny_moe.yaml"
    assert load_config(moe).model.moe_routing_replay == "off"
    assert load_config(moe, ["model.moe_routing_replay=rollout"]).model.moe_routing_replay == "rollout"
    with pytest.raises(ConfigError, match=r"model.moe_routing_replay: .*dense.*set moe_routing_replay: off"):
        load_config("configs/tiny_dense.yaml", ["model.moe_routing_replay=rollout"])
    with pytest.raises(ConfigError, match=r"rollout.return_routed_experts: .*replays the experts SGLang"):
        load_config(moe, ["model.moe_routing_replay=rollout", "rollout.return_routed_experts=false"])
    load_config(moe, ["model.moe_routing_replay=train", "rollout.return_routed_experts=false"])
    with pytest.raises(ConfigError, match="did you mean 'rollout'"):
        load_config(moe, ["model.moe_routing_replay=rollot"])


def test_server_spec_requests_routed_experts_with_cpu_hook():
    plain = ServerSpec(model_path="m", device="cpu")
    r3 = ServerSpec(model_path="m", device="cpu", return_routed_experts=True)
    # Every CPU server runs the hooks module (the paused_sleep patch); only R3 selects r3_alloc.
    assert "--enable-return-routed-experts" not in plain.command(1)
    assert "r3_alloc" not in plain.env()[HOOKS_ENV].split(",")
    assert "--enable-return-routed-experts" in r3.command(1)
    assert "r3_alloc" in r3.env()[HOOKS_ENV].split(",")
    assert r3.env()["PYTHONPATH"].split(":")[:2] == [str(R3_HOOK_DIR), str(STAND_IN_DIR)]
    gpu = ServerSpec(model_path="m", device="cuda", return_routed_experts=True)
    # Real CUDA hosts pin the buffer: a CUDA server's hooks bind its stores only (bound_stores).
    assert gpu.env()[HOOKS_ENV] == "bound_stores"


def test_cpu_allocator_hook_in_a_child(tmp_path):
    """The hook adds a CPU allocator to SGLang's ``ALLOC_MEMORY_FUNCS`` when the module is imported.

    A stand-in ``sglang.srt.mem_cache.pool_host.common`` keeps this fast (importing SGLang takes
    minutes on a loaded 2-core machine); the real module is exercised by the server started with
    ``--enable-return-routed-experts`` in ``tests/bridge/test_r3_server.py``.
    """
    pkg = tmp_path / "sglang" / "srt" / "mem_cache" / "pool_host"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents):
        if d == tmp_path:
            break
        (d / "__init__.py").write_text("")
    (pkg / "common.py").write_text(
        "ALLOC_MEMORY_FUNCS = {}\n"
        "class HostTensorAllocator:\n"
        "    def allocate(self, dims, dtype, device):\n"
        "        return ('allocated', dims, dtype, device)\n"
    )
    code = (
        "from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS, HostTensorAllocator\n"
        "print(ALLOC_MEMORY_FUNCS['cpu']((3, 2, 2), dtype='int32', device='cpu', pin_memory=True,\n"
        "                                allocator=HostTensorAllocator()))\n"
    )
    env = {"PYTHONPATH": f"{R3_HOOK_DIR}:{tmp_path}", HOOKS_ENV: "r3_alloc", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "('allocated', (3, 2, 2), 'int32', 'cpu')" in out.stdout
    # Without the hook on the path nothing is patched.
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "KeyError" in out.stderr
