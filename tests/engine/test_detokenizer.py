"""Incremental detokenization and stop strings, against the tokenizer's own full decode."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from octavo.core.sampling_params import SamplingParams
from octavo.engine.detokenizer import (
    Detokenizer,
    IncrementalDecoder,
    find_stop_string,
    get_backend_tokenizer,
)

PROMPTS = ["Write a short poem.", "Translate to French: good morning", "<|im_start|>user\nHi"]
# "Hello", " world", ".", " The", " end" in SmolLM2's vocabulary.
HELLO_IDS = [19556, 905, 30, 378, 1112]
IM_END = 2
NUM_SPECIAL_IDS = 17
MULTI_BYTE_TEXT = "naïve café 😀👍🏽 世界 Ω — 日本語のテキスト 🇫🇷!"


def decode_incrementally(
    tokenizer,
    prompt_ids: list[int],
    output_ids: list[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> list[str]:
    decoder = IncrementalDecoder(
        get_backend_tokenizer(tokenizer),
        prompt_ids,
        skip_special_tokens,
        spaces_between_special_tokens,
    )
    chunks = [decoder.decode_next(token_id) for token_id in output_ids]
    chunks.append(decoder.flush())
    return chunks


def random_output_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Any token of the vocabulary, with extra weight on special tokens and on tokens that hold
    part of a multi-byte character (random order makes many of those invalid UTF-8)."""
    fragments = tokenizer.encode(MULTI_BYTE_TEXT, add_special_tokens=False)
    choices = []
    for _ in range(length):
        draw = rng.random()
        if draw < 0.1:
            choices.append(rng.randrange(NUM_SPECIAL_IDS))
        elif draw < 0.5:
            choices.append(rng.choice(fragments))
        else:
            choices.append(rng.randrange(len(tokenizer)))
    return choices


def test_hello_ids_are_what_the_tests_assume(smollm2_tokenizer) -> None:
    pieces = [smollm2_tokenizer.decode([i]) for i in HELLO_IDS]
    assert pieces == ["Hello", " world", ".", " The", " end"]
    assert smollm2_tokenizer.decode([IM_END]) == "<|im_end|>"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_full_decode(smollm2_tokenizer, skip_special_tokens) -> None:
    rng = random.Random(1234)
    num_held_back = num_flushed = 0
    for _ in range(150):
        prompt_ids = smollm2_tokenizer.encode(rng.choice(PROMPTS), add_special_tokens=False)
        output_ids = random_output_ids(smollm2_tokenizer, rng, rng.randrange(1, 40))
        chunks = decode_incrementally(
            smollm2_tokenizer, prompt_ids, output_ids, skip_special_tokens
        )
        expected = smollm2_tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(chunks) == expected, output_ids
        num_held_back += chunks[:-1].count("")
        num_flushed += chunks[-1] != ""
    # Characters were split across tokens, and some outputs ended mid-character.
    assert num_held_back > 500 and num_flushed > 30


def test_emoji_and_cjk_split_across_tokens_never_emit_broken_text(smollm2_tokenizer) -> None:
    text = MULTI_BYTE_TEXT
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = smollm2_tokenizer.encode("Say it:", add_special_tokens=False)
    chunks = decode_incrementally(smollm2_tokenizer, prompt_ids, ids)
    assert "".join(chunks) == text
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert chunks[-1] == ""  # nothing left to flush
    assert chunks.count("") >= 10  # tokens that only completed a character later
    assert len(ids) > len(chunks) - chunks.count("")


def test_metaspace_leading_space_comes_from_prompt_context(metaspace_tokenizer) -> None:
    ids = metaspace_tokenizer.encode("the cat sat on the mat").ids
    assert metaspace_tokenizer.decode(ids[3:]) == "on the mat"  # decoded alone: no space
    chunks = decode_incrementally(metaspace_tokenizer, ids[:3], ids[3:])
    assert "".join(chunks) == " on the mat"
    full = metaspace_tokenizer.decode(ids)
    assert "".join(chunks) == full[len(metaspace_tokenizer.decode(ids[:3])) :]
    # Without a prompt the first token starts the text, as a full decode has it.
    assert "".join(decode_incrementally(metaspace_tokenizer, [], ids[3:])) == "on the mat"


def test_spaces_between_special_tokens() -> None:
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.add_special_tokens(["[CLS]", "[SEP]"])
    tokenizer.decoder = decoders.WordPiece()
    ids = [1, 2, 3, 4, 5, 2]

    def text(skip: bool, spaces: bool) -> str:
        return "".join(decode_incrementally(tokenizer, [], ids, skip, spaces))

    assert text(skip=False, spaces=True) == "[CLS] [SEP] hello worlds [SEP]"
    assert text(skip=False, spaces=True) == tokenizer.decode(ids, skip_special_tokens=False)
    assert text(skip=False, spaces=False) == "[CLS][SEP] hello worlds [SEP]"
    assert text(skip=True, spaces=False) == "hello worlds"


def test_find_stop_string_picks_the_earliest_match_in_the_new_text() -> None:
    assert find_stop_string("Hello world", 6, ["o w", "ld"], False) == ("o w", 4)
    assert find_stop_string("Hello world", 6, ["o w", "ld"], True) == ("o w", 7)
    # "He" ended before the 6 new characters: already looked for, not found again.
    assert find_stop_string("Hello world", 6, ["He"], False) is None
    assert find_stop_string("Hello world", 6, ["xyz"], False) is None


