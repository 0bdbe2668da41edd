"""The embedded model's greedy tokens equal transformers' greedy tokens for the same weights
(transformers loading the same GGUF, both in float32), token for token: octavo with its weights
dequantized for the matmuls (packed_max_rows=0), as transformers dequantizes them at load.
tests/model/test_quantized.py holds the block kernels' path to this one."""

from __future__ import annotations

import os

import pytest
import torch

from octavo import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Here is a list of the planets of the solar system:",
    "def quicksort(arr):",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def float_llm(make_llm):
    return make_llm(packed_max_rows=0)


@pytest.fixture(scope="module")
def hf_model(float_llm):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = os.path.split(float_llm.llm_engine.config.model)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


def _hf_greedy(model, token_ids: list[int], num_tokens: int) -> list[int]:
    generated = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids]), use_cache=True)
        for _ in range(num_tokens):
            next_id = int(out.logits[0, -1].argmax())
            generated.append(next_id)
            out = model(
                input_ids=torch.tensor([[next_id]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return generated


def test_greedy_tokens_match_transformers(float_llm, hf_model) -> None:
    llm = float_llm
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode(p, add_special_tokens=False) if p.startswith("<|") else tokenizer.encode(p)
        for p in PROMPTS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    theirs = [_hf_greedy(hf_model, p, NUM_TOKENS) for p in prompts]
    for prompt, a, b in zip(PROMPTS, ours, theirs):
        assert a == b, f"divergence for {prompt!r}:\n octavo {a}\n hf     {b}"
