"""The llguidance backend and the manager on the embedded model's real tokenizer: validation
messages, masks, termination, shared and cached compilation, per-request state."""

from __future__ import annotations

from concurrent.futures import Future

import llguidance
import numpy as np
import pytest

from octavo.core.sampling_params import StructuredOutputsParams
from octavo.structured_output import GuidanceGrammar, StructuredOutputManager

from .conftest import EOS_TOKEN_ID


def allowed_ids(bitmask_row: np.ndarray) -> list[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return np.nonzero(bits)[0].tolist()


def ready_grammar(manager: StructuredOutputManager, params) -> GuidanceGrammar:
    grammar = manager.grammar_for(params)
    manager.wait_for_pending(30.0)
    # Another compilation may have finished first: wait for this one.
    while not grammar.is_ready():
        manager.wait_for_pending(1.0)
    return grammar


@pytest.mark.parametrize(
    "params, message",
    [
        (
            StructuredOutputsParams(json={"type": "strin"}),
            "structured_outputs.json is invalid: Invalid type: strin",
        ),
        (
            StructuredOutputsParams(json='{"type": '),
            "structured_outputs.json is invalid: Expecting value: line 1 column 10 (char 9)",
        ),
        (
            StructuredOutputsParams(json=[1, 2]),  # type: ignore[arg-type]
            "structured_outputs.json is invalid: a JSON schema must be a JSON object",
        ),
        (
            StructuredOutputsParams(json={"properties": {"a": {"$ref": "#/nope"}}}),
            "structured_outputs.json is invalid: Pointer '/nope' does not exist",
        ),
        (
            StructuredOutputsParams(json={"type": "string", "format": "nonsense"}),
            "structured_outputs.json is invalid: Unknown format: nonsense",
        ),
        (StructuredOutputsParams(regex="(abc"), "structured_outputs.regex is invalid: "),
        (
            StructuredOutputsParams(grammar="start: foo"),
            'structured_outputs.grammar is invalid: at 1(8): unknown name: "foo"',
        ),
        (
            StructuredOutputsParams(grammar="this is not a grammar"),
            "structured_outputs.grammar is invalid: Failed to convert the grammar",
        ),
    ],
)
def test_invalid_constraints_name_the_field_and_the_problem(manager, params, message) -> None:
    with pytest.raises(ValueError) as info:
        manager.validate(params)
    assert str(info.value).startswith(message)
    if params.regex is not None:
        assert "unclosed group" in str(info.value)


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(json='{"type": "array", "items": {"enum": [1, 2]}}'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[a-z]+\d"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='start: "a" | "b"'),
        StructuredOutputsParams(grammar='root ::= "x" ("y")*'),
    ],
)
def test_valid_constraints_pass(manager, params) -> None:
    manager.validate(params)


def test_choice_mask_termination_and_eos(manager, tokenizer) -> None:
    grammar = ready_grammar(manager, StructuredOutputsParams(choice=["yes", "no"]))
    (row,) = manager.grammar_bitmask([grammar])
    assert sorted(tokenizer.decode([t]) for t in allowed_ids(row)) == ["n", "no", "y", "ye", "yes"]
    (yes,) = tokenizer.encode("yes", add_special_tokens=False)
    assert grammar.accept_token(yes) and grammar.is_terminated()
    # Complete: only EOS may follow.
    (row,) = manager.grammar_bitmask([grammar])
    assert allowed_ids(row) == [EOS_TOKEN_ID]


def test_a_rejected_token_terminates_the_grammar(manager, tokenizer) -> None:
    grammar = ready_grammar(manager, StructuredOutputsParams(choice=["yes", "no"]))
    (token,) = tokenizer.encode("maybe", add_special_tokens=False)[:1]
    assert not grammar.accept_token(token)
    assert grammar.is_terminated()


