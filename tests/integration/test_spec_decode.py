"""Speculative decoding on the embedded model: the same greedy text with and without it, for
each method (draft_model: the model less some layers as the draft), on prompts built so that
proposals are often accepted (a passage to repeat) and often rejected (free text), in one
mixed batch; penalties, logprobs, stop strings, max_tokens and n > 1 as without; seeded
sampling independent of the batch and of speculation; the metrics counted; structured outputs
as without (proposals cut where the grammar rejects); nothing leaked. The draft model also
through preemption and prefix hits.

The engines run the float reference (packed_max_rows=0: weights dequantized to float32, torch
matmuls). The packed GGML kernels quantize activations to 8 bits, so two equally valid orders
of the same sums (a verification step's k + 1 rows against a decode's 1, one attention kernel
against another) can round an activation to the next step and move logprobs by ~0.1 after a
few tokens: with them, greedy text with and without speculation parts at the first such near
tie (as it does between two attention backends without speculation)."""

from __future__ import annotations

import re

import pytest

from octavo import SamplingParams
from octavo.metrics.reader import Counter, Vector
from octavo.sampling_params import StructuredOutputsParams
from octavo.structured_output.grammar import GuidanceGrammar

from .utils import assert_no_leak, write_draft_model

pytestmark = pytest.mark.slow

PASSAGES = [
    "The river bends twice before it reaches the old mill, where the water turns the wheel "
    "and the miller grinds the wheat into flour for the village.",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.",
    "To reset the router, hold the button for ten seconds, wait for the light to blink, "
    "then release the button and wait two minutes.",
]
PROMPTS = [f"Repeat this text exactly.\nText: {p}\nRepeated: {p}\nRepeated:" for p in PASSAGES] + [
    "Once upon a time, in a small village by the sea,",
    "The three most important inventions of the nineteenth century were",
    "List five animals that live in the ocean:",
    "A good night's sleep is important because",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)
FLOAT = {"packed_max_rows": 0}
METHODS = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    },
    "suffix": {
        "method": "suffix",
        "num_speculative_tokens": 6,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 8,
    },
    # "model": the draft_dir fixture's folder.
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
}
# The embedded model's layers the draft model skips (of 30): it then proposes what the model
# says about a third of the time on PROMPTS (a draft of its first 12 layers: never; of 26: a
# fifth).
DRAFT_SKIPPED = range(12, 18)


def _spec_metrics(llm) -> dict[str, object]:
    return {
        m.name: m.values if isinstance(m, Vector) else m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode") and isinstance(m, (Counter, Vector))
    }


@pytest.fixture(scope="module")
def float_llm(make_llm):
    return make_llm(**FLOAT)


@pytest.fixture(scope="module")
def reference(float_llm):
    return float_llm.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory):
    return write_draft_model(tmp_path_factory.mktemp("draft"), DRAFT_SKIPPED)


def _config(method: str, draft_dir) -> dict[str, object]:
    config = dict(METHODS[method])
    if method == "draft_model":
        config["model"] = str(draft_dir)
    return config


@pytest.fixture(scope="module", params=list(METHODS))
def spec_llm(request, make_llm, draft_dir):
    return make_llm(**FLOAT, speculative_config=_config(request.param, draft_dir))


def _token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_text_is_the_same(spec_llm, reference) -> None:
    outputs = spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == _token_ids(reference)
    for out in outputs:
        # Logprobs of each emitted token, the emitted token among them.
        assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids) == 64
        for token_id, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
            assert token_id in entry
    metrics = _spec_metrics(spec_llm)
    drafts = metrics["vllm:spec_decode_num_drafts"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    # Proposals were often accepted and often rejected; the vector adds up.
    assert drafts > 20 and 0.2 * drafted < accepted < drafted
    assert sum(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == accepted
    assert_no_leak(spec_llm)


def test_sampling_features_work_as_without(spec_llm, float_llm) -> None:
    """Penalties change the greedy text the same way; stop strings cut it, max_tokens caps it,
    n > 1 gives n streams."""
    prompt = PROMPTS[:1]
    penalised = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2, repetition_penalty=1.3
    )
    assert _token_ids(spec_llm.generate(prompt, penalised, use_tqdm=False)) == _token_ids(
        float_llm.generate(prompt, penalised, use_tqdm=False)
    )
    stop = spec_llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=64, stop=["mill"]), use_tqdm=False
    )[0].outputs[0]
    assert stop.finish_reason == "stop" and "mill" not in stop.text and stop.text
    for max_tokens in (1, 2, 5, 7):
        capped = spec_llm.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
        )[0].outputs[0]
        assert len(capped.token_ids) == max_tokens and capped.finish_reason == "length"
    several = spec_llm.generate(
        prompt, SamplingParams(temperature=0.8, n=3, max_tokens=16, seed=5), use_tqdm=False
    )[0]
    assert len(several.outputs) == 3 and all(len(o.token_ids) == 16 for o in several.outputs)
    assert_no_leak(spec_llm)


