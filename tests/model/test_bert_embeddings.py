"""BERT as an embedding model: octavo's encoder (model/bert.py) against sentence-transformers'
encode (mean pooling from the folder's modules) and transformers' BertModel ([CLS] pooling,
the architecture's default), several prompts of different lengths per call, each prompt whole
in one step, every block back in the pool."""

from __future__ import annotations

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from octavo import LLM
from octavo.config import EngineArgs

sentence_transformers = pytest.importorskip("sentence_transformers")
st_models = pytest.importorskip("sentence_transformers.models")

SETTINGS = dict(dtype="float32", kv_cache_tokens=512, block_size=4)
TEXTS = ["t5 t9 t33 t10 t7", "t40 t41", "t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13 t14 t15 t16"]


def _save_bert_tokenizer(folder) -> None:
    """A word-level vocabulary t0..t255 that wraps each text in [CLS] (t1) ... [SEP] (t2), as
    BERT's tokenizer does, with t0 as its padding."""
    vocab = {f"t{i}": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="t1 $A t2", special_tokens=[("t1", 1), ("t2", 2)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", cls_token="t1", sep_token="t2"
    ).save_pretrained(folder)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny random transformers BertModel saved with its tokenizer (architectures
    BertModel), and the same wrapped as a sentence-transformers model with mean pooling."""
    root = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(root / "hf")
    _save_bert_tokenizer(root / "hf")
    word = st_models.Transformer(str(root / "hf"))
    pooling = st_models.Pooling(config.hidden_size, pooling_mode="mean")
    st = sentence_transformers.SentenceTransformer(modules=[word, pooling], device="cpu")
    st.save(str(root / "st"))
    return root, model, st


def _relative_error(got: list[float], want: torch.Tensor) -> float:
    return ((torch.tensor(got) - want).abs().max() / want.abs().max()).item()


def _assert_pool_free(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_matches_sentence_transformers_mean_pooling(bert) -> None:
    root, _, st = bert
    want = st.encode(TEXTS, convert_to_tensor=True)
    llm = LLM(str(root / "st"), **SETTINGS)
    config = llm.llm_engine.config
    assert (config.pooler.pooling_type, config.pooler.use_activation) == ("MEAN", False)
    assert not config.scheduler.enable_chunked_prefill and not config.cache.enable_prefix_caching
    outputs = llm.embed(TEXTS, use_tqdm=False)
    for output, vector in zip(outputs, want):
        assert output.prompt_token_ids[0] == 1 and output.prompt_token_ids[-1] == 2
        assert _relative_error(output.outputs.embedding, vector) < 1e-4
    _assert_pool_free(llm)


def test_cls_pooling_by_default_each_prompt_whole(bert) -> None:
    """A bare BertModel folder pools [CLS], normalized; with a step budget of max_model_len
    the prompts that do not fit together run in later steps, never split."""
    root, hf, _ = bert
    llm = LLM(str(root / "hf"), max_model_len=32, max_num_batched_tokens=32, **SETTINGS)
    assert llm.llm_engine.config.pooler.pooling_type == "CLS"
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "hf")
    outputs = llm.embed(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, outputs):
        ids = tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            hidden = hf(**ids).last_hidden_state[0, 0]
        assert output.prompt_token_ids == ids["input_ids"][0].tolist()
        want = torch.nn.functional.normalize(hidden, dim=-1)
        assert _relative_error(output.outputs.embedding, want) < 1e-4
    _assert_pool_free(llm)


def test_a_step_budget_below_max_model_len_is_refused(bert) -> None:
    root, _, _ = bert
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(root / "hf"), max_model_len=48, max_num_batched_tokens=16, **SETTINGS)
    with pytest.raises(ValueError, match="no language-model head"):
        LLM(str(root / "hf"), runner="generate", **SETTINGS)
    assert EngineArgs(model=str(root / "hf")).runner == "auto"
