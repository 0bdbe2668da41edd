"""AsyncEngine over a fake LLMEngine (no model, milliseconds): delivery, aborts on close, idle
sleep, rejected requests, step failures, shutdown, queue bounds."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing
from types import SimpleNamespace

import pytest

from octavo.config import SchedulerConfig
from octavo.core.sampling_params import SamplingParams
from octavo.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    EngineStepError,
)
from octavo.engine.input_processor import ProcessedPrompt
from octavo.engine.outputs import CompletionOutput, RequestOutput
from octavo.engine.queue_limits import QueueLimits, QueueOverflowError

REJECTED_PROMPT = [666]


class FakeEngine:
    """One token "t" per step per request until max_tokens; aborts report on the next step."""

    num_replicas = 1

    def __init__(self) -> None:
        self.remaining: dict[str, int] = {}
        self.to_report_aborted: list[str] = []
        self.aborted: list[str] = []
        self.num_steps = 0
        self.fail_steps = 0
        self.callers: set[str] = set()
        # As LLMEngine asleep: a step reports aborts only.
        self.sleeping = False
        self.config = SimpleNamespace(
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
        )

    def add_request(
        self, request_id, prompt, params, output_kind, arrival_time, priority=0
    ) -> None:
        self.callers.add(threading.current_thread().name)
        if prompt.prompt_token_ids == REJECTED_PROMPT:
            raise ValueError("prompt token id 666 is out of range for vocab_size 10.")
        self.remaining[request_id] = params.max_tokens

    def abort_request(self, request_ids) -> None:
        for request_id in request_ids:
            if self.remaining.pop(request_id, None) is not None:
                self.aborted.append(request_id)
                self.to_report_aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining or self.to_report_aborted)

    def is_sleeping(self) -> bool:
        return self.sleeping

    def add_stat_logger(self, stat_logger) -> None:
        pass  # it records no stats

    def step(self) -> list[RequestOutput]:
        self.callers.add(threading.current_thread().name)
        self.num_steps += 1
        time.sleep(0.005)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("boom")
        outputs = [_output(r, "", [], "abort") for r in self.to_report_aborted]
        self.to_report_aborted = []
        if self.sleeping:
            return outputs
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            done = self.remaining[request_id] == 0
            if done:
                del self.remaining[request_id]
            outputs.append(_output(request_id, "t", [7], "length" if done else None))
        return outputs


def _output(request_id: str, text: str, token_ids: list[int], finish: str | None):
    completion = CompletionOutput(0, text, token_ids, None, None, finish)
    return RequestOutput(request_id, None, [1, 2], [completion], finish is not None)


def _request(request_id: str, max_tokens: int = 3, prompt: list[int] | None = None, n: int = 1):
    return EngineRequest(
        request_id,
        ProcessedPrompt(None, prompt or [1, 2]),
        SamplingParams(max_tokens=max_tokens, n=n),
        time.monotonic(),
    )


def _run(coro_fn):
    """Run `coro_fn(async_engine, fake)` with a started engine; shut it down after."""
    fake = FakeEngine()

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        try:
            return await coro_fn(engine, fake)
        finally:
            await asyncio.to_thread(engine.shutdown)

    return asyncio.run(main()), fake


async def _collect(engine: AsyncEngine, requests) -> list[tuple[str, str, str | None]]:
    async with aclosing(engine.generate(requests)) as outputs:
        return [
            (o.request_id, o.outputs[0].text, o.outputs[0].finish_reason) async for o in outputs
        ]


def test_outputs_arrive_in_order_and_only_the_engine_thread_calls_the_engine() -> None:
    async def body(engine, fake):
        return await _collect(engine, [_request("a", 2), _request("b", 3)])

    outputs, fake = _run(body)
    assert outputs == [
        ("a", "t", None),
        ("b", "t", None),
        ("a", "t", "length"),
        ("b", "t", None),
        ("b", "t", "length"),
    ]
    assert fake.callers == {"octavo-engine"}


def test_the_thread_sleeps_when_idle() -> None:
    async def body(engine, fake):
        await _collect(engine, [_request("a", 2)])
        steps = fake.num_steps
        await asyncio.sleep(0.3)
        return steps, fake.num_steps

    (before, after), _ = _run(body)
    assert before == after == 2


def test_an_engine_asleep_is_not_stepped_and_runs_what_waited_once_awake() -> None:
    """Regression guard: requests added while the engine sleeps are unfinished, yet stepping
    cannot advance them; the loop must wait for the next command instead of spinning."""

    async def body(engine, fake):
        await engine.call(lambda e: setattr(e, "sleeping", True))
        task = asyncio.create_task(_collect(engine, [_request("a", 1)]))
        await asyncio.sleep(0.3)
        steps_asleep = fake.num_steps
        assert not task.done()
        await engine.call(lambda e: setattr(e, "sleeping", False))
        return steps_asleep, await task

    (steps_asleep, outputs), _ = _run(body)
    assert steps_asleep <= 1
    assert outputs == [("a", "t", "length")]


def test_closing_the_stream_aborts_the_request() -> None:
    async def body(engine, fake):
        async with aclosing(engine.generate([_request("a", 1000)])) as outputs:
            async for _ in outputs:
                break
        deadline = time.monotonic() + 5
        while fake.has_unfinished_requests():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return fake.num_steps

    num_steps, fake = _run(body)
    assert fake.aborted == ["a"] and num_steps < 10


def test_a_rejected_request_raises_and_rejects_its_whole_call() -> None:
    async def body(engine, fake):
        with pytest.raises(ValueError, match="out of range"):
            await _collect(engine, [_request("ok", 5), _request("bad", 5, REJECTED_PROMPT)])
        deadline = time.monotonic() + 5
        while fake.has_unfinished_requests():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return await _collect(engine, [_request("next", 1)])

    outputs, fake = _run(body)
    assert fake.aborted == ["ok"]
    assert outputs == [("next", "t", "length")]


def test_a_failed_step_fails_every_request_and_repeats_kill_the_engine() -> None:
    async def body(engine, fake):
        fake.fail_steps = 1
        results = await asyncio.gather(
            _collect(engine, [_request("a", 5)]),
            _collect(engine, [_request("b", 5)]),
            return_exceptions=True,
        )
        assert all(isinstance(r, EngineStepError) and "boom" in str(r) for r in results)
        assert sorted(fake.aborted) == ["a", "b"]
        # One failure is survivable: the next request runs.
        assert await _collect(engine, [_request("c", 1)]) == [("c", "t", "length")]
        fake.fail_steps = 3
        with pytest.raises(EngineStepError):
            await _collect(engine, [_request("d", 5)])
        # The failed request's abort is flushed by further (failing) steps.
        await asyncio.sleep(0.05)
        assert not engine.is_running and "3 engine steps failed" in engine.dead_reason
        with pytest.raises(EngineDeadError):
            await _collect(engine, [_request("g", 1)])

    _run(body)


def test_shutdown_aborts_in_flight_requests() -> None:
    async def body(engine, fake):
        outputs = []

        async def consume():
            async with aclosing(engine.generate([_request("a", 10_000)])) as stream:
                async for output in stream:
                    outputs.append(output.outputs[0].finish_reason)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)
        await asyncio.to_thread(engine.shutdown)
        await asyncio.wait_for(task, 5)
        with pytest.raises(EngineDeadError):
            await _collect(engine, [_request("b", 1)])
        return outputs

    outputs, fake = _run(body)
    assert outputs[-1] == "abort" and set(outputs[:-1]) == {None}
    assert fake.aborted == ["a"] and not fake.has_unfinished_requests()


def test_from_factory_builds_and_steps_on_one_thread() -> None:
    # The engine is built on the thread that later steps it (one OpenMP team for all of its
    # torch work); nothing steps before start().
    built_on: list[threading.Thread] = []

    def make():
        built_on.append(threading.current_thread())
        return FakeEngine()

    async def main():
        engine = AsyncEngine.from_factory(make)
        assert built_on[0] is not threading.current_thread()
        with pytest.raises(EngineDeadError, match="not been started"):
            await _collect(engine, [_request("early")])
        engine.start()
        try:
            return engine, await _collect(engine, [_request("a", 2)])
        finally:
            await asyncio.to_thread(engine.shutdown)

    engine, outputs = asyncio.run(main())
    assert outputs == [("a", "t", None), ("a", "t", "length")]
    assert engine.engine.callers == {"octavo-engine"} == {built_on[0].name}
    assert not built_on[0].is_alive()


def test_from_factory_reraises_a_failed_build_and_shutdown_before_start_returns() -> None:
    def broken():
        raise RuntimeError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        AsyncEngine.from_factory(broken)
    engine = AsyncEngine.from_factory(FakeEngine)
    engine.shutdown(timeout_s=5)
    assert not engine.is_running and engine.dead_reason == "shut down"


def test_queue_bounds_reject_at_once_and_free_their_room_when_requests_end() -> None:
    """vLLM's rules: --max-num-queued-reqs holds with the new request counted (n > 1 counts n);
    --max-num-queued-tokens rejects once the prompts not yet prefilled reach it. The engine
    is asleep at first, so no request gets past its prompt until it wakes."""

    async def body(engine: AsyncEngine, fake: FakeEngine):
        engine.queue_limits = QueueLimits(max_num_queued_reqs=3, max_num_queued_tokens=3)
        await engine.call(lambda e: setattr(e, "sleeping", True))
        first = engine.generate([_request("a", prompt=[1, 2])])
        second = engine.generate([_request("b", prompt=[1, 2])])
        pending = [asyncio.create_task(anext(first)), asyncio.create_task(anext(second))]
        await asyncio.sleep(0)
        # 2 requests, 4 prompt tokens waiting: one token past the bound.
        assert (engine.queue_limits.num_reqs, engine.queue_limits.num_prefill_tokens) == (2, 4)
        with pytest.raises(QueueOverflowError, match="--max-num-queued-tokens"):
            await _collect(engine, [_request("c", prompt=[1])])
        engine.queue_limits.max_num_queued_tokens = None
        with pytest.raises(QueueOverflowError, match="--max-num-queued-reqs"):
            await _collect(engine, [_request("d", n=2)])
        with pytest.raises(QueueOverflowError, match="--max-num-queued-reqs"):
            engine.check_admission([_request("d", n=2)])
        engine.check_admission([_request("e")])
        # The rejected ones never reached the engine (commands run in order).
        assert await engine.call(lambda e: set(e.remaining)) == {"a", "b"}
        # Awake: the first outputs end both prompts' prefill, the last ones free the slots.
        await engine.call(lambda e: setattr(e, "sleeping", False))
        await asyncio.gather(*pending)
        assert engine.queue_limits.num_prefill_tokens == 0
        assert engine.queue_limits.num_reqs == 2
        for outputs in (first, second):
            async for _ in outputs:
                pass
        assert (engine.queue_limits.num_reqs, engine.queue_limits.num_prefill_tokens) == (0, 0)
        engine.queue_limits.max_num_queued_tokens = 1
        return await _collect(engine, [_request("f", max_tokens=1, n=3, prompt=[1, 2, 3])])

    outputs, _ = _run(body)
    assert outputs == [("f", "t", "length")]


def test_a_closed_or_failed_call_gives_its_room_back() -> None:
    async def body(engine: AsyncEngine, fake: FakeEngine):
        engine.queue_limits = QueueLimits(max_num_queued_reqs=1)
        async with aclosing(engine.generate([_request("a", max_tokens=50)])) as outputs:
            await anext(outputs)
            assert engine.queue_limits.num_reqs == 1
        assert engine.queue_limits.num_reqs == 0
        with pytest.raises(ValueError, match="666"):
            await _collect(engine, [_request("b", prompt=REJECTED_PROMPT)])
        assert (engine.queue_limits.num_reqs, engine.queue_limits.num_prefill_tokens) == (0, 0)
        return await _collect(engine, [_request("c", max_tokens=1)])

    outputs, _ = _run(body)
    assert outputs == [("c", "t", "length")]