def test_seeded_sampling_does_not_depend_on_the_batch(spec_llm, float_llm) -> None:
    """Nor on speculation: the generator is wound back to the draws of the emitted tokens."""
    seeded = SamplingParams(temperature=0.7, seed=11, max_tokens=40, ignore_eos=True)
    alone = spec_llm.generate(PROMPTS[1:2], seeded, use_tqdm=False)[0].outputs[0].token_ids
    without = float_llm.generate(PROMPTS[1:2], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == without
    others = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    batch = spec_llm.generate(PROMPTS, [others, seeded, *[others] * 6], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert_no_leak(spec_llm)


def test_structured_outputs_speculate_and_give_the_same_text(
    spec_llm, float_llm, monkeypatch
) -> None:
    """A grammar that forbids the letter y, on a prompt whose passage the model repeats: the
    proposals follow the passage and are cut at " yellow", and every position is sampled
    under the grammar's mask after the proposals before it, so the greedy text is the one
    the grammar gives without speculation, beside unconstrained requests in the same batch."""
    pattern = "[A-Za-xz ,.]{1,120}"
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=48,
        structured_outputs=StructuredOutputsParams(regex=pattern),
    )
    params = [GREEDY, GREEDY, constrained, GREEDY]
    before = _spec_metrics(spec_llm)["vllm:spec_decode_num_drafts"]
    outputs = spec_llm.generate(PROMPTS[:4], params, use_tqdm=False)
    expected = float_llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert _token_ids(outputs) == _token_ids(expected)
    text = outputs[2].outputs[0].text
    assert re.fullmatch(pattern, text) and "Red, orange," in text, text
    assert _spec_metrics(spec_llm)["vllm:spec_decode_num_drafts"] > before
    checked: list[tuple[int, int]] = []  # (proposed, kept) of each proposal the grammar saw
    num_valid = GuidanceGrammar.num_valid

    def spy(self, token_ids):
        checked.append((len(token_ids), num_valid(self, token_ids)))
        return checked[-1][1]

    monkeypatch.setattr(GuidanceGrammar, "num_valid", spy)
    before = _spec_metrics(spec_llm)["vllm:spec_decode_num_drafts"]
    alone = spec_llm.generate(PROMPTS[2:3], constrained, use_tqdm=False)[0].outputs[0]
    assert list(alone.token_ids) == _token_ids(expected)[2]
    assert _spec_metrics(spec_llm)["vllm:spec_decode_num_drafts"] > before
    assert any(kept < proposed for proposed, kept in checked), checked  # " yellow" cut
    assert any(kept > 0 for _, kept in checked), checked
    assert_no_leak(spec_llm)


def test_draft_model_through_preemption_and_prefix_hits(make_llm, draft_dir, reference) -> None:
    """The draft's cache follows the target's block ids: a pool small enough that requests
    are preempted and recomputed, then the same prompts again (prefix hits on blocks the draft
    filled for other requests), give the same greedy text; the memory budget pays for both
    caches, and the start-up capacity counts the draft's."""
    config = _config("draft_model", draft_dir)
    llm = make_llm(**FLOAT, speculative_config=config, kv_cache_tokens=512)
    engine = llm.llm_engine
    for _ in range(2):
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert _token_ids(outputs) == _token_ids(reference)
        assert_no_leak(llm)
    assert engine.scheduler.num_preemptions > 0
    assert engine.make_stats().prefix_cache_hits > 0
    metrics = _spec_metrics(llm)
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    cache = engine.config.cache
    assert 0 < cache.draft_bytes_per_token < cache.bytes_per_token
    budget = 64 << 20
    sized = make_llm(
        **FLOAT, speculative_config=config, kv_cache_tokens=None, kv_cache_memory_bytes=budget
    )
    assert sized.llm_engine.config.cache.num_blocks == budget // (
        (cache.bytes_per_token + cache.draft_bytes_per_token) * cache.block_size
    )


def test_draft_model_refused_where_it_cannot_work(make_llm, tmp_path) -> None:
    """A draft with another vocabulary, or tensor parallelism, is refused at start-up naming
    why."""
    from tests.model.tiny import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path, "llama")
    config = {"model": str(tmp_path), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(**FLOAT, speculative_config=config)
