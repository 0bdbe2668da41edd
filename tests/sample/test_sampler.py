"""Sampler end to end on synthetic logits: greedy, seeded reproducibility across batches, sampled
frequencies, min_tokens, logit bias, penalties and raw logprobs. No model; milliseconds each."""

from __future__ import annotations

import math

import pytest
import torch

from octavo.model.cpu import build, ops
from octavo.sample.metadata import SamplingMetadata
from octavo.sample.sampler import Sampler

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# The random draw in torch, and in the CPU kernel the model runner passes on a CPU.
DRAWS = ["torch"] + (["kernel"] if build.vectorized() else [])


def make_sampler(draw: str, device: str = "cpu") -> Sampler:
    if draw == "kernel" and device != "cpu":
        pytest.skip("the sampling kernel runs on a CPU")
    return Sampler(draw=ops.sample_categorical if draw == "kernel" else None)


def make_metadata(
    temperature: list[float],
    *,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    penalties: tuple[list[float], list[float], list[float]] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
    output_token_ids: list[list[int]] | None = None,
    min_tokens_stop_ids: dict[int, set[int]] | None = None,
    logit_bias: dict[int, dict[int, float]] | None = None,
    max_num_logprobs: int | None = None,
    vocab_size: int = 0,
    device: str = "cpu",
) -> SamplingMetadata:
    """Metadata the way the runner builds it; `penalties` is (presence, frequency, repetition)
    and `prompt_token_ids` is padded here with vocab_size."""

    def tensor(values: list | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if values is None else torch.tensor(values, dtype=dtype, device=device)

    num_reqs = len(temperature)
    prompt = None
    if prompt_token_ids is not None:
        width = max(len(row) for row in prompt_token_ids)
        prompt = tensor(
            [row + [vocab_size] * (width - len(row)) for row in prompt_token_ids], torch.int64
        )
    presence, frequency, repetition = penalties or (None, None, None)
    return SamplingMetadata(
        temperature=tensor(temperature, torch.float32),
        all_greedy=all(t == 0.0 for t in temperature),
        all_random=all(t != 0.0 for t in temperature),
        scale_by_temperature=any(t not in (0.0, 1.0) for t in temperature),
        top_k=tensor(top_k, torch.int64),
        top_p=tensor(top_p, torch.float32),
        min_p=tensor(min_p, torch.float32),
        generators=generators or {},
        presence_penalty=tensor(presence, torch.float32),
        frequency_penalty=tensor(frequency, torch.float32),
        repetition_penalty=tensor(repetition, torch.float32),
        prompt_token_ids=prompt,
        output_token_ids=output_token_ids or [[] for _ in range(num_reqs)],
        min_tokens_stop_ids=min_tokens_stop_ids or {},
        logit_bias=logit_bias or {},
        max_num_logprobs=max_num_logprobs,
    )


def random_logits(num_reqs: int, vocab_size: int, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_reqs, vocab_size, generator=generator) * 3.0).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_on_the_fast_path_and_in_a_mixed_batch(device: str) -> None:
    logits = random_logits(6, 100, seed=0, device=device)
    expected = logits.argmax(dim=1)
    sampler = Sampler()

    all_greedy = sampler(logits.clone(), make_metadata([0.0] * 6, device=device))
    assert torch.equal(all_greedy.sampled_token_ids, expected)
    assert all_greedy.logprobs is None

    temperature = [0.0, 1.0, 0.0, 0.7, 0.0, 1.3]
    mixed = sampler(
        logits.clone(),
        make_metadata(temperature, top_p=[1.0, 0.9, 1.0, 0.5, 1.0, 1.0], device=device),
    )
    greedy_rows = [0, 2, 4]
    assert torch.equal(mixed.sampled_token_ids[greedy_rows], expected[greedy_rows])


