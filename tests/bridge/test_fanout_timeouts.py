"""The rollout fan-out under slow servers (issue #25): a request that times out on a server that still
answers is sent again, not the end of the run; requests wait for a free slot before their clock
starts, never more than ``max_in_flight`` per server in flight (stand-in clients); a request is timed
by its server's progress, not by the time it waits in the server's queue (stand-ins, and a real CPU
server whose queue is deep)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_bridge.client import SGLangClient
from sglang_bridge.fanout import MAX_TIMEOUTS, FanOutResult, fan_out
from sglang_bridge.progress import ServerProgress
from sglang_bridge.samples import Sample, SamplingParams
from sglang_bridge.server import ServerSpec, SGLangServer


class SlowClient:
    """A server whose requests time out the first ``timeouts`` times (then answer), and which
    answers its health check while ``alive``; counts the requests it holds at once."""

    def __init__(self, url: str, timeouts: int = 0, alive: bool = True) -> None:
        self.url, self.timeouts, self.alive = url, timeouts, alive
        self.in_flight = self.most_in_flight = self.calls = 0

    async def generate_group(self, prompt: list[int], params: SamplingParams, n: int) -> list[Sample]:
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.001)
            if self.timeouts > 0:
                self.timeouts -= 1
                raise TimeoutError(f"SGLang server {self.url}/generate did not answer within the timeout")
            return [
                Sample(list(prompt), [1, 2], [-0.1, -0.2], "stop", "v0", server=self.url) for _ in range(n)
            ]
        finally:
            self.in_flight -= 1

    async def health(self) -> bool:
        return self.alive


def _run(clients: list[SlowClient], prompts: int = 6, **kw):
    return asyncio.run(fan_out(clients, [[7, i] for i in range(prompts)], SamplingParams(), 4, **kw))


def test_a_timeout_on_a_live_server_is_retried_and_no_group_is_lost() -> None:
    slow = SlowClient("http://a", timeouts=3)
    result = _run([slow], max_in_flight=2)
    assert [len(g) for g in result.groups] == [4] * 6
    assert result.timeouts == 3 and result.requeued == 3
    assert slow.most_in_flight <= 2  # concurrency bound: the rest waited for a slot, unclocked


def test_a_timeout_on_a_server_that_does_not_answer_moves_its_groups_to_the_others() -> None:
    hung, ok = SlowClient("http://hung", timeouts=100, alive=False), SlowClient("http://ok")
    result = _run([hung, ok], max_in_flight=1)
    assert [len(g) for g in result.groups] == [4] * 6
    assert result.stats[0].failed.startswith("TimeoutError (and no answer to a health check)")
    assert result.timeouts == 0 and result.requeued == 1


def test_a_request_that_keeps_timing_out_ends_with_the_fix() -> None:
    with pytest.raises(
        TimeoutError, match=rf"timed out {MAX_TIMEOUTS + 1} times on live servers.*request_timeout_s"
    ):
        _run([SlowClient("http://a", timeouts=100)], prompts=1)


# ------------------------------------------------------------------------------------------------
# The clock of a /generate request: its server's progress (sglang_bridge.progress)
# ------------------------------------------------------------------------------------------------


class QueueServer:
    """A stand-in server that serves one request at a time (the rest wait in its queue), each in
    ``service_s``; ``hung`` ones never answer."""

    def __init__(self, service_s: float, hung: bool = False) -> None:
        self.service_s, self.hung = service_s, hung
        self.lock = asyncio.Lock()
        self.cancelled = 0

    async def serve(self, i: int) -> int:
        try:
            async with self.lock:
                await asyncio.sleep(3600 if self.hung else self.service_s)
            return i
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def test_a_request_queued_behind_others_is_timed_from_its_servers_progress() -> None:
    """40 requests at once, served one by one in a tenth of the timeout each: the last waits four
    timeouts in the queue, and none times out, because the server finishes one every tenth."""
    server, progress = QueueServer(service_s=0.05), ServerProgress(timeout_s=0.5)

    async def go() -> list[int]:
        return list(await asyncio.gather(*(progress.wait(server.serve(i)) for i in range(40))))

    assert asyncio.run(go()) == list(range(40))


def test_a_server_that_finishes_nothing_times_its_requests_out_and_they_are_cancelled() -> None:
    server, progress = QueueServer(service_s=0.0, hung=True), ServerProgress(timeout_s=0.2)

    async def go() -> list[object]:
        return list(
            await asyncio.gather(*(progress.wait(server.serve(i)) for i in range(3)), return_exceptions=True)
        )

    got = asyncio.run(go())
    assert all(isinstance(e, TimeoutError) and "finished no request for 0.2 s" in str(e) for e in got)
    assert server.cancelled == 3  # nothing is left running in the client


def test_a_request_sent_to_an_idle_server_is_timed_from_when_it_was_sent() -> None:
    """Progress long ago does not time a new request out at once: its clock starts when sent."""
    now = [1000.0]
    progress = ServerProgress(timeout_s=5.0, clock=lambda: now[0])
    progress.last = 10.0  # the server's last answer, long before
    assert progress.deadline(sent=now[0]) == 1005.0
    progress.last = 1003.0  # an answer after it was sent moves its deadline
    assert progress.deadline(sent=1000.0) == 1008.0


# ------------------------------------------------------------------------------------------------
# A real server with a deep queue
# ------------------------------------------------------------------------------------------------

TIMEOUT_S = 4.0
"""The rollout's request timeout here: many times what the server takes to finish its next request
(0.1-0.2 s apart on a quiet machine; a loaded one stalls it for seconds), below the rollout's
length (about 2 timeouts on a quiet machine, more on a loaded one)."""


@pytest.fixture(scope="module")
def narrow_server(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """A CPU server that runs two requests at a time (``--max-running-requests 2``), so that most of
    a rollout's requests wait in its queue, as on a server whose batch is full."""
    spec = ServerSpec(model_path=str(tiny_ckpt), device="cpu", extra_args=("--max-running-requests", "2"))
    with SGLangServer(spec, tmp_path_factory.mktemp("narrow") / "sglang.log", startup_timeout_s=300) as srv:

        async def warm_up() -> None:  # its first forward passes (skipped warm-up) are not what is tested
            async with SGLangClient(srv.url) as c:
                await c.generate_group([7, 17, 42], SamplingParams(max_new_tokens=16, ignore_eos=True), 2)

        asyncio.run(warm_up())
        yield srv


