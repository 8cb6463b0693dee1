"""Micro-batch plans: which sequences of a batch each data-parallel rank runs in which micro-batch,
and how far each micro-batch is padded.

Two plans, both pure functions of the sequences' lengths (every rank computes the same plan):

* :func:`fixed_plan` -- ``micro_batch_size`` sequences per micro-batch, each DP rank a contiguous
  slice, every micro-batch padded to the batch's longest sequence (the classic layout);
* :func:`budget_plan` -- token-budget micro-batches: sequences sorted longest first and packed
  first-fit-decreasing into micro-batches whose padded size (count x their own longest length,
  rounded up to ``multiple``) stays within ``budget`` tokens; the micro-batches are then dealt to the
  DP ranks so that every rank gets the same number of them (Megatron's collectives inside a forward,
  e.g. the MoE all-to-all over the expert-parallel group, need that) and about the same number of
  tokens, not of sequences.

A plan never changes the loss: the loss divides by the whole optimizer step's token and sequence
counts, which do not depend on the cut, and the Megatron adapter undoes the schedule's per
micro-batch and per DP rank averaging exactly (``megatron/loss_adapter.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MicroBatch", "MicroBatchPlan", "budget_plan", "fixed_plan", "row_lengths"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_lengths(loss_mask: torch.Tensor | None, num_rows: int, width: int) -> list[int]:
    """The length each row must be run at: up to and including its last loss-mask position.

    Later positions are right padding: no loss, no metric and no consumer of the forward-only
    outputs reads them, and causal attention makes the earlier positions independent of them.
    ``loss_mask [N, L]`` (None: every row runs at the full width ``L``); at least 1 per row.
    """
    if loss_mask is None:
        return [width] * num_rows
    valid = loss_mask.reshape(num_rows, width) != 0
    pos = torch.arange(1, width + 1).expand(num_rows, width)
    last = torch.where(valid, pos, torch.zeros_like(pos)).amax(dim=1)
    return [max(int(x), 1) for x in last]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: batch rows (in this order) and the length they are padded (or cut) to."""

    rows: tuple[int, ...]
    length: int

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * self.length


