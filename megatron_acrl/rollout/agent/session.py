"""The agent session: multi-turn generation on the servers with the token bookkeeping done for the agent.

An agent (:mod:`megatron_acrl.rollout.agent.loop`) only sees chat messages and text::

    text = await session.generate(messages)      # the opening conversation (system, user)
    text = await session.generate(observation)   # then only the messages to append (tool results)

The session keeps the trajectory token-in-token-out: the opening conversation is rendered with the
chat template and tokenized once; each turn sends the token ids so far to the servers
(:meth:`~megatron_acrl.rollout.backend.RolloutBackend.generate_async`, pinned to one server by the
trajectory's id) and appends exactly the ids the server generated, with their log-probs and weight
versions; an observation is tokenized as a suffix against the template
(:func:`~megatron_acrl.rollout.agent.templates.observation_suffix`) and appended with no log-prob,
version -1, turn -1 and loss 0. Nothing generated is ever decoded and re-encoded into the sequence.

Limits end a trajectory by raising :class:`TrajectoryEnd` from :meth:`AgentSession.generate`
(``max_turns``, ``max_tokens``); the agent loop records the reason.

The affinity pin lives as long as the trajectory: every turn goes to the server its first turn went
to, and :meth:`AgentSession.close` (the agent loop calls it however the trajectory ends: finished,
truncated, stale, its agent or its server failed, cancelled) has the backend forget the key
(``unpin``), so the dispatch's pin table holds only the trajectories in flight.

In ``rollout.mode: async`` the generation engine (:mod:`megatron_acrl.rollout.engine`) runs the
sessions through a backend of its own that holds each turn while the engine is held (an evaluation,
a draining weight update) and marks the session :attr:`~AgentSession.stale` when its oldest
generated token can no longer be trained within ``rollout.max_staleness``: that turn and every later
one end the trajectory (``stale``), which the engine then generates again. A turn the servers abort
(``pause_mode: abort``) is sent again from the same ids, its partial output dropped
(``abort_retries`` times at most).

MoE routing (R3) across turns: each turn's answer carries the routing of every position it covers
(``[P_k + O_k - 1, layers, k]``), but a prefix the server took from its radix cache was computed by an
earlier turn; the session keeps, for every position, the record of the turn that first computed it
(the earlier turns' record for the prefix, this turn's for the positions it added), and counts the
prefix positions where a later answer disagreed (a prefix recomputed after a cache flush:
``Trajectory.expert_prefix_recomputed``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_acrl.rollout.agent.templates import ChatTemplate, Message, Tokenizer, observation_suffix


class TrajectoryEnd(Exception):
    """A limit ended the trajectory: ``reason`` (``max_turns``, ``max_tokens``) is recorded."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.reward = 0.0  # what the env gave before the limit (the agent loop sets it)
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass
class Trajectory:
    """One finished trajectory. ``prompt_ids`` is the opening prompt (P ids); the per-token lists
    cover the ``O`` ids after it (generated turns and the observation/boundary ids between them):

    ``output_ids`` [O] ids, ``generated`` [O] 1 where the server generated the id, ``logprobs`` [O]
    the server's log mu there (0.0 elsewhere), ``version_spans`` per turn ``(offset in output_ids,
    ids, final version, version segments)`` as the server reported them (the batch turns them into
    per-token versions, -1 elsewhere: :func:`megatron_acrl.rollout.phase.trajectory_versions`),
    ``turn_ids`` [O] the turn that generated it (-1 elsewhere), ``kinds`` [O] ``generated`` /
    ``observation`` / ``boundary``. ``routed_experts`` ``[P + O - 1, layers, k]``: each position's
    routing as the turn that first computed it recorded it (module doc), or None.
    """

    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_spans: list[tuple[int, int, str, list]] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    routed_experts: Any = None
    weight_version: str = ""
    turns: int = 0
    reward: float = 0.0
    reason: str = "answered"
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    texts: list[str] = field(default_factory=list)
    """The text of each generated turn (logs only)."""
    expert_prefix_recomputed: int = 0
    """Prefix positions whose routing a later turn's answer reported differently (module doc)."""
    aborted_turns: int = 0
    """Turns the servers aborted and the session sent again."""

    @property
    def truncated(self) -> bool:
        return self.reason in ("max_turns", "max_tokens")