@pytest.mark.parametrize("draw", DRAWS)
def test_top_k_1_and_tiny_top_p_equal_greedy(draw: str) -> None:
    logits = random_logits(8, 500, seed=1)
    expected = logits.argmax(dim=1)
    sampler = make_sampler(draw)
    top_k = sampler(logits.clone(), make_metadata([1.5] * 8, top_k=[1] * 8))
    assert torch.equal(top_k.sampled_token_ids, expected)
    top_p = sampler(logits.clone(), make_metadata([1.5] * 8, top_p=[1e-6] * 8))
    assert torch.equal(top_p.sampled_token_ids, expected)


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_samples_the_same_alone_and_inside_a_batch(device: str, draw: str) -> None:
    """Row 0 of a batch of 1 and row 5 of a batch of 8 share a seed: same tokens for 6 steps,
    although the batch has greedy, unseeded and otherwise-seeded rows that force the full-sort
    top-p path and min-p, and the default RNG is reseeded differently for the two runs."""
    vocab_size, num_steps = 300, 6
    sampler = make_sampler(draw, device)

    def run(batch: bool) -> list[int]:
        seeded = torch.Generator(device=device).manual_seed(42)
        other_seeded = torch.Generator(device=device).manual_seed(7)
        torch.manual_seed(1 if batch else 2)
        tokens = []
        for step in range(num_steps):
            row_logits = random_logits(1, vocab_size, seed=100 + step, device=device)
            if not batch:
                metadata = make_metadata([0.8], top_k=[20], generators={0: seeded}, device=device)
                tokens.append(sampler(row_logits, metadata).sampled_token_ids.item())
                continue
            logits = random_logits(8, vocab_size, seed=200 + step, device=device)
            logits[5] = row_logits[0]
            metadata = make_metadata(
                [1.0, 0.0, 0.5, 1.2, 1.0, 0.8, 2.0, 0.0],
                top_k=[0, 0, 5, 0, 50, 20, 0, 0],
                top_p=[0.9, 1.0, 1.0, 0.7, 1.0, 1.0, 0.95, 1.0],
                min_p=[0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.0],
                generators={2: other_seeded, 5: seeded},
                device=device,
            )
            tokens.append(sampler(logits, metadata).sampled_token_ids[5].item())
        return tokens

    with torch.random.fork_rng(devices=[] if device == "cpu" else None):
        alone = run(batch=False)
        in_batch = run(batch=True)
    assert alone == in_batch
    # The seed really drives a random choice: not simply the argmax every step.
    argmaxes = [random_logits(1, vocab_size, seed=100 + s).argmax().item() for s in range(6)]
    assert alone != argmaxes


