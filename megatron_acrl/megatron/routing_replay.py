"""MoE routing replay on Megatron-Core's ``RouterReplay``: R3 (replay the rollout engine's experts) and
R2 (replay the trainer's own pi_old routing in the training pass), plus routing-mismatch metrics.

Megatron-Core 0.16.1 (``transformer/moe/router_replay.py``): with ``moe_enable_routing_replay`` every
``TopKRouter`` owns a ``RouterReplay`` whose action decides the top-k of ``topk_routing_with_score_function``
(``moe_utils.py``): RECORD keeps the router's choice, REPLAY_FORWARD uses the indices set with
``set_target_indices`` and gathers the router's logits at them (so the router still gets gradients),
REPLAY_BACKWARD pops the same indices FIFO for the forward that activation recompute re-runs during
backward. :class:`ObservedRouterReplay` is that class with two additions we need:

* it always computes the router's own top-k and, while ``observe`` is set, keeps it: the mismatch
  metrics compare the trainer's routing *before replay* with the rollout's, in the same pass;
* rows of ``-1`` replay nothing (the router's own choice is used): SGLang returns no routing for a
  sequence's last token (it was never fed through the model) and padding has none. Those rows feed
  no scored log-prob, so any choice is exact; using the router's own keeps them equal to no replay.

Megatron's class-level list ``RouterReplay.global_router_replay_instances`` collects the routers of
*every* model built in the process (policy, reference, critic, every layout of a test launch) and
its static setters act on all of them. :class:`RoutingReplay` therefore takes its own model's
instances out of that list and drives them explicitly.

Token order (why the slicing looks like this): a router sees the hidden states ``[s, b, h]`` of its
micro-batch flattened to ``[s * b, E]`` logits (sequence-major: token ``i * b + j`` is position i
of sequence j); under sequence parallelism TP rank r holds positions ``[r * s / tp, (r + 1) * s /
tp)``. Layer order: the rollout's layer axis is the HF decoder-layer index, i.e. Megatron's global
``layer_number - 1`` (pipeline and virtual-stage offsets included).

Batch layout of routing indices (same as ``RolloutBatch.routed_experts``): ``[N, L, layers, k]``
integers, position p holding the experts token p was routed to, ``-1`` where unknown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

__all__ = [
    "ObservedRouterReplay",
    "RoutingReplay",
    "micro_batch_indices",
    "routing_mismatch_metrics",
    "routing_mismatch_sums",
]

ReplayMode = Literal["off", "rollout", "train"]


class ObservedRouterReplay(RouterReplay):
    """Megatron's ``RouterReplay`` that also observes the router's own choice and replays partially.

    ``observed`` collects the router's own top-k ``[tokens, k]`` (int64) of every forward (not of
    recompute) while ``observe`` is True, ``applied`` the top-k it then used (replayed or own).
    Replayed indices must be ``[tokens, k]`` with the router's token count; a row of ``-1`` keeps
    the router's own choice for that token.
    """

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        # Driven per model by RoutingReplay, never through the class-level list (see module doc).
        RouterReplay.global_router_replay_instances.remove(self)
        self.num_experts = num_experts
        self.observe = False
        self.observed: list[Tensor] = []
        self.applied: list[Tensor] = []

    def get_replay_topk(  # noqa: D102 - Megatron's signature; see the class doc
        self,
        scores: Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk=None,  # noqa: ANN001 - Megatron's callable
    ) -> tuple[Tensor, Tensor]:
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        action = self.router_replay_action
        observe = self.observe and action != RouterReplayAction.REPLAY_BACKWARD
        if observe:
            self.observed.append(own.detach().clone())
        if action == RouterReplayAction.RECORD:
            self.record_indices(own)
        if action == RouterReplayAction.REPLAY_FORWARD:
            target = self.target_topk_idx
        elif action == RouterReplayAction.REPLAY_BACKWARD:
            if not self.replay_backward_list:
                raise RuntimeError("routing replay: recompute found no replayed indices left (FIFO empty)")
            target = self.replay_backward_list.pop(0)
        else:
            if observe:
                self.applied.append(self.observed[-1])
            return probs, own
        if target is None or tuple(target.shape) != tuple(own.shape):
            got = None if target is None else tuple(target.shape)
            raise ValueError(
                f"routing replay: router sees {tuple(own.shape)} [tokens, top_k] but was given {got}; "
                "the replayed indices are not aligned with this micro-batch"
            )
        target = target.to(device=own.device, dtype=own.dtype)
        known = (target >= 0).all(-1, keepdim=True)
        if bool(((target >= self.num_experts) | ((target < 0) & known)).any()):
            raise ValueError(f"routing replay: expert index outside [0, {self.num_experts})")
        idx = torch.where(known, target, own)
        if observe:
            self.applied.append(idx.detach().clone())
        return scores.gather(1, idx), idx


@dataclass
class _Router:
    replay: ObservedRouterReplay
    layer: int  # global decoder-layer index (0-based) = the rollout's layer axis
    local: int  # position among this rank's MoE layers (all virtual stages, in order)


def micro_batch_indices(
    routing: Tensor, local: int, *, sequence_parallel: bool, tp_size: int, tp_rank: int
) -> Tensor:
    """Indices of one layer of one micro-batch in the order its router sees tokens.

    Args:
        routing: ``[b, s, layers, k]`` micro-batch routing (``-1`` = unknown), ``s`` the padded length.
        local: which layer of ``routing``'s layer axis.
    Returns:
        ``[s_local * b, k]`` int64, sequence-major (token ``i * b + j`` = position i of sequence j),
        only this TP rank's positions under sequence parallelism.
    """
    x = routing[:, :, local].transpose(0, 1)  # [s, b, k]
    if sequence_parallel and tp_size > 1:
        s = x.shape[0] // tp_size
        x = x[tp_rank * s : (tp_rank + 1) * s]
    return x.reshape(-1, x.shape[-1]).to(torch.int64).contiguous()


class RoutingReplay:
    """The MoE routers of one model (this rank's chunks) under replay / observation.

    Args:
        chunks: this rank's model chunks (possibly DDP / Float16Module wrapped), in virtual-stage order.
        sequence_parallel / tp_group: how the routers' tokens are sliced.
    """

    def __init__(
        self, chunks: Sequence[torch.nn.Module], *, sequence_parallel: bool, tp_group: dist.ProcessGroup
    ) -> None:
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_group.size(), tp_group.rank()
        self.by_chunk: dict[int, list[_Router]] = {}
        self.routers: list[_Router] = []
        for chunk in chunks:
            entries = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    layer = getattr(module, "layer_number", None)
                    if layer is None or module.router_replay is None:
                        raise RuntimeError(
                            "routing replay needs moe_enable_routing_replay and numbered routers "
                            "(megatron-core >= 0.16)"
                        )
                    replay = ObservedRouterReplay(module.config.num_moe_experts)
                    if module.router_replay in RouterReplay.global_router_replay_instances:
                        RouterReplay.global_router_replay_instances.remove(module.router_replay)
                    module.router_replay = replay
                    entries.append(_Router(replay, int(layer) - 1, len(self.routers) + len(entries)))
            self.by_chunk[id(chunk)] = entries
            self.routers += entries
        self._active = False

    @property
    def layers(self) -> list[int]:
        """Global decoder-layer indices of this rank's MoE layers, in local order."""
        return [r.layer for r in self.routers]

    def __len__(self) -> int:
        return len(self.routers)

    # -- one schedule run ---------------------------------------------------------------------

    def begin(self, *, replay: bool, observe: bool) -> None:
        """Start a schedule run: replay each micro-batch's ``"replay_experts"``, and/or observe."""
        for r in self.routers:
            r.replay.clear_indices()
            r.replay.clear_router_replay_action()
            r.replay.observe = observe
            r.replay.observed = []
            r.replay.applied = []
        self._replay = replay
        self._active = True

    def before_forward(self, chunk: torch.nn.Module, micro: Mapping[str, Tensor]) -> None:
        """Set the replayed indices of ``chunk``'s routers for ``micro`` (called in forward_step)."""
        if not (self._active and self._replay):
            return
        routing = micro["replay_experts"]
        for r in self.by_chunk.get(id(chunk), []):
            r.replay.set_target_indices(
                micro_batch_indices(
                    routing,
                    r.local,
                    sequence_parallel=self.sequence_parallel,
                    tp_size=self.tp_size,
                    tp_rank=self.tp_rank,
                )
            )
            r.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, chunk: torch.nn.Module) -> None:
        """From now on ``chunk``'s routers serve activation recompute (FIFO of the replayed indices)."""
        if not (self._active and self._replay):
            return
        for r in self.by_chunk.get(id(chunk), []):
            r.replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def end(self) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
        """End the run; returns the observed own choices and the applied (replayed) ones, each
        ``[router][micro-batch] -> [s_local * b, k]``."""
        observed, applied = [], []
        for r in self.routers:
            observed.append(r.replay.observed)
            applied.append(r.replay.applied)
            r.replay.observed = []
            r.replay.applied = []
            r.replay.observe = False
            r.replay.clear_indices()
            r.replay.clear_router_replay_action()
        self._active = False
        return observed, applied

    # -- observed routing -> batch layout -------------------------------------------------------

    def assemble(
        self,
        observed: list[list[Tensor]],
        *,
        num_seqs: int,
        seq_len: int,
        micro: Sequence[tuple[Sequence[int], int]],
        dp_group: dist.ProcessGroup,
    ) -> Tensor:
        """This stage's observed routing of the whole batch: ``[N, L, local layers, k]`` int16.

        ``micro`` holds this rank's micro-batches in schedule order, each ``(batch rows, padded
        length)`` (the trainer's micro-batch plan). Each rank observed its micro-batches and, under
        sequence parallelism, its TP slice of their positions; entries are stored as ``index + 1`` in
        a zero tensor and summed over TP and DP (every entry has exactly one owner), so every rank of
        the stage ends with the whole batch. Positions no micro-batch ran (beyond a row's own length
        under token-budget micro-batches) hold -1.
        """
        n_layers = len(self.routers)
        k = observed[0][0].shape[-1] if n_layers and observed[0] else 1
        width = max([seq_len, *(length for _, length in micro)])
        full = torch.zeros(num_seqs, width, n_layers, k, dtype=torch.int32)
        sp = self.sequence_parallel and self.tp_size > 1
        for li, per_mb in enumerate(observed):
            for (rows, length), own in zip(micro, per_mb, strict=True):
                s_local = length // self.tp_size if sp else length
                p0 = self.tp_rank * s_local if sp else 0
                x = own.reshape(s_local, len(rows), k).transpose(0, 1).to(torch.int32) + 1  # [b, s_local, k]
                full[torch.as_tensor(list(rows), dtype=torch.long), p0 : p0 + s_local, li] = x
        if sp:
            dist.all_reduce(full, group=self.tp_group)
        if dp_group.size() > 1:
            dist.all_reduce(full, group=dp_group)
        return (full[:, :seq_len] - 1).to(torch.int16)


