"""LLM.beam_search (vLLM's algorithm on top of the engine) against transformers.

Two references, because the two algorithms are not the same one:

- transformers' own beam search (`model.generate(num_beams=k, num_return_sequences=k,
  do_sample=False)`), where the algorithms provably agree: no beam can end early (octavo with
  ignore_eos, transformers with no EOS token), so both keep, each step, the k best
  continuations by cumulative logprob (transformers' top 2k over all beams then its k
  unfinished; vLLM's top 2k per beam then its k best: the same k) and return the k beams of
  max_tokens tokens best first. length_penalty then divides every final score by the same
  length, so it changes no order: the test checks it is reported consistently, not that it
  ranks.
- where EOS ends beams, the algorithms differ by design (vLLM 0.32's, which octavo follows):
  vLLM's length counts the prompt's tokens (transformers' only the generated ones, EOS
  included), vLLM sets aside every EOS candidate of a beam's top 2k (transformers only those
  among the k best of the step), keeps them all to the end, and runs to max_tokens
  (transformers stops by its `early_stopping` heuristic). There the reference is vLLM's
  algorithm written out below over transformers' logits (a full forward per beam per step,
  no cache), for several beam widths and length penalties.

The tiny model's EOS row of the output projection is scaled up so that EOS is a candidate
often enough for beams to end early (checked: the searches with EOS finish some beams "stop").
"""

from __future__ import annotations

import math

import pytest
import torch

from octavo.beam_search import BeamSearchOutput, get_beam_search_score
from octavo.sampling_params import BeamSearchParams

from ..model.test_families_engine import _save_tokenizer
from ..model.tiny import save_tiny_checkpoint

pytestmark = pytest.mark.slow

EOS = 2  # the test tokenizer's eos_token ("t2")
SETTINGS = dict(dtype="float32", kv_cache_tokens=2048, block_size=4, max_model_len=128)
PROMPTS = [[1, 17, 90, 33, 5], [1, 200, 4], [1, 64, 64, 128, 7, 9, 250]]


def save_beam_model(folder):
    """Save a tiny llama whose EOS logit swings widely (and its tokenizer) to `folder`;
    returns the transformers model."""
    model = save_tiny_checkpoint(folder, "llama", seed=3)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 4.0
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, transformers model) of save_beam_model's."""
    folder = tmp_path_factory.mktemp("beam")
    return folder, save_beam_model(folder)


@pytest.fixture(scope="module")
def llm(tiny):
    from octavo import LLM

    return LLM(str(tiny[0]), **SETTINGS)


def _hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def reference_beam_search(model, prompt, k, max_tokens, length_penalty, ignore_eos):
    """vLLM 0.32's offline beam search, step by step, over transformers' logits."""
    beams = [(list(prompt), 0.0)]
    completed = []
    for _ in range(max_tokens):
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            top = torch.topk(_hf_logprobs(model, tokens), 2 * k)
            for logprob, token_id in zip(top.values.tolist(), top.indices.tolist()):
                child = (tokens + [token_id], cum + logprob)
                if token_id == EOS and not ignore_eos:
                    completed.append(child)
                else:
                    candidates.append(child)
        candidates.sort(key=lambda beam: -beam[1])
        beams = candidates[:k]

    def score(beam):
        return get_beam_search_score(beam[0], beam[1], () if ignore_eos else EOS, length_penalty)

    return sorted(completed + beams, key=score, reverse=True)[:k]


def _hf_beam_search(model, prompt, k, max_tokens, length_penalty):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    # num_beams=1 is greedy search there, which reports no sequence scores.
    scores = out.sequences_scores.tolist() if k > 1 else None
    return out.sequences.tolist(), scores


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_without_eos_the_beams_are_transformers_beams(tiny, llm, k, length_penalty):
    _, model = tiny
    max_tokens = 6
    params = BeamSearchParams(
        beam_width=k, max_tokens=max_tokens, ignore_eos=True, length_penalty=length_penalty
    )
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(isinstance(o, BeamSearchOutput) for o in outputs)
    for prompt, output in zip(PROMPTS, outputs):
        hf_sequences, hf_scores = _hf_beam_search(model, prompt, k, max_tokens, length_penalty)
        assert [beam.tokens for beam in output.sequences] == hf_sequences
        for beam, hf_score in zip(output.sequences, hf_scores or [None] * k):
            assert beam.finish_reason == "length"
            assert len(beam.logprobs) == max_tokens
            if hf_score is None:
                continue
            # transformers reports cum_logprob / generated length ** length_penalty.
            assert beam.cum_logprob / max_tokens**length_penalty == pytest.approx(
                hf_score, abs=1e-4
            )


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0, -1.0])
def test_with_eos_the_beams_are_vllms_algorithm_over_transformers_logits(
    tiny, llm, k, length_penalty
):
    _, model = tiny
    max_tokens = 8
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    num_stopped = 0
    for prompt, output in zip(PROMPTS, outputs):
        expected = reference_beam_search(
            model, prompt, k, max_tokens, length_penalty, ignore_eos=False
        )
        assert [beam.tokens for beam in output.sequences] == [tokens for tokens, _ in expected]
        for beam, (_, cum) in zip(output.sequences, expected):
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert beam.finish_reason == ("stop" if beam.tokens[-1] == EOS else "length")
            num_stopped += beam.finish_reason == "stop"
        scores = [
            get_beam_search_score(b.tokens, b.cum_logprob, EOS, length_penalty)
            for b in output.sequences
        ]
        assert scores == sorted(scores, reverse=True)
    if k > 1:
        assert num_stopped > 0, "no beam ended on EOS: the test would not exercise it"


def test_text_prompts_width_limits_and_the_pool(tiny, llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    (by_text,) = llm.beam_search("t5 t33 t90", params)
    prompt_ids = llm.get_tokenizer()("t5 t33 t90").input_ids
    (by_ids,) = llm.beam_search([{"prompt_token_ids": prompt_ids}], params)
    assert [b.tokens[: len(prompt_ids)] for b in by_text.sequences] == [prompt_ids] * 2
    assert [b.tokens for b in by_text.sequences] == [b.tokens for b in by_ids.sequences]
    # vLLM's offline text: the whole beam, prompt included, decoded.
    assert by_text.sequences[0].text == llm.get_tokenizer().decode(
        by_text.sequences[0].tokens, skip_special_tokens=True
    )
    assert "t5 t33 t90" in by_text.sequences[0].text
    # One prompt at a time gives what all at once gives.
    together = llm.beam_search(["t5 t33 t90", "t200 t4"], params)
    one_by_one = llm.beam_search(["t5 t33 t90", "t200 t4"], params, concurrency_limit=1)
    assert [[b.tokens for b in o.sequences] for o in together] == [
        [b.tokens for b in o.sequences] for o in one_by_one
    ]
    # Every step's requests finished: no block is held by a dropped (or kept) beam.
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    stats = engine.make_stats()
    assert stats.num_free_blocks == stats.num_blocks
    with pytest.raises(ValueError, match="beam_width=11"):
        llm.beam_search(["t5"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search(["t5"], BeamSearchParams(beam_width=2, max_tokens=200))
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    assert math.isfinite(by_text.sequences[0].cum_logprob)
