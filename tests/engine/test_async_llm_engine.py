"""AsyncLLMEngine (vLLM's asyncio interface) on a tiny random Llama: concurrent requests run
batched and give LLM.generate's greedy tokens; output kinds; abort, early close and a bad
request each end only their own request and free its blocks; shutdown is reported."""

from __future__ import annotations

import asyncio

import pytest

from octavo import LLM, SamplingParams
from octavo.engine.arg_utils import AsyncEngineArgs
from octavo.engine.async_engine import EngineDeadError
from octavo.engine.async_llm_engine import AsyncLLMEngine
from octavo.inputs import TextPrompt, TokensPrompt
from octavo.sampling_params import RequestOutputKind

from ..model.test_families_engine import _save_tokenizer
from ..model.tiny import save_tiny_checkpoint

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
SETTINGS = dict(dtype="float32", kv_cache_tokens=512, block_size=4, max_model_len=64)
PROMPT_IDS = [[5, 17, 33, 90], [200, 3, 45, 46, 47, 120, 7]]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_checkpoint(folder, "llama", seed=5)
    _save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def engine(model_folder):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(model_folder), **SETTINGS))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLMEngine, prompt, params: SamplingParams, request_id: str):
    return [output async for output in engine.generate(prompt, params, request_id)]


async def idle_stats(engine: AsyncLLMEngine):
    return await engine.async_engine.call(lambda e: (e.has_unfinished_requests(), e.make_stats()))


def assert_idle(engine: AsyncLLMEngine) -> None:
    busy, stats = asyncio.run(idle_stats(engine))
    assert not busy and stats.num_free_blocks == stats.num_blocks


def test_concurrent_requests_run_batched_and_match_llm_generate(model_folder, engine):
    expected = [
        list(o.outputs[0].token_ids)
        for o in LLM(str(model_folder), **SETTINGS).generate(
            [TokensPrompt(prompt_token_ids=p) for p in PROMPT_IDS], greedy(12), use_tqdm=False
        )
    ]
    steps_before = engine.async_engine.num_steps

    async def main():
        return await asyncio.gather(
            collect(engine, TokensPrompt(prompt_token_ids=PROMPT_IDS[0]), greedy(12), "a"),
            collect(engine, PROMPT_IDS[1], greedy(12), "b"),
        )

    streams = asyncio.run(main())
    # Alone, two requests of 12 tokens take at least 24 steps.
    assert engine.async_engine.num_steps - steps_before < 24
    for outputs, tokens in zip(streams, expected):
        # Cumulative by default (vLLM's): each output holds every token so far.
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and len(outputs) > 1
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert list(outputs[-1].outputs[0].token_ids) == tokens
        assert outputs[-1].outputs[0].finish_reason == "length"
    assert_idle(engine)


def test_delta_and_final_only_output_kinds(engine):
    async def main():
        return await asyncio.gather(
            collect(engine, PROMPT_IDS[0], greedy(10), "cumulative"),
            collect(engine, PROMPT_IDS[0], greedy(10, output_kind=DELTA), "d"),
            collect(engine, PROMPT_IDS[0], greedy(10, output_kind=FINAL_ONLY), "f"),
        )

    cumulative, delta, final = asyncio.run(main())
    tokens = list(cumulative[-1].outputs[0].token_ids)
    assert [t for o in delta for t in o.outputs[0].token_ids] == tokens
    assert "".join(o.outputs[0].text for o in delta) == cumulative[-1].outputs[0].text
    assert len(final) == 1 and list(final[0].outputs[0].token_ids) == tokens


def test_text_prompts_are_tokenized(engine):
    async def main():
        by_text = await collect(engine, TextPrompt(prompt="t5 t33 t90 t45"), greedy(4), "text")
        by_string = await collect(engine, "t5 t33 t90 t45", greedy(4), "string")
        return by_text[-1], by_string[-1]

    by_text, by_string = asyncio.run(main())
    assert by_text.prompt_token_ids == by_string.prompt_token_ids == [5, 33, 90, 45]
    assert by_text.prompt == "t5 t33 t90 t45"
    assert by_text.outputs[0].token_ids == by_string.outputs[0].token_ids


def test_abort_mid_stream_ends_the_generator_and_frees_the_request(engine):
    async def main():
        outputs = []
        async for output in engine.generate(PROMPT_IDS[1], greedy(50), "to-abort"):
            outputs.append(output)
            if len(outputs) == 2:
                await engine.abort("to-abort")
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 50
    assert_idle(engine)


def test_closing_the_generator_early_aborts_the_request(engine):
    async def main():
        async for output in engine.generate(PROMPT_IDS[0], greedy(50), "left"):
            if len(output.outputs[0].token_ids) >= 2:
                break
        # The abort takes effect at the engine thread's next iteration.
        for _ in range(100):
            busy, _stats = await idle_stats(engine)
            if not busy:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert_idle(engine)


def test_a_bad_request_raises_and_the_other_runs_on(engine):
    async def main():
        good = asyncio.create_task(collect(engine, PROMPT_IDS[0], greedy(50), "good"))
        await asyncio.sleep(0)  # "good" is in flight from here on
        with pytest.raises(ValueError, match="request_id 'good' is already in use"):
            await collect(engine, PROMPT_IDS[1], greedy(4), "good")
        with pytest.raises(ValueError, match="max_tokens=100"):
            await collect(engine, PROMPT_IDS[1], greedy(100), "too-long")
        with pytest.raises(ValueError, match="prompt token id 999"):
            await collect(engine, [3, 999], greedy(4), "bad-token")
        return await good

    outputs = asyncio.run(main())
    alone = asyncio.run(collect(engine, PROMPT_IDS[0], greedy(50), "alone"))
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert outputs[-1].outputs[0].token_ids == alone[-1].outputs[0].token_ids
    assert_idle(engine)


def test_health_tokenizer_and_shutdown(model_folder):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(model_folder), **SETTINGS))

    async def before():
        await engine.check_health()
        tokenizer = await engine.get_tokenizer()
        return tokenizer.encode("t5 t33")

    assert asyncio.run(before()) == [5, 33]
    assert engine.is_running and not engine.errored
    engine.shutdown()
    assert engine.errored and not engine.is_running

    async def after():
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await collect(engine, PROMPT_IDS[0], greedy(2), "late")

    asyncio.run(after())
