"""The rollout fan-out under slow servers (issue #25): a request that times out on a server that still
answers is sent again, not the end of the run; requests wait for a free slot before their clock
starts, never more than ``max_in_flight`` per server in flight. Stand-in clients, no server."""

from __future__ import annotations

import asyncio

import pytest

from sglang_bridge.fanout import MAX_TIMEOUTS, fan_out
from sglang_bridge.samples import Sample, SamplingParams


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