@pytest.mark.parametrize("draw", DRAWS)
def test_all_rows_seeded_skips_the_default_rng(draw: str) -> None:
    logits = random_logits(3, 50, seed=3)
    generators = {row: torch.Generator().manual_seed(row) for row in range(3)}
    with torch.random.fork_rng(devices=[]):
        before = torch.random.get_rng_state()
        make_sampler(draw)(logits.clone(), make_metadata([1.0] * 3, generators=generators))
        assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize(
    ("temperature", "top_k", "threshold"),
    # Chi-square critical values with P(false failure) = 1e-5: df=3 -> 25.90, df=2 -> 23.03.
    [(1.0, None, 25.90), (2.0, 3, 23.03)],
)
@pytest.mark.parametrize("draw", DRAWS)
def test_sampled_frequencies_match_the_distribution(
    temperature: float, top_k: int | None, threshold: float, draw: str
) -> None:
    """20,000 rows of p = [0.5, 0.25, 0.15, 0.1]. Expected frequencies are p itself, or
    p ** (1 / T) renormalised over the top 3 with top_k 3 (the 4th must never appear). A correct
    sampler fails the chi-square test with probability 1e-5; the RNG is seeded, so it is
    deterministic anyway."""
    num_draws = 20_000
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log().repeat(num_draws, 1)
    metadata = make_metadata(
        [temperature] * num_draws, top_k=None if top_k is None else [top_k] * num_draws
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        sampled = make_sampler(draw)(logits, metadata).sampled_token_ids
    observed = torch.bincount(sampled, minlength=4).double()
    expected = probs.double() ** (1.0 / temperature)
    if top_k is not None:
        expected[top_k:] = 0.0
        assert observed[top_k:].sum().item() == 0
    expected = expected / expected.sum() * num_draws
    support = expected > 0
    chi_square = ((observed - expected)[support] ** 2 / expected[support]).sum().item()
    assert chi_square < threshold


@pytest.mark.parametrize("draw", DRAWS)
def test_min_tokens_forbids_stop_ids_for_greedy_and_random_rows(draw: str) -> None:
    eos, stop_id, num_reqs = 0, 3, 400
    logits = torch.zeros(num_reqs, 8)
    logits[:, eos] = 10.0
    logits[:, stop_id] = 9.0
    logits[:, 5] = 8.0
    temperature = [0.0, 0.0] + [1.0] * (num_reqs - 2)
    # Every row but row 1 is below min_tokens.
    blocked = {row: {eos, stop_id} for row in range(num_reqs) if row != 1}
    sampled = make_sampler(draw)(logits, make_metadata(temperature, min_tokens_stop_ids=blocked))
    tokens = sampled.sampled_token_ids.tolist()
    assert tokens[0] == 5
    assert tokens[1] == eos
    assert all(token not in (eos, stop_id) for token in tokens[2:])


def test_logit_bias_moves_the_greedy_pick() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    metadata = make_metadata([0.0, 0.0], logit_bias={0: {0: 2.5}, 1: {2: -1.5}})
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [0, 1]


def test_penalties_move_the_greedy_pick() -> None:
    vocab_size = 4
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0], [0.0, 2.0, 1.9, 0.0], [0.0, 2.0, 1.9, 0.0]])
    metadata = make_metadata(
        [0.0, 0.0, 0.0],
        # Row 0: repetition 1.1 on token 1 seen in the prompt; row 1: frequency 0.06 on two
        # outputs of token 1; row 2: nothing (token 1 is in its output but its penalties are off).
        penalties=([0.0, 0.0, 0.0], [0.0, 0.06, 0.0], [1.1, 1.0, 1.0]),
        prompt_token_ids=[[1, 3], [3], [3]],
        output_token_ids=[[], [1, 1], [1]],
        vocab_size=vocab_size,
    )
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [2, 2, 1]


def test_logprobs_are_taken_from_the_raw_logits() -> None:
    """Bias, penalties, temperature and top-k all act on the sample but not on the logprobs."""
    vocab_size, k = 30, 4
    logits = random_logits(3, vocab_size, seed=4)
    raw = torch.log_softmax(logits, dim=1)
    low_token = int(logits[0].argmin())
    metadata = make_metadata(
        [0.0, 1.0, 0.7],
        top_k=[0, 3, 0],
        penalties=([0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.5]),
        prompt_token_ids=[[1], [2, 3], [4]],
        output_token_ids=[[], [5], [6]],
        logit_bias={0: {low_token: 100.0}},
        max_num_logprobs=k,
        vocab_size=vocab_size,
    )
    output = Sampler()(logits.clone(), metadata)
    assert output.sampled_token_ids[0].item() == low_token
    result = output.logprobs
    assert result is not None
    assert result.token_ids.shape == (3, k + 1)
    assert torch.equal(result.token_ids[:, 0], output.sampled_token_ids)
    for row in range(3):
        order = sorted(range(vocab_size), key=lambda t: -raw[row, t].item())
        assert result.token_ids[row, 1:].tolist() == order[:k]
        sampled = output.sampled_token_ids[row].item()
        assert result.sampled_ranks[row].item() == order.index(sampled) + 1
        expected = [raw[row, t].item() for t in result.token_ids[row].tolist()]
        assert result.logprobs[row].tolist() == expected
    assert result.sampled_ranks[0].item() == vocab_size
    assert result.logprobs[0, 1].item() == raw[0].max().item()
    assert math.isclose(raw[0].exp().sum().item(), 1.0, rel_tol=1e-6)