class Overdue(SGLangClient):
    """A client that counts the requests still unanswered ``TIMEOUT_S`` after they were sent: the
    ones a timeout on a request's age (the clock before issue #25's fix) would have failed."""

    overdue = 0

    async def generate_group(self, *args: object, **kw: object) -> list[Sample]:
        task = asyncio.ensure_future(super().generate_group(*args, **kw))  # type: ignore[arg-type]
        done, _ = await asyncio.wait({task}, timeout=TIMEOUT_S)
        self.overdue += not done
        return await task


REQUESTS = 384


@pytest.mark.slow  # 384 requests through a 2-slot server (~50 s)
def test_a_rollout_far_longer_than_the_timeout_returns_every_sample_from_a_real_server(
    narrow_server: SGLangServer,
) -> None:
    """384 requests in flight at once on a server that serves two at a time: the rollout lasts several
    timeouts and many requests wait longer than one in the server's queue, but each is served within
    one. Timed by their age those would time out; timed by the server's progress every sample comes
    back, and none timed out."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[7 + i % 50, 17, 42, 99, 3 + i % 5] for i in range(REQUESTS)]

    async def go() -> tuple[FanOutResult, int]:
        async with Overdue(narrow_server.url, timeout_s=TIMEOUT_S, max_concurrency=REQUESTS) as c:
            return await fan_out([c], prompts, params, 1, max_in_flight=REQUESTS), c.overdue

    result, overdue = asyncio.run(go())
    assert [len(g) for g in result.groups] == [1] * REQUESTS
    assert all(len(g[0].output_ids) == 8 for g in result.groups)
    assert result.timeouts == 0 and result.requeued == 0
    # Requests still unanswered one timeout after they were sent came back: an age clock would have
    # failed them. How many depends on the machine's speed (189 of 384 on a quiet 2-core VM, most on a
    # loaded one), so the test asks for some, not for a share.
    assert overdue > 0
