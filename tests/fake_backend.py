"""An in-memory rollout backend for fast unit tests of the rollout layer (no server, no torchrun).

:class:`FakeBackend` implements :class:`megatron_acrl.rollout.backend.RolloutBackend` and the
weight-update half :class:`megatron_acrl.servers.publisher.WeightPublisher` calls
(``update_weights``, ``recover``), so a real :class:`RunContext` with it as ``ctx.servers`` (and a
real :class:`~megatron_acrl.servers.publisher.WeightPublisher` over it) runs the
producer, the rollout phase and the generation engine as a run would:

* deterministic samples: ``answer(prompt_ids, k)`` gives sample k's text tokens (default: the right
  sum of an addition prompt for even k, a wrong one for odd k), then EOS; log-probs
  ``-0.01 * (position + 1)``;
  :func:`calculator_answer` answers multi-turn (agent) requests: a tool call, then an answer;
* latency: ``token_delay_s`` per generated token (0: as fast as the event loop goes);
* weight updates pause the requests in flight (``pause_mode: retract``: they continue on the new
  version, and their samples carry two version segments; ``abort``: they end with
  ``finish_reason == "abort"``);
* faults, injected per request (:meth:`FakeBackend.fail_next`): ``"gone"`` (the server dies after
  the request's first token: ``ServerGoneError``, :meth:`dead_servers` names it until
  :meth:`restart`), ``"timeout"`` (``TimeoutError``, the server lives on), ``"hang"`` (the server
  hangs: its process runs, every request times out until it is replaced) or ``"refused"`` (the
  server refuses the request, HTTP 400: the request's own fault); :meth:`kill` kills it at once,
  failing every request in flight. :meth:`recover_rollout` repairs as the real one does: a dead
  server restarted, a hung one replaced (``hung_restarts``), nothing found wrong with a refusal.

:func:`make_ctx` builds the :class:`RunContext` the tests use: a real config, task and prompt
stream, a character tokenizer, a stub policy and the fake backend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_acrl.batch.staleness import format_version
from megatron_acrl.config import load_config
from megatron_acrl.run.context import RunContext, prompt_stream
from megatron_acrl.servers.publisher import WeightPublisher
from megatron_acrl.tasks import make_task
from sglang_bridge.samples import Sample, SamplingParams
from sglang_bridge.transport import ServerGoneError, SGLangHTTPError

EOS = 1
PAD = 0


class CharTokenizer:
    """One token per character (its code point); 0 pads, 1 is EOS."""

    eos_token_id = EOS
    pad_token_id = PAD

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > EOS)


def addition_answer(prompt_ids: Sequence[int], k: int) -> list[int]:
    """Sample ``k`` of an addition prompt ``"a+b="``: the sum when k is even, the sum + 1 when odd."""
    a, b = CharTokenizer().decode(prompt_ids).rstrip("=").split("+")
    return CharTokenizer().encode(str(int(a) + int(b) + k % 2))


def calculator_answer(prompt_ids: Sequence[int], k: int) -> list[int]:
    """A multi-turn sample on a calculator conversation (ChatML text): the first turn calls the
    calculator on the user's ``a+b=``; once a tool result is in the conversation, the answer is that
    result (+ 1 when k is odd). Each turn ends with ``<|im_end|>`` (then the fake's EOS)."""
    tok = CharTokenizer()
    text = tok.decode(prompt_ids)
    if "<|im_start|>tool\n" in text:
        result = int(text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0])
        return tok.encode(f"The answer is {result + k % 2}<|im_end|>")
    question = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0].rstrip("=")
    call = json.dumps({"name": "calculator", "arguments": {"expression": question}})
    return tok.encode(f"<tool_call>{call}</tool_call><|im_end|>")