def make_detokenizer(tokenizer, **params) -> Detokenizer:
    return Detokenizer(get_backend_tokenizer(tokenizer), [], SamplingParams(**params))


def test_stop_string_across_token_boundary_is_cut_and_held_back(smollm2_tokenizer) -> None:
    detokenizer = make_detokenizer(smollm2_tokenizer, stop=["d."])
    update = detokenizer.update(HELLO_IDS[:1], stop_terminated=False)
    assert (update.num_kept_tokens, update.stop_string) == (1, None)
    assert (detokenizer.text, detokenizer.num_output_chars) == ("Hello", 4)
    detokenizer.update(HELLO_IDS[1:2], stop_terminated=False)
    assert (detokenizer.text, detokenizer.num_output_chars) == ("Hello world", 10)
    update = detokenizer.update(HELLO_IDS[2:3], stop_terminated=False)
    assert (update.num_kept_tokens, update.stop_string) == (1, "d.")
    detokenizer.finish()
    assert (detokenizer.text, detokenizer.num_output_chars) == ("Hello worl", 10)


def test_stop_string_included_on_request_and_later_tokens_dropped(smollm2_tokenizer) -> None:
    detokenizer = make_detokenizer(smollm2_tokenizer, stop=["d."], include_stop_str_in_output=True)
    update = detokenizer.update(HELLO_IDS, stop_terminated=False)
    assert (update.num_kept_tokens, update.stop_string) == (3, "d.")
    assert (detokenizer.text, detokenizer.num_tokens) == ("Hello world.", 3)


def test_min_tokens_suppresses_stop_strings(smollm2_tokenizer) -> None:
    # "e" is in token 1 ("Hello") and token 4 (" The"); with min_tokens=3 only the second counts.
    detokenizer = make_detokenizer(smollm2_tokenizer, stop=["e"], min_tokens=3)
    update = detokenizer.update(HELLO_IDS, stop_terminated=False)
    assert (update.num_kept_tokens, update.stop_string) == (4, "e")
    assert detokenizer.text == "Hello world. Th"
    detokenizer = make_detokenizer(smollm2_tokenizer, stop=["e"])
    assert detokenizer.update(HELLO_IDS, stop_terminated=False).num_kept_tokens == 1
    assert detokenizer.text == "H"


def test_held_back_characters_are_flushed_at_finish(smollm2_tokenizer) -> None:
    detokenizer = make_detokenizer(smollm2_tokenizer, stop=["END!"])
    assert detokenizer.update(HELLO_IDS, stop_terminated=False).stop_string is None
    assert detokenizer.num_output_chars == len("Hello world. The end") - 3
    detokenizer.finish()
    assert detokenizer.text[: detokenizer.num_output_chars] == "Hello world. The end"


def test_stop_token_text_is_left_out_unless_included(smollm2_tokenizer) -> None:
    ids = [*HELLO_IDS[:2], IM_END]
    detokenizer = make_detokenizer(smollm2_tokenizer, skip_special_tokens=False)
    assert detokenizer.update(ids, stop_terminated=True).num_kept_tokens == 3
    assert (detokenizer.text, detokenizer.num_tokens) == ("Hello world", 3)
    detokenizer = make_detokenizer(
        smollm2_tokenizer, skip_special_tokens=False, include_stop_str_in_output=True
    )
    detokenizer.update(ids, stop_terminated=True)
    assert detokenizer.text == "Hello world<|im_end|>"


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_final_text_is_full_decode_cut_at_the_stop_string(
    smollm2_tokenizer, include_stop_str_in_output
) -> None:
    """Property: final text == tokenizer.decode(token_ids) cut at the stop string, and every
    streamed prefix is a prefix of it (no partial stop string is ever sent)."""
    rng = random.Random(99)
    num_stopped = 0
    for _ in range(100):
        skip = rng.random() < 0.5
        output_ids = random_output_ids(smollm2_tokenizer, rng, rng.randrange(2, 30))
        full = smollm2_tokenizer.decode(output_ids, skip_special_tokens=skip)
        start = rng.randrange(len(full))
        stop = full[start : start + rng.randrange(1, 5)]
        if "\ufffd" in stop:
            stop = "zz"  # usually absent: checks the no-stop path too
        detokenizer = make_detokenizer(
            smollm2_tokenizer,
            stop=[stop],
            skip_special_tokens=skip,
            include_stop_str_in_output=include_stop_str_in_output,
        )
        streamed: list[str] = []
        num_kept = 0
        for token_id in output_ids:
            update = detokenizer.update([token_id], stop_terminated=False)
            num_kept += update.num_kept_tokens
            streamed.append(detokenizer.text[: detokenizer.num_output_chars])
            if update.stop_string is not None:
                break
        detokenizer.finish()
        idx = full.find(stop)
        if idx == -1:
            assert detokenizer.text == full
            assert num_kept == len(output_ids)
        else:
            num_stopped += 1
            cut = idx + len(stop) if include_stop_str_in_output else idx
            assert detokenizer.text == full[:cut], (output_ids, stop)
            kept_text = smollm2_tokenizer.decode(output_ids[:num_kept], skip_special_tokens=skip)
            assert kept_text.find(stop) == idx
        assert all(detokenizer.text.startswith(prefix) for prefix in streamed)
    assert num_stopped > 80
