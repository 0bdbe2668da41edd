"""An engine with no model, for tests of what the engine does rather than what the model
computes: the shared MockRunner (octavo/core/mock_runner.py) behind a real LLMEngine, and a
word-level tokenizer whose tokens are whole words, so texts and stop strings read plainly.

`mock_llm(...)` builds an offline LLM over it in milliseconds. The mock model writes SCRIPT's
words in order (greedy) or drawn by each request's seed; see MockRunner.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from octavo import LLM
from octavo.config import CacheConfig, EngineConfig, SchedulerConfig
from octavo.core.mock_runner import MockRunner
from octavo.engine.llm_engine import LLMEngine

SPECIAL = ["<unk>", "<s>", "</s>"]
WORDS = (
    "the cat sat on a mat and then it ran to see dog who was by door "
    "one two three four five six seven eight nine ten"
).split()
VOCAB = SPECIAL + WORDS
EOS_TOKEN_ID = VOCAB.index("</s>")
# What the mock model writes: "the cat sat on a mat and then it ran to see the dog ..."
SCRIPT = [VOCAB.index(w) for w in "the cat sat on a mat and then it ran to see the dog".split()]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace-split words of VOCAB, decoded with single spaces between them."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def mock_llm(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    answer_lens: dict[str, int] | None = None,
    **scheduler: Any,
) -> LLM:
    """An LLM whose engine runs the MockRunner over a pool of num_blocks x block_size tokens.
    `scheduler` takes SchedulerConfig's other fields (admission, long_prefill_token_threshold,
    ...)."""
    config = EngineConfig(
        model="mock",
        served_model_name="mock",
        dtype="float32",
        dtype_reason="a mock model",
        device="cpu",
        seed=0,
        cache=CacheConfig(block_size, num_blocks),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, **scheduler),
    )
    runner = MockRunner(len(VOCAB), EOS_TOKEN_ID, script=SCRIPT, answer_lens=answer_lens)
    llm = LLM.__new__(LLM)
    llm._start(LLMEngine(config, runner, word_tokenizer(), (EOS_TOKEN_ID,)))
    return llm


def text_of(token_ids: list[int]) -> str:
    return " ".join(VOCAB[t] for t in token_ids)
