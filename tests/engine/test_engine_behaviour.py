"""What the engine does, on the mock model (tests/mock_engine.py): aborts in every state, n > 1,
seeds, stop strings and stop tokens, EOS and min_tokens, length caps, rejected requests, and
outputs that do not depend on batching, chunking, prefix hits or preemption. Milliseconds each;
the same behaviour on the real model is covered by tests/integration."""

from __future__ import annotations

import pytest

from octavo import SamplingParams
from octavo.core.request import FinishReason, RequestStatus
from octavo.engine.output_processor import OutputKind

from ..integration.utils import assert_no_leak
from ..mock_engine import EOS_TOKEN_ID, SCRIPT, VOCAB, mock_llm, text_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPT = "the cat"


def _generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def _step_until(engine, condition, max_steps: int = 200) -> list:
    finished = []
    for _ in range(max_steps):
        if condition():
            return finished
        finished += [o for o in engine.step() if o.finished]
    raise AssertionError("condition not reached")


def test_greedy_text_is_the_script_continued() -> None:
    llm = mock_llm()
    (output,) = _generate(llm, [PROMPT], GREEDY)
    completion = output.outputs[0]
    # Two prompt tokens: the mock writes the script from its third word on.
    expected = [SCRIPT[n % len(SCRIPT)] for n in range(2, 14)]
    assert completion.token_ids == expected
    assert completion.text == " " + text_of(expected)
    assert completion.finish_reason == FinishReason.LENGTH
    assert_no_leak(llm)


def test_abort_in_every_state_frees_blocks() -> None:
    llm = mock_llm(num_blocks=10, block_size=4, max_model_len=40, max_num_batched_tokens=8)
    engine, scheduler = llm.llm_engine, llm.llm_engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = [3 + i % 20 for i in range(10)]
    for i in range(4):
        engine.add_request(f"r{i}", prompt[: 7 + i], params, OutputKind.DELTA)
    # Waiting: nothing has run yet.
    engine.abort_request("r3")
    # Mid-prefill: one step of 8 tokens computes part of r0's and r1's prompts.
    finished = [o for o in engine.step() if o.finished]
    r1 = scheduler.get_request("r1")
    assert 0 < r1.num_computed_tokens < r1.num_prompt_tokens
    engine.abort_request("r1")
    # Running and preempted: r0 and r2 decode until the 10-block pool runs out.
    finished += _step_until(engine, lambda: engine.make_stats().num_preemptions > 0)
    statuses = {rid: scheduler.get_request(rid).status for rid in ("r0", "r2")}
    assert RequestStatus.PREEMPTED in statuses.values()
    engine.abort_request([rid for rid, s in statuses.items() if s == RequestStatus.PREEMPTED])
    running = [rid for rid, s in statuses.items() if s == RequestStatus.RUNNING]
    finished += [o for o in engine.step() if o.finished]
    engine.abort_request(running)
    finished += [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in finished) == ["r0", "r1", "r2", "r3"]
    assert all(o.outputs[0].finish_reason == FinishReason.ABORT for o in finished)
    assert_no_leak(llm)


def test_n_children_draw_apart_share_the_prompt_and_repeat_with_the_seed() -> None:
    llm = mock_llm()
    prompt = " ".join(VOCAB[3:20])  # 17 tokens: four full blocks of 4
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10)
    (output,) = _generate(llm, [prompt], params)
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4, "children sampled alike"
    (again,) = _generate(llm, [prompt], params)
    assert [c.text for c in again.outputs] == [c.text for c in output.outputs]
    assert again.num_cached_tokens == 16  # the prompt's full blocks, from the first call
    assert_no_leak(llm)


