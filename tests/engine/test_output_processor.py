"""OutputProcessor on hand-written EngineCoreOutputs: output kinds, stop strings, n > 1,
aborts, logprobs. The tokenizer is SmolLM2's; no model runs."""

from __future__ import annotations

import pytest

from octavo.core.outputs import EngineCoreOutput, TokenLogprobs
from octavo.core.sampling_params import SamplingParams
from octavo.engine.output_processor import OutputKind, OutputProcessor
from octavo.engine.outputs import Logprob

# "Hello", " world", ".", " The", " end" in SmolLM2's vocabulary.
HELLO, WORLD, DOT, THE, END = 19556, 905, 30, 378, 1112
PIECES = {HELLO: "Hello", WORLD: " world", DOT: ".", THE: " The", END: " end"}
PROMPT_IDS = [1, 4093, 198]  # "<|im_start|>user\n"


@pytest.fixture
def processor(smollm2_tokenizer) -> OutputProcessor:
    return OutputProcessor(smollm2_tokenizer)


def core(request_id: str, *token_ids: int, finish: str | None = None, **kwargs) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, list(token_ids), None, finish_reason=finish, **kwargs)


def add(processor: OutputProcessor, request_id: str, kind: OutputKind, child_ids=None, **params):
    sampling_params = SamplingParams(**params)
    processor.add_request(request_id, "prompt", PROMPT_IDS, sampling_params, kind, child_ids)


def texts(processed) -> list[tuple[str, int, str, list[int], str | None]]:
    """(request id, index, text, token ids, finish reason) for every completion output."""
    return [
        (out.request_id, c.index, c.text, c.token_ids, c.finish_reason)
        for out in processed.request_outputs
        for c in out.outputs
    ]


def test_delta_sends_only_new_text_and_forgets_finished(processor) -> None:
    add(processor, "r", OutputKind.DELTA)
    assert texts(processor.process_outputs([core("r", HELLO)])) == [
        ("r", 0, "Hello", [HELLO], None)
    ]
    assert texts(processor.process_outputs([core("r", WORLD)])) == [
        ("r", 0, " world", [WORLD], None)
    ]
    processed = processor.process_outputs([core("r", DOT, finish="length")])
    assert texts(processed) == [("r", 0, ".", [DOT], "length")]
    assert processed.request_outputs[0].finished and processed.reqs_to_abort == []
    assert processed.request_outputs[0].prompt == "prompt"
    assert processed.request_outputs[0].prompt_token_ids == PROMPT_IDS
    assert not processor.has_unfinished_requests()
    assert processor.process_outputs([core("r", THE)]).request_outputs == []


def test_cumulative_sends_everything_so_far(processor) -> None:
    add(processor, "r", OutputKind.CUMULATIVE)
    processor.process_outputs([core("r", HELLO)])
    assert texts(processor.process_outputs([core("r", WORLD)])) == [
        ("r", 0, "Hello world", [HELLO, WORLD], None)
    ]
    assert texts(processor.process_outputs([core("r", DOT, finish="length")])) == [
        ("r", 0, "Hello world.", [HELLO, WORLD, DOT], "length")
    ]


def test_final_only_sends_one_output_at_the_end(processor) -> None:
    add(processor, "r", OutputKind.FINAL_ONLY)
    assert processor.process_outputs([core("r", HELLO)]).request_outputs == []
    assert processor.get_num_unfinished_requests() == 1
    processed = processor.process_outputs([core("r", WORLD, finish="stop", stop_reason=WORLD)])
    # The stop token stays in token_ids but its text is left out (vLLM).
    assert texts(processed) == [("r", 0, "Hello", [HELLO, WORLD], "stop")]
    assert processed.request_outputs[0].outputs[0].stop_reason == WORLD
    assert processor.get_num_unfinished_requests() == 0