def test_regex_digits_are_ascii(manager, tokenizer) -> None:
    grammar = ready_grammar(manager, StructuredOutputsParams(regex=r"\d"))
    (row,) = manager.grammar_bitmask([grammar])
    assert sorted(tokenizer.decode([t]) for t in allowed_ids(row)) == list("0123456789")


def test_compilation_is_shared_by_key_and_each_request_has_its_own_state(
    manager, tokenizer
) -> None:
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    before = manager.num_compiles
    first = ready_grammar(manager, StructuredOutputsParams(json=schema))
    # The same schema as text, keys in another order: the same key, no new compilation.
    second = ready_grammar(
        manager,
        StructuredOutputsParams(
            json='{"required": ["k"], "properties": {"k": {"enum": ["a", "b"]}}, "type": "object"}'
        ),
    )
    assert manager.num_compiles == before + 1
    start = manager.grammar_bitmask([second])[0].copy()
    for token in tokenizer.encode('{"k": "a"}', add_special_tokens=False):
        assert first.accept_token(token)
    assert first.is_terminated() and not second.is_terminated()
    rows = manager.grammar_bitmask([first, second])
    assert allowed_ids(rows[0]) == [EOS_TOKEN_ID]
    assert np.array_equal(rows[1], start)


def test_masks_after_proposed_tokens_and_proposals_cut_by_the_grammar(manager, tokenizer) -> None:
    """Speculative decoding: a grammar's rows after each proposed token equal the masks of a
    copy that consumed those tokens one by one, the grammar itself unmoved; num_valid counts
    the proposal's tokens the grammar accepts in order."""
    params = StructuredOutputsParams(regex="(cat|dog) and (cat|dog)")
    grammar, other = ready_grammar(manager, params), ready_grammar(manager, params)
    tokens = tokenizer.encode("cat and dog", add_special_tokens=False)
    assert grammar.num_valid(tokens) == len(tokens)
    assert (
        grammar.num_valid([*tokens[:2], *tokenizer.encode(" bird", add_special_tokens=False)]) == 2
    )
    rows = manager.grammar_bitmask([other, grammar], [[], tokens[:2]])
    assert rows.shape[0] == 1 + 3
    stepped = ready_grammar(manager, params)
    expected = [manager.grammar_bitmask([stepped])[0].copy()]
    for token in tokens[:2]:
        assert stepped.accept_token(token)
        expected.append(manager.grammar_bitmask([stepped])[0].copy())
    assert np.array_equal(rows[0], expected[0])
    assert all(np.array_equal(rows[1 + i], expected[i]) for i in range(3))
    assert np.array_equal(manager.grammar_bitmask([grammar])[0], expected[0])  # unmoved


def test_the_cache_keeps_the_most_recent_grammars(tokenizer) -> None:
    manager = StructuredOutputManager(
        tokenizer, len(tokenizer), (EOS_TOKEN_ID,), max_cached_grammars=1
    )
    ready_grammar(manager, StructuredOutputsParams(regex="a+"))
    ready_grammar(manager, StructuredOutputsParams(regex="b+"))
    ready_grammar(manager, StructuredOutputsParams(regex="b+"))
    assert manager.num_compiles == 2
    ready_grammar(manager, StructuredOutputsParams(regex="a+"))
    assert manager.num_compiles == 3
    manager.shutdown()


def test_a_grammar_is_not_ready_until_compiled(manager, tokenizer) -> None:
    compiled: Future[llguidance.LLMatcher] = Future()
    grammar = GuidanceGrammar(compiled)
    assert not grammar.is_ready()
    with pytest.raises(RuntimeError, match="still compiling"):
        grammar.accept_token(5)
    template = manager.backend.compile(
        manager.backend.validate(StructuredOutputsParams(choice=["yes", "no"]))
    )
    compiled.set_result(template)
    assert grammar.is_ready()
    # The request works on a copy: the cached template never advances.
    (yes,) = tokenizer.encode("yes", add_special_tokens=False)
    assert grammar.accept_token(yes) and grammar.is_terminated()
    assert not template.is_stopped()
