"""--logprobs-mode on synthetic logits: each of vLLM's four modes against values worked out by
hand from the same logits (bias, penalties, temperature, top-k, top-p written out in plain
Python), for greedy and random rows, alone and in one batch. No model; milliseconds each."""

from __future__ import annotations

import math

import pytest
import torch

from octavo.config import LOGPROBS_MODES, EngineArgs
from octavo.sample.metadata import SamplingMetadata
from octavo.sample.sampler import LOGPROBS_MODES as SAMPLER_MODES
from octavo.sample.sampler import Sampler

VOCAB = 6
NEG_INF = float("-inf")
# Row 0 greedy: logit bias +3 on token 3, repetition penalty 2 over prompt tokens 1 and 4.
# Row 1 temperature 0.5, top_k 3, output token 1 with presence 0.5 and frequency 0.25.
# Row 2 temperature 2, top_p 0.8.
RAW = [
    [0.5, 2.0, 1.2, -0.5, 0.0, 1.5],
    [1.0, 3.0, 2.0, 0.5, -1.0, 2.5],
    [8.0, 6.0, 4.0, 2.0, 0.0, -2.0],
]


def by_hand() -> list[list[float]]:
    """RAW after every step the sampler applies, one row at a time in plain floats."""
    row0 = list(RAW[0])
    row0[3] += 3.0  # logit bias
    for token in (1, 4):  # repetition 2: divide a positive logit, multiply the others
        row0[token] = row0[token] / 2.0 if row0[token] > 0 else row0[token] * 2.0
    row1 = list(RAW[1])
    row1[1] -= 0.25 * 1 + 0.5  # frequency x count, then presence
    row1 = [value / 0.5 for value in row1]
    kth = sorted(row1, reverse=True)[2]
    row1 = [value if value >= kth else NEG_INF for value in row1]
    row2 = [value / 2.0 for value in RAW[2]]
    total = sum(math.exp(value) for value in row2)
    # Probabilities .634, .233, ...: the head reaching 0.8 is the first two tokens.
    assert math.exp(row2[0]) / total < 0.8 < (math.exp(row2[0]) + math.exp(row2[1])) / total
    row2 = row2[:2] + [NEG_INF] * (VOCAB - 2)
    return [row0, row1, row2]


def log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    norm = top + math.log(sum(math.exp(value - top) for value in row))
    return [value - norm for value in row]


def metadata(rows: list[int], num_logprobs: int = 2) -> SamplingMetadata:
    """SamplingMetadata for the given rows of the three above, as the runner builds it."""
    temperature = [0.0, 0.5, 2.0]
    top_k = [0, 3, 0]
    top_p = [1.0, 1.0, 0.8]
    presence, frequency, repetition = [0.0, 0.5, 0.0], [0.0, 0.25, 0.0], [2.0, 1.0, 1.0]
    prompts = [[1, 4], [0], [0]]
    outputs = [[], [1], []]
    temps = [temperature[r] for r in rows]
    width = max(len(prompts[r]) for r in rows)
    padded = [prompts[r] + [VOCAB] * (width - len(prompts[r])) for r in rows]

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor([values[r] for r in rows], dtype=torch.float32)

    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_k=torch.tensor([top_k[r] for r in rows], dtype=torch.int64),
        top_p=f32(top_p),
        min_p=None,
        presence_penalty=f32(presence),
        frequency_penalty=f32(frequency),
        repetition_penalty=f32(repetition),
        all_greedy=all(t == 0.0 for t in temps),
        all_random=all(t != 0.0 for t in temps),
        scale_by_temperature=any(t not in (0.0, 1.0) for t in temps),
        prompt_token_ids=torch.tensor(padded, dtype=torch.int64),
        output_token_ids=[outputs[r] for r in rows],
        logit_bias={i: {3: 3.0} for i, r in enumerate(rows) if r == 0},
        max_num_logprobs=num_logprobs,
    )


def expected(mode: str, row: int) -> list[float]:
    values = RAW[row] if mode.startswith("raw_") else by_hand()[row]
    return log_softmax(values) if mode.endswith("_logprobs") else list(values)


def check_row(output, i: int, row: int, mode: str, num_logprobs: int) -> None:
    """Output row i (input row `row`): the sampled token's value and rank, then the top
    `num_logprobs` ids and values, all as worked out by hand."""
    reference = expected(mode, row)
    lp = output.logprobs
    sampled = output.sampled_token_ids[i].item()
    order = sorted(range(VOCAB), key=lambda t: -reference[t])
    assert lp.token_ids[i].tolist() == [sampled] + order[:num_logprobs]
    values = lp.logprobs[i].tolist()
    for got, token in zip(values, lp.token_ids[i].tolist(), strict=True):
        assert got == pytest.approx(reference[token], rel=1e-5, abs=1e-5)
    assert lp.sampled_ranks[i].item() == 1 + sum(v > reference[sampled] for v in reference)


def test_the_modes_are_vllms_in_config_and_sampler() -> None:
    assert LOGPROBS_MODES == SAMPLER_MODES
    assert EngineArgs().logprobs_mode == "raw_logprobs"
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineArgs(logprobs_mode="logits")
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="processed")


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_each_mode_in_a_mixed_batch_matches_the_hand_computed_values(mode: str) -> None:
    """One greedy and two random rows in one batch. The greedy row picks the biased token 3
    (the lowest raw logit, -0.5); the random rows draw among what their filters
    kept, so in a processed mode the sampled token's value is finite."""
    sampler = Sampler(logprobs_mode=mode)
    torch.manual_seed(0)
    output = sampler(torch.tensor(RAW), metadata([0, 1, 2]))
    assert output.sampled_token_ids[0].item() == 3
    assert output.sampled_token_ids[1].item() in (1, 2, 5)
    assert output.sampled_token_ids[2].item() in (0, 1)
    for row in range(3):
        check_row(output, row, row, mode, 2)
    if mode.startswith("processed_"):
        assert math.isfinite(output.logprobs.logprobs[:, 0].min().item())


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_a_greedy_row_reports_the_same_alone_as_in_a_batch(mode: str) -> None:
    """An all-greedy batch skips temperature and the filters (steps 6-9); the greedy row's
    values must not depend on that: processed means after bias and penalties either way."""
    alone = Sampler(logprobs_mode=mode)(torch.tensor(RAW[:1]), metadata([0], 4))
    batched = Sampler(logprobs_mode=mode)(torch.tensor(RAW), metadata([0, 1, 2], 4))
    check_row(alone, 0, 0, mode, 4)
    assert torch.equal(alone.logprobs.token_ids[0], batched.logprobs.token_ids[0])
    assert torch.equal(alone.logprobs.logprobs[0], batched.logprobs.logprobs[0])


def test_processed_logits_keep_minus_infinity_for_dropped_tokens() -> None:
    """top_p kept two tokens of row 2: its third-best reported value is -inf (the server
    clamps it for JSON, as vLLM does)."""
    output = Sampler(logprobs_mode="processed_logits")(torch.tensor(RAW[2:]), metadata([2], 3))
    values = output.logprobs.logprobs[0].tolist()
    assert values[1:3] == [4.0, 3.0] and values[3] == NEG_INF