# ----------------------------------------------------------------------------------------------
# Routing-mismatch metrics (pure torch + one explicit reduction over the pipeline group)
# ----------------------------------------------------------------------------------------------


def routing_mismatch_sums(
    own: Tensor,
    rollout: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """Per-layer sums and per-token flip counts of the trainer's vs the rollout's routing.

    Args:
        own: ``[N, L, layers, k]`` the trainer's own routing (before replay); -1 = unknown.
        rollout: ``[N, L, layers, k]`` the rollout engine's routing of the same layers; -1 = unknown.
        old_logprobs / rollout_logprobs / loss_mask: ``[N, L]`` (aligned: position t = token t).
    Returns:
        ``sums [layers, 6]`` float64 columns: decisions, disagreements, |gap| on flipped tokens,
        flipped tokens, |gap| on agreeing tokens, agreeing tokens -- where a token t is *flipped in
        layer l* if the routing of position t-1 (whose output predicts token t) differs as a set;
        and ``flips [N, L]`` int32, the number of flipped layers of each token.
    """
    known = (own >= 0).all(-1) & (rollout >= 0).all(-1)  # [N, L, layers]
    differ = (own.sort(-1).values != rollout.sort(-1).values).any(-1)
    flip = known & differ
    # The decision at position t-1 produces the distribution of token t.
    shift = torch.zeros_like(flip[:, :1])
    flip_tok = torch.cat([shift, flip[:, :-1]], 1)
    known_tok = torch.cat([shift, known[:, :-1]], 1)
    mask = (loss_mask > 0).unsqueeze(-1)
    gap = (old_logprobs.double() - rollout_logprobs.double()).abs().unsqueeze(-1)
    f = (flip_tok & mask).double()
    a = (known_tok & ~flip_tok & mask).double()
    sums = torch.stack(
        [
            known.double().sum((0, 1)),
            flip.double().sum((0, 1)),
            (gap * f).sum((0, 1)),
            f.sum((0, 1)),
            (gap * a).sum((0, 1)),
            a.sum((0, 1)),
        ],
        -1,
    )
    return sums, flip_tok.sum(-1).to(torch.int32)


def routing_mismatch_metrics(
    sums: Tensor,
    flips: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    layers: Sequence[int],
) -> dict[str, float]:
    """Final metrics from the (already reduced) outputs of :func:`routing_mismatch_sums`.

    Args:
        sums: ``[num_layers, 6]`` over all MoE layers (``layers`` gives their decoder indices).
        flips: ``[N, L]`` flipped layers per token. old/rollout log-probs, loss_mask: ``[N, L]``.
    Returns:
        ``routing/disagree_frac`` (token-layer decisions), ``routing/flipped_token_frac`` (response
        tokens with >= 1 flipped layer), ``routing/logp_gap_flipped`` / ``_agree`` (mean |pi_old - mu|),
        ``routing/gap_share_flipped`` (share of the total |gap| on flipped tokens), ``_max`` of the
        gap on agreeing tokens, and per layer ``.../layer_<l>``.
    """

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else float("nan")

    tot = sums.sum(0).tolist()
    out = {"routing/disagree_frac": ratio(tot[1], tot[0]), "routing/decisions": tot[0]}
    mask = loss_mask > 0
    gap = (old_logprobs.double() - rollout_logprobs.double()).abs()
    flipped = mask & (flips > 0)
    agree = mask & (flips == 0)
    g_all, g_flip = float(gap[mask].sum()), float(gap[flipped].sum())
    out.update(
        {
            "routing/flipped_token_frac": ratio(float(flipped.sum()), float(mask.sum())),
            "routing/logp_gap_flipped": ratio(g_flip, float(flipped.sum())),
            "routing/logp_gap_agree": ratio(float(gap[agree].sum()), float(agree.sum())),
            "routing/gap_share_flipped": ratio(g_flip, g_all),
            "routing/logp_gap_agree_max": float(gap[agree].max()) if bool(agree.any()) else float("nan"),
        }
    )
    for row, layer in zip(sums.tolist(), layers, strict=True):
        out[f"routing/disagree_frac/layer_{layer}"] = ratio(row[1], row[0])
        out[f"routing/logp_gap_flipped/layer_{layer}"] = ratio(row[2], row[3])
        out[f"routing/logp_gap_agree/layer_{layer}"] = ratio(row[4], row[5])
    return out