class FakeBackend:
    """The rollout backend of the unit tests (module doc); ``url`` names its one server."""

    def __init__(
        self,
        answer: Callable[[Sequence[int], int], list[int]] = addition_answer,
        *,
        token_delay_s: float = 0.0,
        pause_mode: str = "retract",
        url: str = "fake://0",
        pause_at_token: int | None = None,
        max_new_tokens: int = 8,
    ):
        self.answer = answer
        self.max_new_tokens = max_new_tokens
        self.affinities: list[str | None] = []
        """The affinity key of every :meth:`generate_async` request, in order."""
        self.unpinned: list[str] = []
        """The keys :meth:`unpin` forgot, in order (a trajectory's, when it ended)."""
        self.token_delay_s = token_delay_s
        self.pause_mode = pause_mode
        self.url = url
        self.version = format_version(0)
        self.restarts = 0
        self.hung_restarts = 0
        self.router_restarts = 0
        self.hung = False
        self.updates: list[str] = []
        """Every version pushed, in order."""
        self.requests: list[list[list[int]]] = []
        """Every request's prompts, in the order sent."""
        self.faults: list[str] = []
        """Faults of the next requests, in order (``"gone"``, ``"timeout"``, ``""`` for none)."""
        self.pauses = 0
        self.aborted = 0
        """Samples ended by an ``abort`` pause."""
        self.pause_at_token = pause_at_token
        """The first sample to reach this output token pauses the server (:attr:`paused_midway` is
        set): a test then pushes weights with requests half done, and the push continues them."""
        self.paused_midway = threading.Event()
        self.dead = False
        self._running = threading.Event()
        self._running.set()
        self._abort_epoch = 0
        self._lock = threading.Lock()
        self._in_flight = 0
        self._counter = 0  # sample index per prompt: distinct samples of one prompt in a group

    # -- faults ----------------------------------------------------------------------------------

    def fail_next(self, *faults: str) -> None:
        """The next requests fail so, in order (module doc)."""
        self.faults.extend(faults)

    def kill(self) -> None:
        """The server dies now: every request in flight fails at its next token."""
        self.dead = True

    # -- the RolloutBackend ------------------------------------------------------------------------

    def sampling_params(self, *, greedy: bool = False, seed: int | None = None) -> SamplingParams:
        temperature = 0.0 if greedy else 1.0
        return SamplingParams(temperature=temperature, max_new_tokens=self.max_new_tokens, seed=seed)

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        async def run() -> list[list[Sample]]:
            self._count(len(prompt_ids) * n)
            self.requests.append([list(p) for p in prompt_ids])
            fault = self.faults.pop(0) if self.faults else ""
            try:
                flat = await asyncio.gather(
                    *(
                        self._sample(p, k, params, fault if i == 0 else "")
                        for i, p in enumerate(prompt_ids)
                        for k in range(n)
                    )
                )
            finally:
                self._count(-len(prompt_ids) * n)
            return [list(flat[i * n : (i + 1) * n]) for i in range(len(prompt_ids))]

        return asyncio.run(run())

    def generate_async(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, affinity: str | None = None
    ) -> asyncio.Future[list[Sample]]:
        prompts = [list(p) for p in prompt_ids]
        self.affinities.append(affinity)
        self.requests.append(prompts)
        self._count(len(prompts))
        fault = self.faults.pop(0) if self.faults else ""

        async def run() -> list[Sample]:
            return list(
                await asyncio.gather(
                    *(
                        self._sample(p, self._next_k(), params, fault if i == 0 else "")
                        for i, p in enumerate(prompts)
                    )
                )
            )

        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda _t: self._count(-len(prompts)))
        return task

    def unpin(self, affinity: str) -> None:
        self.unpinned.append(affinity)

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return {self.url: self._in_flight}

    async def aclose(self) -> None:
        pass

    def pause(self, mode: str = "retract") -> None:
        self.pauses += 1
        if mode == "abort":
            self._abort_epoch += 1
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def dead_servers(self) -> list[int]:
        return [0] if self.dead else []

    def restart(self) -> None:
        self.dead = self.hung = False
        self.restarts += 1

    def recover_rollout(self, error: BaseException) -> str | None:
        if self.dead:
            self.restart()
            return "server(s) fake exited; restarted"
        if self.hung:
            self.hung_restarts += 1
            self.restart()
            return "server(s) hung (fake: no answer); killed and replaced"
        if isinstance(error, ServerGoneError | TimeoutError):
            self.restart()
            return "no server found dead or hung; restarted every server"
        return None

    def load_metrics(self) -> dict[str, float]:
        return {"rollout/requeued": 0.0}

    def score(self, sequences: Sequence[Sequence[int]], target_lens: Sequence[int]) -> list[list[float]]:
        return [[-0.5] * k for k in target_lens]

    # -- what RunContext.push_weights calls ----------------------------------------------------------

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str, **_: Any
    ) -> dict[str, float]:
        """Pause the requests in flight (``pause_mode``), take the weights, serve ``version``, continue."""
        if self.dead:
            self.restart()
        self.pause(self.pause_mode)
        try:
            for _name, _t in named_tensors:
                pass
            self.version = version
            self.updates.append(version)
        finally:
            self.resume()
        return {"sync/seconds": 0.0}

    def recover(self, action: str, attempt: int = 0) -> None:
        self.restart()

    def close(self) -> None:
        pass

    # -- generation ------------------------------------------------------------------------------

    def _count(self, k: int) -> None:
        with self._lock:
            self._in_flight += k

    def _next_k(self) -> int:
        with self._lock:
            self._counter += 1
            return self._counter - 1

    async def _sample(self, prompt: Sequence[int], k: int, params: SamplingParams, fault: str) -> Sample:
        """Generate ``answer(prompt, k)`` + EOS token by token, pausing while a weight update runs."""
        text = self.answer(prompt, k)
        tokens = [*text, EOS] if len(text) < params.max_new_tokens else text[: params.max_new_tokens]
        epoch = self._abort_epoch
        out: list[int] = []
        versions: list[str] = []
        for j, tok in enumerate(tokens):
            await asyncio.sleep(self.token_delay_s)
            while not self._running.is_set():
                await asyncio.sleep(0.001)
            if self._abort_epoch != epoch:
                self.aborted += 1
                return self._make(prompt, out, versions, "abort")
            if self.dead or (fault == "gone" and j == 1):
                self.dead = True
                raise ServerGoneError(f"fake server {self.url} is gone")
            if fault == "hang" or self.hung:
                self.hung = True
                raise TimeoutError(f"the server finished no request for 5 s ({self.url}, hung)")
            if fault == "timeout":
                raise TimeoutError(f"fake server {self.url}/generate did not answer within the timeout")
            if fault == "refused":
                raise SGLangHTTPError(self.url, "/generate", 400, "the prompt is too long")
            out.append(tok)
            versions.append(self.version)
            if j + 1 == self.pause_at_token and not self.paused_midway.is_set():
                self.pause()
                self.paused_midway.set()
        return self._make(prompt, out, versions, "stop" if out and out[-1] == EOS else "length")

    def _make(self, prompt: Sequence[int], out: list[int], versions: list[str], finish: str) -> Sample:
        segments: list[dict[str, Any]] = []
        for j, v in enumerate(versions):
            if segments and segments[-1]["version"] == v:
                segments[-1]["end"] = j + 1
            else:
                segments.append({"version": v, "start": j, "end": j + 1})
        return Sample(
            prompt_ids=list(prompt),
            output_ids=out,
            rollout_logprobs=[-0.01 * (j + 1) for j in range(len(out))],
            finish_reason=finish,
            weight_version=self.version,
            weight_versions=segments,
            server=self.url,
        )