def test_stop_string_across_tokens_in_delta_mode(processor) -> None:
    add(processor, "r", OutputKind.DELTA, stop=["d."])
    # One character held back: it could start the stop string.
    assert texts(processor.process_outputs([core("r", HELLO)]))[0][2] == "Hell"
    assert texts(processor.process_outputs([core("r", WORLD)]))[0][2] == "o worl"
    processed = processor.process_outputs([core("r", DOT)])
    assert processed.reqs_to_abort == ["r"]
    assert texts(processed) == [("r", 0, "", [DOT], "stop")]
    assert processed.request_outputs[0].outputs[0].stop_reason == "d."
    assert not processor.has_unfinished_requests()
    # The scheduler ran one more step before it applied the abort: ignored.
    assert processor.process_outputs([core("r", THE)]).request_outputs == []


def test_stop_string_included_and_later_tokens_dropped(processor) -> None:
    add(processor, "r", OutputKind.CUMULATIVE, stop=["d."], include_stop_str_in_output=True)
    processed = processor.process_outputs([core("r", HELLO, WORLD, DOT, THE, END)])
    assert texts(processed) == [("r", 0, "Hello world.", [HELLO, WORLD, DOT], "stop")]
    assert processed.reqs_to_abort == ["r"]


def test_stop_string_when_the_scheduler_finished_the_same_step(processor) -> None:
    """The scheduler already dropped the request (length cap): nothing to abort."""
    add(processor, "r", OutputKind.CUMULATIVE, stop=["d."])
    processed = processor.process_outputs([core("r", HELLO, WORLD, DOT, finish="length")])
    assert texts(processed) == [("r", 0, "Hello worl", [HELLO, WORLD, DOT], "stop")]
    assert processed.reqs_to_abort == []


def test_held_back_text_is_flushed_when_the_request_finishes(processor) -> None:
    add(processor, "r", OutputKind.DELTA, stop=["END!"])
    assert texts(processor.process_outputs([core("r", HELLO, WORLD)]))[0][2] == "Hello wo"
    assert texts(processor.process_outputs([core("r", DOT, finish="length")]))[0][2] == "rld."


def test_min_tokens_suppresses_stop_strings(processor) -> None:
    add(processor, "r", OutputKind.CUMULATIVE, stop=["e"], min_tokens=3)
    processed = processor.process_outputs([core("r", HELLO, WORLD, DOT)])
    assert processed.reqs_to_abort == [] and texts(processed)[0][4] is None
    processed = processor.process_outputs([core("r", THE)])
    assert processed.reqs_to_abort == ["r"]
    assert texts(processed) == [("r", 0, "Hello world. Th", [HELLO, WORLD, DOT, THE], "stop")]


def test_n_children_in_delta_mode(processor) -> None:
    add(processor, "p", OutputKind.DELTA, ["p-0", "p-1"], n=2)
    processed = processor.process_outputs([core("p-1", WORLD), core("p-0", HELLO)])
    assert texts(processed) == [("p", 0, "Hello", [HELLO], None), ("p", 1, " world", [WORLD], None)]
    processed = processor.process_outputs([core("p-0", DOT, finish="length")])
    assert texts(processed) == [("p", 0, ".", [DOT], "length")]
    assert not processed.request_outputs[0].finished
    processed = processor.process_outputs([core("p-1", END, finish="length")])
    assert texts(processed) == [("p", 1, " end", [END], "length")]
    assert processed.request_outputs[0].finished
    assert not processor.has_unfinished_requests()


def test_n_children_in_cumulative_mode(processor) -> None:
    add(processor, "p", OutputKind.CUMULATIVE, ["p-0", "p-1"], n=2)
    processor.process_outputs([core("p-0", HELLO), core("p-1", WORLD)])
    processed = processor.process_outputs([core("p-0", DOT, finish="length")])
    assert texts(processed) == [
        ("p", 0, "Hello.", [HELLO, DOT], "length"),
        ("p", 1, " world", [WORLD], None),
    ]
    assert not processed.request_outputs[0].finished
    processed = processor.process_outputs([core("p-1", END, finish="length")])
    assert [c.text for c in processed.request_outputs[0].outputs] == ["Hello.", " world end"]
    assert processed.request_outputs[0].finished