class AgentSession:
    """Generates the turns of one trajectory (module doc). ``backend`` is the
    :class:`~megatron_acrl.rollout.backend.RolloutBackend`; ``params`` the run's sampling;
    ``affinity`` the trajectory's id (every turn to the same server)."""

    def __init__(
        self,
        backend: Any,
        params: Any,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        *,
        max_turns: int,
        max_tokens: int,
        affinity: str | None = None,
        tools: Sequence[dict] | None = None,
        env: Any = None,
        abort_retries: int = 0,
    ):
        self.backend, self.params, self.tokenizer, self.template = backend, params, tokenizer, template
        self.max_turns, self.max_tokens, self.affinity = max_turns, max_tokens, affinity
        self.tools = list(tools) if tools else None
        self.env = env
        self.abort_retries = abort_retries
        self.stale = False
        """Set by the async engine: the trajectory is too stale to train; every later turn ends it."""
        self.traj = Trajectory()
        self.history: list[Message] = []
        # A turn ends on the template's end-of-turn token (ChatML's <|im_end|>) as well as on the
        # model's EOS: the server stops there, so the turn's ids close it themselves.
        eot = list(tokenizer.encode(template.end_of_turn))
        self._stop = tuple(eot) if len(eot) == 1 else ()
        self._last_text: str | None = None
        self._last_closed = True

    def close(self) -> None:
        """The trajectory ended (module doc): drop its affinity pin, so that the backend's pin table
        does not grow with every trajectory of a run. A backend without pins (no ``unpin``) keeps
        none; a second call does nothing."""
        key, self.affinity = self.affinity, None
        unpin = getattr(self.backend, "unpin", None)
        if key is not None and unpin is not None:
            unpin(key)

    @property
    def last_turn_closed(self) -> bool:
        """Whether the last generated turn ended on the end-of-turn string (not cut by a limit)."""
        return self._last_closed

    @property
    def length(self) -> int:
        return len(self.traj.prompt_ids) + len(self.traj.output_ids)

    def _append(self, ids: Sequence[int], kinds: Sequence[str]) -> None:
        t = self.traj
        t.output_ids += ids
        t.generated += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)
        t.turn_ids += [-1] * len(ids)
        t.kinds += kinds

    def _extend(self, messages: Sequence[Message]) -> None:
        """Render the opening conversation (first call) or append ``messages`` as a suffix."""
        if self._last_text is None:
            if self.traj.prompt_ids:
                raise RuntimeError("generate() after the opening with no new turn generated")
            text = self.template.render(messages, tools=self.tools, add_generation_prompt=True)
            self.traj.prompt_ids = list(self.tokenizer.encode(text))
        else:
            suffix = observation_suffix(
                self.template,
                self.tokenizer,
                self.history,
                self._last_text,
                messages,
                tools=self.tools,
                stopped_on_end_of_turn=self._last_closed,
            )
            self.history.append({"role": "assistant", "content": self._last_text})
            self._append(suffix.ids, suffix.kinds)
        self.history += list(messages)

    async def generate(self, messages: Sequence[Message]) -> str:
        """The model's next turn, as text without its end-of-turn string. First call: the whole
        opening conversation; later calls: only the messages to append. Raises
        :class:`TrajectoryEnd` at ``max_turns`` or ``max_tokens`` (and ``stale`` in async mode)."""
        self._check_stale()
        if self.traj.turns >= self.max_turns:
            raise TrajectoryEnd("max_turns", f"{self.traj.turns} turns taken")
        self._extend(messages)
        room = self.max_tokens - self.length
        if room <= 0:
            raise TrajectoryEnd("max_tokens", f"{self.length} tokens >= {self.max_tokens}")
        stop = tuple(dict.fromkeys((*self.params.stop_token_ids, *self._stop)))
        params = dataclasses.replace(
            self.params, max_new_tokens=min(self.params.max_new_tokens, room), stop_token_ids=stop
        )
        ids = [*self.traj.prompt_ids, *self.traj.output_ids]
        sample = await self._request(ids, params)
        out = list(sample.output_ids)
        t = self.traj
        turn = t.turns
        t.output_ids += out
        t.generated += [1] * len(out)
        t.logprobs += [float(x) for x in sample.rollout_logprobs]
        t.version_spans.append(
            (
                len(t.output_ids) - len(out),
                len(out),
                str(sample.weight_version),
                list(sample.weight_versions or []),
            )
        )
        t.turn_ids += [turn] * len(out)
        t.kinds += ["generated"] * len(out)
        t.turns += 1
        t.weight_version = str(sample.weight_version)
        self._merge_experts(getattr(sample, "routed_experts", None))
        text = self.tokenizer_decode(out)
        eot = self.template.end_of_turn
        self._last_closed = text.endswith(eot)
        text = text[: -len(eot)] if self._last_closed else text
        self._last_text = text
        t.texts.append(text)
        if sample.finish_reason == "abort":
            raise TrajectoryEnd("error", "generation aborted by a pause")
        if sample.finish_reason == "length" and self.length >= self.max_tokens:
            raise TrajectoryEnd("max_tokens", f"turn {turn} reached {self.max_tokens} tokens")
        return text

    def _check_stale(self) -> None:
        if self.stale:
            raise TrajectoryEnd("stale", "its oldest generated token is older than rollout.max_staleness")

    async def _request(self, ids: list[int], params: Any) -> Any:
        """One turn's sample; a turn the servers abort (a weight update with ``pause_mode: abort``)
        is sent again from the same ids, its partial output dropped, up to ``abort_retries`` times."""
        for _ in range(self.abort_retries):
            (sample,) = await self.backend.generate_async([ids], params, affinity=self.affinity)
            if sample.finish_reason != "abort":
                return sample
            self.traj.aborted_turns += 1
        (sample,) = await self.backend.generate_async([ids], params, affinity=self.affinity)
        return sample

    def _merge_experts(self, experts: Any) -> None:
        """Keep each position's routing from the turn that first computed it (module doc):
        ``experts`` ``[P_k + O_k - 1, layers, k]`` covers the prefix this trajectory already holds
        (``[n, layers, k]``, n = its previous length - 1) and the positions this turn added."""
        t = self.traj
        if experts is None:
            return
        if t.routed_experts is None:
            t.routed_experts = experts
            return
        held = np.asarray(t.routed_experts)
        new = np.asarray(experts)
        n = min(len(held), len(new))
        differs = (new[:n] != held[:n]).reshape(n, -1).any(axis=1)
        t.expert_prefix_recomputed += int(differs.sum())
        t.routed_experts = np.concatenate([held[:n], new[n:]])

    def tokenizer_decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids, special tokens kept (the end-of-turn string is looked for)."""
        decode = getattr(self.tokenizer, "decode", None)
        if decode is None:
            raise TypeError("the agent session's tokenizer needs decode() to show the model's turn")
        return str(decode(list(ids), skip_special_tokens=False))

    async def step_env(self, env: Any, text: str) -> Any:
        """``env.step(text)``, timed into ``env_s`` and its tool counts recorded."""
        t0 = time.perf_counter()
        try:
            step = await env.step(text)
        finally:
            self.traj.env_s += time.perf_counter() - t0
        self.traj.tool_calls += int(step.info.get("tool_calls", 0))
        self.traj.tool_errors += int(step.info.get("tool_errors", 0))
        return step