def test_a_seeded_request_draws_the_same_alone_in_a_batch_and_after_preemption() -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _generate(mock_llm(), [PROMPT], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    llm = mock_llm()
    batch = _generate(
        llm, ["a dog"] * 3 + [PROMPT] + ["one two"] * 3, [others] * 3 + [seeded] + [others] * 3
    )
    assert batch[3].outputs[0].token_ids == alone
    # A pool too small for all: requests are evicted and recomputed, their streams resume.
    tight = mock_llm(num_blocks=12, max_model_len=20)
    batch = _generate(tight, [PROMPT] * 4, seeded)
    assert tight.llm_engine.make_stats().num_preemptions > 0
    assert all(o.outputs[0].token_ids == alone for o in batch)
    assert_no_leak(tight)


def test_greedy_output_does_not_depend_on_chunks_prefix_hits_or_preemption() -> None:
    prompts = [" ".join(VOCAB[3 + i : 12 + i]) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in _generate(mock_llm(), prompts, params)]
    for llm in (
        mock_llm(max_num_batched_tokens=8),  # prompts in chunks
        mock_llm(long_prefill_token_threshold=3),
        mock_llm(num_blocks=16, max_model_len=32),  # evictions
    ):
        outputs = _generate(llm, prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert_no_leak(llm)
    cached = mock_llm()
    _generate(cached, prompts[:1], params)
    (hit,) = _generate(cached, prompts[:1], params)
    assert hit.num_cached_tokens == 8 and hit.outputs[0].token_ids == expected[0]


def test_stop_strings_end_the_text_before_them_even_across_tokens() -> None:
    llm = mock_llm()
    free = _generate(llm, [PROMPT], GREEDY)[0].outputs[0].text
    assert free.startswith(" sat on a mat and then")
    # Starts inside "on" and ends inside "mat": two tokens and the space between them.
    stopped = _generate(
        llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=12, stop=["n a m"])
    )
    completion = stopped[0].outputs[0]
    assert completion.text == " sat o"
    assert completion.finish_reason == FinishReason.STOP and completion.stop_reason == "n a m"
    kept = SamplingParams(
        temperature=0.0, max_tokens=12, stop=["a mat"], include_stop_str_in_output=True
    )
    assert _generate(llm, [PROMPT], kept)[0].outputs[0].text == " sat on a mat"
    assert_no_leak(llm)


def test_eos_min_tokens_ignore_eos_and_stop_token_ids() -> None:
    llm = mock_llm(answer_lens={"0": 5, "1": 5, "2": 5})
    engine = llm.llm_engine
    eos = _generate(llm, [PROMPT], GREEDY)[0].outputs[0]  # request "0"
    assert len(eos.token_ids) == 5 and eos.token_ids[-1] == EOS_TOKEN_ID
    assert eos.finish_reason == FinishReason.STOP and eos.stop_reason is None
    held = _generate(llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8))
    assert len(held[0].outputs[0].token_ids) == 9  # request "1": EOS once min_tokens allow
    assert EOS_TOKEN_ID not in held[0].outputs[0].token_ids[:8]
    ignored = _generate(
        llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    )
    assert len(ignored[0].outputs[0].token_ids) == 9
    assert ignored[0].outputs[0].finish_reason == FinishReason.LENGTH
    mat = VOCAB.index("mat")
    stopped = _generate(
        llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[mat])
    )
    completion = stopped[0].outputs[0]
    # The stop token is the last token id; its text is not in the output (vLLM's rule).
    assert completion.token_ids[-1] == mat and completion.text == " sat on a"
    assert completion.finish_reason == FinishReason.STOP and completion.stop_reason == mat
    assert engine.next_request_id() == "4"
    assert_no_leak(llm)


def test_max_model_len_caps_the_answer_and_refuses_what_cannot_fit() -> None:
    llm = mock_llm(max_model_len=16)
    prompt = " ".join(VOCAB[3:13])  # 10 tokens
    capped = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=None))
    assert len(capped[0].outputs[0].token_ids) == 6
    assert capped[0].outputs[0].finish_reason == FinishReason.LENGTH
    with pytest.raises(ValueError, match="max_model_len"):
        _generate(llm, [prompt], SamplingParams(max_tokens=7))
    with pytest.raises(ValueError, match="max_model_len"):
        _generate(llm, [" ".join(VOCAB[3:20])], SamplingParams(max_tokens=1))
    assert_no_leak(llm)


def test_invalid_requests_are_rejected_before_admission() -> None:
    llm = mock_llm()
    with pytest.raises(ValueError, match="prompt"):
        _generate(llm, [""], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        _generate(llm, [[10**9]], GREEDY)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    # One bad prompt rejects the whole call, and the good one is not left queued.
    with pytest.raises(ValueError):
        _generate(llm, ["the cat", ""], GREEDY)
    assert_no_leak(llm)


def test_chat_renders_the_template_and_logprobs_come_per_token() -> None:
    llm = mock_llm()
    (output,) = llm.chat(
        [{"role": "user", "content": "the dog"}],
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=2),
        use_tqdm=False,
    )
    assert output.prompt == "user the dog assistant"
    completion = output.outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert position[token_id].rank == 1 and len(position) in (2, 3)
    assert_no_leak(llm)


def test_generate_takes_a_priority_per_prompt() -> None:
    """vLLM's `LLM.generate(prompts, params, priority=[...])`: under the priority scheduling
    policy lower values are admitted first (one request runs at a time here); under fcfs any
    value but 0 is refused before anything is queued, as is a list of the wrong length."""
    llm = mock_llm(max_num_seqs=1, scheduling_policy="priority")
    runner = llm.llm_engine.model_runner
    admitted: list[str] = []
    execute = runner.execute

    def recording_execute(scheduler_output):
        admitted.extend(new_req.request_id for new_req in scheduler_output.scheduled_new_reqs)
        return execute(scheduler_output)

    runner.execute = recording_execute
    params = SamplingParams(temperature=0.0, max_tokens=2)
    prompts = ["the cat", "a dog", "one two"]
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1])
    assert admitted == ["1", "2", "0"]
    assert [len(output.outputs[0].token_ids) for output in outputs] == [2, 2, 2]
    with pytest.raises(ValueError, match="priority has 2 entries for 3 prompts"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])

    fcfs = mock_llm()
    with pytest.raises(ValueError, match="Got priority 1 but Priority scheduling is not enabled"):
        fcfs.generate(prompts, params, use_tqdm=False, priority=[0, 1, 0])
    assert not fcfs.llm_engine.has_unfinished_requests()
    assert len(fcfs.generate(prompts, params, use_tqdm=False, priority=[0, 0, 0])) == 3
    for engine in (llm.llm_engine, fcfs.llm_engine):
        engine.check_integrity()