def test_n_children_in_final_only_mode(processor) -> None:
    add(processor, "p", OutputKind.FINAL_ONLY, ["p-0", "p-1", "p-2"], n=3)
    assert processor.process_outputs([core("p-2", THE, finish="length")]).request_outputs == []
    assert processor.process_outputs([core("p-0", HELLO, finish="length")]).request_outputs == []
    processed = processor.process_outputs([core("p-1", WORLD, END, finish="length")])
    assert texts(processed) == [
        ("p", 0, "Hello", [HELLO], "length"),
        ("p", 1, " world end", [WORLD, END], "length"),
        ("p", 2, " The", [THE], "length"),
    ]
    assert processed.request_outputs[0].finished
    assert processor.get_num_unfinished_requests() == 0


def test_one_child_hitting_a_stop_string_aborts_only_that_child(processor) -> None:
    add(processor, "p", OutputKind.DELTA, ["p-0", "p-1"], n=2, stop=["."])
    processed = processor.process_outputs([core("p-0", DOT), core("p-1", HELLO)])
    assert processed.reqs_to_abort == ["p-0"]
    assert texts(processed) == [("p", 0, "", [DOT], "stop"), ("p", 1, "Hello", [HELLO], None)]
    assert processor.has_unfinished_requests()


def test_abort_parent_reports_abort_next_step(processor) -> None:
    add(processor, "p", OutputKind.CUMULATIVE, ["p-0", "p-1"], n=2, stop=["END!"])
    processor.process_outputs([core("p-0", HELLO, finish="length"), core("p-1", WORLD)])
    assert processor.abort_requests(["p", "unknown"]) == ["p-1"]
    assert processor.has_unfinished_requests()  # its last output is still to come
    processed = processor.process_outputs([])
    # The held-back text of the aborted child is released with its final output.
    assert texts(processed) == [
        ("p", 0, "Hello", [HELLO], "length"),
        ("p", 1, " world", [WORLD], "abort"),
    ]
    assert processed.request_outputs[0].finished
    assert not processor.has_unfinished_requests()
    assert processor.process_outputs([core("p-1", END, finish="abort")]).request_outputs == []


def test_abort_plain_request_in_final_only_mode(processor) -> None:
    add(processor, "r", OutputKind.FINAL_ONLY)
    processor.process_outputs([core("r", HELLO)])
    assert processor.abort_requests(["r"]) == ["r"]
    assert processor.abort_requests(["r"]) == []
    assert texts(processor.process_outputs([])) == [("r", 0, "Hello", [HELLO], "abort")]


def test_logprobs_and_cumulative_logprob(processor) -> None:
    add(processor, "r", OutputKind.DELTA, logprobs=1)
    first = TokenLogprobs([HELLO, HELLO], [-0.25, -0.25], sampled_rank=1)
    second = TokenLogprobs([WORLD, END], [-1.5, -0.5], sampled_rank=2)
    output = EngineCoreOutput("r", [HELLO], [first])
    completion = processor.process_outputs([output]).request_outputs[0].outputs[0]
    assert completion.logprobs == [{HELLO: Logprob(-0.25, 1, "Hello")}]
    assert completion.cumulative_logprob == -0.25
    output = EngineCoreOutput("r", [WORLD], [second], finish_reason="length")
    completion = processor.process_outputs([output]).request_outputs[0].outputs[0]
    assert completion.logprobs == [
        {END: Logprob(-0.5, 1, PIECES[END]), WORLD: Logprob(-1.5, 2, PIECES[WORLD])}
    ]
    assert completion.cumulative_logprob == -1.75