class StubPolicy:
    """The weights a push streams: one tensor, whatever the layout."""

    def hf_weights(self, all_stages: bool = True) -> Iterable[tuple[str, torch.Tensor]]:
        return iter([("w", torch.zeros(2))])

    def hf_source_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.hf_weights()

    def hf_source_meta(self) -> dict[str, Any]:
        return {}


def make_ctx(
    backend: Any, overrides: Sequence[str] = (), run_dir: Path | None = None, tokenizer: Any = None
) -> RunContext:
    """A rank-0, one-process :class:`RunContext` of 1-digit addition with ``backend`` as its servers."""
    cfg = load_config(
        None,
        [
            "task.num_digits=1",
            "task.heldout_fraction=0",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_prompt_len=8",
            "rollout.max_new_tokens=8",
            "rollout.quantization=none",
            "rollout.samples_per_request=2",
            "logging.wandb_mode=disabled",
            *overrides,
        ],
    )
    task = make_task(cfg.task)
    ctx = RunContext(
        cfg=cfg,
        args=argparse.Namespace(load_rollouts=None, save_rollouts=None),
        rank=0,
        world=1,
        run_dir=run_dir or Path("unused-run-dir"),
        model_dir=Path("unused-model-dir"),
        tokenizer=tokenizer or CharTokenizer(),
        task=task,
        policy=StubPolicy(),  # type: ignore[arg-type]
        servers=backend,
        prompt_stream=prompt_stream(task, cfg.training.seed),
    )
    ctx.publisher = WeightPublisher(cfg, 0, ctx.policy, backend, stopping=ctx.stopping)
    return ctx