@dataclass(frozen=True)
class MicroBatchPlan:
    """Every DP rank's micro-batches (``ranks[d]`` is rank d's list, the same length on every rank).

    ``lengths[i]`` is row i's own length (:func:`row_lengths`); ``budget`` the token budget (None for
    a fixed plan).
    """

    ranks: tuple[tuple[MicroBatch, ...], ...]
    lengths: tuple[int, ...]
    budget: int | None = None

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per DP rank."""
        return len(self.ranks[0]) if self.ranks else 0

    def rank_tokens(self) -> list[int]:
        """Real (unpadded) tokens of each DP rank."""
        return [sum(self.lengths[i] for mb in r for i in mb.rows) for r in self.ranks]

    def padded_tokens(self) -> int:
        return sum(mb.padded_tokens for r in self.ranks for mb in r)

    def padding_fraction(self) -> float:
        """Fraction of all computed positions (over every DP rank) that are padding."""
        padded = self.padded_tokens()
        return 1.0 - sum(self.lengths) / padded if padded else 0.0

    def metrics(self, prefix: str = "perf/") -> dict[str, float]:
        """``padding_fraction``, ``microbatches`` (per DP rank) and ``dp_token_imbalance`` (the busiest
        rank's real tokens over the mean; 1 is balanced)."""
        tokens = self.rank_tokens()
        mean = sum(tokens) / len(tokens) if tokens else 0.0
        return {
            f"{prefix}padding_fraction": self.padding_fraction(),
            f"{prefix}microbatches": float(self.num_microbatches),
            f"{prefix}dp_token_imbalance": max(tokens) / mean if mean else 1.0,
        }


def fixed_plan(lengths: Sequence[int], *, dp: int, micro_batch_size: int, width: int) -> MicroBatchPlan:
    """``micro_batch_size`` sequences per micro-batch, DP rank d the d-th contiguous slice, every
    micro-batch at ``width`` (the batch's padded length)."""
    n = len(lengths)
    if n % (dp * micro_batch_size):
        raise ValueError(
            f"batch of {n} sequences cannot be split into dp={dp} x micro_batch_size={micro_batch_size} "
            f"micro-batches; use a multiple of {dp * micro_batch_size}"
        )
    per_rank = n // dp
    ranks = tuple(
        tuple(
            MicroBatch(tuple(range(lo, lo + micro_batch_size)), width)
            for lo in range(d * per_rank, (d + 1) * per_rank, micro_batch_size)
        )
        for d in range(dp)
    )
    return MicroBatchPlan(ranks, tuple(int(x) for x in lengths))


def _check_fits(lengths: Sequence[int], budget: int, multiple: int) -> None:
    longest = max(lengths)
    if _round_up(longest, multiple) > budget:
        raise ValueError(
            f"a sequence of {longest} tokens (padded {_round_up(longest, multiple)}) does not fit a "
            f"micro-batch budget of {budget} tokens (training.max_tokens_per_microbatch / "
            "max_tokens_per_logprob_microbatch); raise the budget"
        )


def _first_fit_decreasing(
    rows: Sequence[int], lengths: Sequence[int], budget: int, multiple: int
) -> list[list[int]]:
    """``rows`` packed longest first into bins of padded size (count x first row's padded length)
    <= budget."""
    bins: list[list[int]] = []
    cap: list[int] = []  # rows each bin can hold at its (first, longest) row's padded length
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        for b, members in enumerate(bins):
            if len(members) < cap[b]:
                members.append(i)
                break
        else:
            bins.append([i])
            cap.append(budget // _round_up(lengths[i], multiple))
    return bins


def _split_largest(bins: list[list[int]], lengths: Sequence[int], multiple: int) -> bool:
    """Split the bin of the most padded tokens that has two rows or more in two (in place); False
    when every bin holds a single row."""
    cost = [len(b) * _round_up(lengths[b[0]], multiple) if len(b) > 1 else -1 for b in bins]
    k = max(range(len(bins)), key=lambda j: cost[j])
    if cost[k] < 0:
        return False
    rows = bins[k]
    bins[k : k + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return True


def _least_loaded(items: Sequence[tuple[int, list[int]]], dp: int, per_rank: int | None) -> list[list[int]]:
    """``(weight, payload)`` items, heaviest first, each to the DP rank with the least weight so far
    (among ranks holding fewer than ``per_rank`` items when given); returns each rank's payload
    indices."""
    heap = [(0, d) for d in range(dp)]
    out: list[list[int]] = [[] for _ in range(dp)]
    for j in sorted(range(len(items)), key=lambda j: (-items[j][0], j)):
        weight, d = heapq.heappop(heap)
        out[d].append(j)
        if per_rank is None or len(out[d]) < per_rank:
            heapq.heappush(heap, (weight + items[j][0], d))
    return out


def _micro(rows: Sequence[int], lengths: Sequence[int], multiple: int) -> MicroBatch:
    return MicroBatch(tuple(rows), _round_up(max(lengths[i] for i in rows), multiple))


def budget_plan(
    lengths: Sequence[int], *, dp: int, budget: int, multiple: int = 1, count_multiple: int = 1
) -> MicroBatchPlan:
    """Token-budget micro-batches (module doc), dealt to ``dp`` ranks.

    Sequences go to the DP rank with the fewest tokens so far (longest first), each rank packs its
    own first-fit-decreasing, and ranks with fewer micro-batches split their largest ones until all
    have as many. When a rank cannot (it holds too few sequences), the whole batch is packed at once
    and the micro-batches are dealt instead (balanced at micro-batch granularity).

    Args:
        lengths: each row's own length (:func:`row_lengths`).
        dp: data-parallel ranks; every rank gets the same number of micro-batches.
        budget: most padded tokens (rows x padded length) per micro-batch.
        multiple: padded lengths are rounded up to this (the TP size under sequence parallelism).
        count_multiple: micro-batches per rank are a multiple of this (the pipeline size under
            virtual pipelining: Megatron's interleaved schedule runs them in groups of ``pp``).
    Raises:
        ValueError: a sequence longer than the budget, or too few sequences for ``dp`` ranks.
    """
    lens = [int(x) for x in lengths]
    if len(lens) < dp:
        raise ValueError(f"{len(lens)} sequences cannot be shared by dp={dp} ranks")
    _check_fits(lens, budget, multiple)
    per_rank = [
        _first_fit_decreasing(rows, lens, budget, multiple)
        for rows in _least_loaded([(n, [i]) for i, n in enumerate(lens)], dp, None)
    ]
    count = _round_up(max(len(b) for b in per_rank), count_multiple)
    for bins in per_rank:
        while len(bins) < count and _split_largest(bins, lens, multiple):
            pass
    if any(len(b) < count for b in per_rank):
        bins = _first_fit_decreasing(range(len(lens)), lens, budget, multiple)
        while len(bins) % (dp * count_multiple):
            if not _split_largest(bins, lens, multiple):
                unit = dp * count_multiple
                raise ValueError(
                    f"{len(lens)} sequences cannot give dp={dp} ranks the same number of micro-batches "
                    f"(a multiple of {count_multiple} each); use a batch of a multiple of {unit} sequences"
                )
        dealt = _least_loaded([(sum(lens[i] for i in b), b) for b in bins], dp, len(bins) // dp)
        per_rank = [[bins[j] for j in js] for js in dealt]
    ranks = tuple(tuple(_micro(b, lens, multiple) for b in bins) for bins in per_rank)
    return MicroBatchPlan(ranks, tuple(lens), budget)