def test_logprobs_after_a_stop_string_are_dropped(processor) -> None:
    add(processor, "r", OutputKind.CUMULATIVE, logprobs=0, stop=["d."])
    positions = [TokenLogprobs([t], [-1.0], sampled_rank=1) for t in (HELLO, WORLD, DOT, THE)]
    output = EngineCoreOutput("r", [HELLO, WORLD, DOT, THE], positions)
    completion = processor.process_outputs([output]).request_outputs[0].outputs[0]
    assert [list(entry) for entry in completion.logprobs] == [[HELLO], [WORLD], [DOT]]
    assert completion.cumulative_logprob == -3.0


def test_no_logprobs_unless_asked(processor) -> None:
    add(processor, "r", OutputKind.CUMULATIVE)
    completion = processor.process_outputs([core("r", HELLO)]).request_outputs[0].outputs[0]
    assert completion.logprobs is None and completion.cumulative_logprob is None


def test_num_cached_tokens_is_reported(processor) -> None:
    add(processor, "p", OutputKind.CUMULATIVE, ["p-0", "p-1"], n=2)
    processed = processor.process_outputs(
        [core("p-0", HELLO, num_cached_tokens=16), core("p-1", WORLD, num_cached_tokens=32)]
    )
    assert processed.request_outputs[0].num_cached_tokens == 16


def test_add_request_checks_ids(processor) -> None:
    with pytest.raises(ValueError, match=r"sampling_params\.n=2"):
        add(processor, "p", OutputKind.DELTA, None, n=2)
    with pytest.raises(ValueError, match="distinct"):
        add(processor, "p", OutputKind.DELTA, ["c", "c"], n=2)
    add(processor, "r", OutputKind.DELTA)
    with pytest.raises(ValueError, match="'r' is already in use"):
        add(processor, "r", OutputKind.DELTA)
    add(processor, "p", OutputKind.DELTA, ["p-0", "p-1"], n=2)
    with pytest.raises(ValueError, match="'p-1' is already in use"):
        add(processor, "q", OutputKind.DELTA, ["q-0", "p-1"], n=2)
    assert [processor.has_request(i) for i in ("r", "p", "p-1", "q", "q-0")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert processor.get_num_unfinished_requests() == 2


# Prompt tokens 4093 and 198 scored by the positions before them: each its own value and
# rank, then the top 1.
PROMPT_LOGPROBS = [
    TokenLogprobs([4093, HELLO], [-2.5, -0.5], 3),
    TokenLogprobs([198, 198], [-0.1, -0.1], 1),
]


@pytest.mark.parametrize("kind", [OutputKind.DELTA, OutputKind.CUMULATIVE])
def test_prompt_logprobs_arrive_once_as_vllm_shapes_them(processor, kind) -> None:
    """vLLM's form: None for the first prompt token, then the prompt token's entry first and
    the top k; DELTA sends them in the first output only, CUMULATIVE in every one; for n > 1
    the first child's are the request's."""
    add(processor, "r", kind, child_ids=["r-0", "r-1"], n=2, prompt_logprobs=1)
    first = processor.process_outputs(
        [
            core("r-0", HELLO, prompt_logprobs=PROMPT_LOGPROBS),
            core("r-1", WORLD, prompt_logprobs=PROMPT_LOGPROBS),
        ]
    )
    prompt_logprobs = first.request_outputs[0].prompt_logprobs
    assert prompt_logprobs == [
        None,
        {4093: Logprob(-2.5, 3, "user"), HELLO: Logprob(-0.5, 1, "Hello")},
        {198: Logprob(-0.1, 1, "\n")},
    ]
    assert list(prompt_logprobs[1]) == [4093, HELLO]
    later = processor.process_outputs([core("r-0", DOT)]).request_outputs[0]
    assert later.prompt_logprobs == (None if kind == OutputKind.DELTA else prompt_logprobs)


def test_no_prompt_logprobs_unless_asked(processor) -> None:
    add(processor, "r", OutputKind.CUMULATIVE)
    assert processor.process_outputs([core("r", HELLO)]).request_outputs[0].prompt_logprobs is None
