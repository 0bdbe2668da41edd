"""`octavo convert`: a GGUF -> a Hugging Face folder that transformers (and so vLLM) loads with
the numbers octavo computes with, and a float GGUF for llama.cpp.

The embedded model is dequantised once per module (seconds); its float32 and bfloat16 folders
are written from that one pass. Tiny GGUFs written here the way llama.cpp's converter writes
them check the q/k re-permutation and the config against the original transformers model, for
every architecture, in milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from octavo.model import convert
from octavo.model.config import ModelConfig
from octavo.model.loader import ModelLoadError, build_model, find_default_model, load_model
from octavo.model.loader.gguf import open_gguf_checkpoint

from .tiny import (
    PagedHarness,
    cpu_backend,
    float_weights,
    hf_logits,
    make_tiny_hf_model,
    write_tiny_gguf,
)

# Prompts of the embedded-model tests in test_models_vs_transformers.py (one chat, one plain).
PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2114, 28, 7018, 411, 407, 20486, 2],
    [1, 504, 3458, 282, 4649, 314],
]
TEXTS = ["The capital of France is", "  spaces,\ttabs\nand ünïcödé 🙂 <|im_end|> 1234567"]


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of ~100 tokens with special tokens and a chat template (milliseconds),
    standing in for the vocabulary the tiny GGUFs do not carry."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"])
    backend.train_from_iterator(["the cat sat on the mat", "a dog ran"], trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template="{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}",
    )


# ---------------------------------------------------------------------- tiny GGUFs


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 32}),
    ],
)
def test_tiny_gguf_round_trips_to_the_original_transformers_model(
    tmp_path, monkeypatch, arch, overrides
):
    """GGUF (llama.cpp layout, q/k permuted for Llama) -> folder: transformers loads it and
    computes the original model's logits; the weights are the originals bit for bit."""
    hf_model = make_tiny_hf_model(arch, seed=5, **overrides)
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_model, arch)
    monkeypatch.setattr(convert, "load_gguf_tokenizer", lambda source: _tiny_tokenizer())
    out = convert.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype="float32")
    assert out == tmp_path / "hf"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(loaded) is type(hf_model)
    expected_state = hf_model.state_dict()
    written = load_file(out / "model.safetensors")
    tied = bool(overrides.get("tie_word_embeddings"))
    assert set(written) == set(expected_state) - ({"lm_head.weight"} if tied else set())
    for name, tensor in written.items():
        assert torch.equal(tensor, expected_state[name]), name
    token_ids = list(range(3, 30))
    torch.testing.assert_close(
        hf_logits(loaded, token_ids), hf_logits(hf_model, token_ids), atol=1e-5, rtol=1e-5
    )


def test_config_json_resolves_back_to_the_same_model_config(tmp_path, monkeypatch):
    hf_model = make_tiny_hf_model("llama", seed=6)
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_model, "llama")
    monkeypatch.setattr(convert, "load_gguf_tokenizer", lambda source: _tiny_tokenizer())
    out = convert.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype="bfloat16")
    gguf_config, _ = open_gguf_checkpoint(tmp_path / "tiny.gguf")
    config_json = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert (config_json["torch_dtype"], config_json["model_type"]) == ("bfloat16", "llama")
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}
    resolved = ModelConfig.from_hf_config(config_json, generation)
    assert resolved == ModelConfig(**{**gguf_config.__dict__, "checkpoint_dtype": "bfloat16"})
    # Every tensor is bfloat16, rounded once from the float32 weights.
    for name, tensor in load_file(out / "model.safetensors").items():
        assert tensor.dtype == torch.bfloat16, name
    # The tokenizer files load as the tokenizer they came from.
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("the cat sat").input_ids == _tiny_tokenizer()("the cat sat").input_ids
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        == "<s>hi</s>"
    )


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
)
def test_rope_scaling_reaches_transformers(tmp_path, rope_scaling):
    """(The tiny GGUFs carry no RoPE scaling keys, so config.json is checked on its own.)"""
    hf_model = make_tiny_hf_model("llama", seed=9, rope_scaling=rope_scaling)
    hf_model.save_pretrained(tmp_path / "original")
    config = load_model(str(tmp_path / "original"), cpu_backend())[1]
    written = convert.hf_config_dict(config, "float32")
    (tmp_path / "config.json").write_text(json.dumps(written))
    reread = transformers.AutoConfig.from_pretrained(tmp_path)
    assert reread.rope_parameters == hf_model.config.rope_parameters
    assert ModelConfig.from_hf_config(written) == config


@pytest.mark.parametrize("dtype,gguf_dtype", [("bfloat16", 30), ("float16", 1)])
def test_float_gguf_holds_the_numbers_of_the_hf_folder(tmp_path, monkeypatch, dtype, gguf_dtype):
    """--format gguf keeps llama.cpp's layout and rounds like torch: octavo reading the float
    GGUF sees exactly the tensors of the HF folder of the same dtype."""
    import gguf

    hf_model = make_tiny_hf_model("llama", seed=7)
    write_tiny_gguf(
        tmp_path / "tiny.gguf",
        hf_model,
        "llama",
        {"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_1},
    )
    written = convert.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype, fmt="gguf")
    assert written == tmp_path / "out" / "model.gguf"
    reader = gguf.GGUFReader(written)
    types = {t.name: int(t.tensor_type) for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == gguf_dtype
    assert types["blk.0.attn_norm.weight"] == 0  # 1-D tensors stay F32, as llama.cpp keeps them
    assert reader.get_field("general.file_type").contents() == (32 if dtype == "bfloat16" else 1)
    assert reader.get_field("tokenizer.chat_template").contents() == (
        "{{ messages[0]['content'] }}"
    )
    monkeypatch.setattr(convert, "load_gguf_tokenizer", lambda source: _tiny_tokenizer())
    folder = convert.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype)
    _, from_gguf = open_gguf_checkpoint(written)
    from_folder = load_file(folder / "model.safetensors")
    for name, tensor in from_gguf:
        assert torch.equal(tensor, from_folder[name].float()), name


def test_bad_input_is_named(tmp_path):
    with pytest.raises(ValueError, match="dtype='int8'"):
        convert.convert_gguf(tmp_path / "x.gguf", tmp_path / "out", dtype="int8")
    with pytest.raises(ValueError, match="format='onnx'"):
        convert.convert_gguf(tmp_path / "x.gguf", tmp_path / "out", fmt="onnx")
    with pytest.raises(ModelLoadError, match="expected an existing .gguf file"):
        convert.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        convert.convert_gguf(tmp_path / "bad.gguf", tmp_path / "out")
    assert convert.main([str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2


def test_octavo_convert_command_writes_a_float_gguf(tmp_path):
    """`octavo convert` end to end (it runs the converter as its own process)."""
    write_tiny_gguf(tmp_path / "tiny.gguf", make_tiny_hf_model("qwen2", seed=8), "qwen2")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "octavo.entrypoints.cli",
            "convert",
            str(tmp_path / "tiny.gguf"),
            str(tmp_path / "out"),
            "--dtype",
            "float32",
            "--format",
            "gguf",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "out" / "model.gguf")
    _, original = open_gguf_checkpoint(tmp_path / "tiny.gguf")
    _, rewritten = open_gguf_checkpoint(tmp_path / "out" / "model.gguf")
    expected = dict(float_weights(original))
    for name, tensor in float_weights(rewritten):
        assert torch.equal(tensor, expected.pop(name)), name
    assert expected == {}


# ---------------------------------------------------------------------- the embedded model


def octavo_logits(model, backend, token_ids: list[int]) -> torch.Tensor:
    """(len(token_ids), vocab) logits of octavo's model, the whole sequence as one prefill."""
    return PagedHarness(model, backend, num_blocks=32, block_size=4).step({"r": token_ids})["r"]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The embedded GGUF dequantised once: its config, float32 weights, octavo model on them
    (the float reference of what octavo serves the GGUF with) and its backend, tokenizer, and
    the float32 / bfloat16 folders."""
    path = Path(find_default_model())
    config, weights = open_gguf_checkpoint(path)
    weights = dict(float_weights(weights))
    backend = cpu_backend()
    model = build_model(config, backend)
    model.load_weights(weights.items())
    backend.prepare_model(model)
    tokenizer = convert.load_gguf_tokenizer(path)
    folders = {}
    for dtype in ("float32", "bfloat16"):
        folders[dtype] = tmp_path_factory.mktemp(dtype)
        convert.write_hf_folder(config, weights.items(), tokenizer, folders[dtype], dtype)
    return config, weights, (model.eval(), backend), tokenizer, folders


@pytest.mark.slow
def test_embedded_folders_hold_the_gguf_weights(embedded):
    """float32: the dequantised GGUF tensors bit for bit; bfloat16: those, rounded once."""
    _, weights, _, _, folders = embedded
    f32 = load_file(folders["float32"] / "model.safetensors")
    bf16 = load_file(folders["bfloat16"] / "model.safetensors")
    assert set(f32) == set(bf16) == set(weights)
    assert "lm_head.weight" not in f32  # tied: transformers and vLLM tie it back
    for name, tensor in weights.items():
        assert torch.equal(f32[name], tensor), name
        assert torch.equal(bf16[name], tensor.to(torch.bfloat16)), name


@pytest.mark.slow
def test_embedded_float32_folder_in_transformers_matches_octavo_on_the_gguf(embedded):
    _, _, (model, backend), _, folders = embedded
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        folders["float32"], dtype=torch.float32
    ).eval()
    harness = PagedHarness(model, backend, num_blocks=16, block_size=4)
    out = harness.step({"a": PROMPTS[0], "b": PROMPTS[1]})
    for name, token_ids in zip("ab", PROMPTS):
        expected = hf_logits(hf_model, token_ids)
        # Same weights, different kernels: the bound of the embedded GGUF vs transformers test.
        torch.testing.assert_close(out[name], expected, atol=1e-3, rtol=1e-4)
        assert out[name].argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.slow
def test_embedded_bfloat16_folder_in_transformers_stays_close(embedded):
    """The bf16 folder loads in transformers as bf16; run in float32 (bf16 matmuls are emulated
    on CPUs without native bf16, and slow), its logits differ from octavo's float32 ones by the
    weights' rounding only: within 0.5 of logits that reach ~31 (measured 0.14), and 8
    greedy tokens equal octavo's up to a first divergence, where transformers' token is in
    octavo's top 5 (vLLM's rule)."""
    _, _, (model, backend), _, folders = embedded
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folders["bfloat16"]).eval()
    assert next(hf_model.parameters()).dtype == torch.bfloat16
    hf_model.float()
    prompt = PROMPTS[1]
    with torch.inference_mode():
        sequence = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[
            0
        ].tolist()
    reference = octavo_logits(model, backend, sequence)
    got = hf_logits(hf_model, sequence)
    assert (got - reference).abs().max().item() < 0.5
    for position in range(len(prompt), len(sequence)):
        top5 = reference[position - 1].topk(5).indices.tolist()
        if sequence[position] != top5[0]:
            assert sequence[position] in top5
            break


@pytest.mark.slow
def test_embedded_tokenizer_files_match_the_gguf_tokenizer(embedded):
    _, _, _, gguf_tokenizer, folders = embedded
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders["bfloat16"])
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert ids == gguf_tokenizer(text).input_ids
        assert tokenizer.decode(ids) == gguf_tokenizer.decode(ids)
    messages = [{"role": "user", "content": "Name three colors."}]
    assert tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.model_max_length) == (
        1,
        2,
        8192,
    )


@pytest.mark.slow
def test_octavo_serves_the_float32_folder_with_the_gguf_greedy_tokens(embedded):
    from octavo import LLM, SamplingParams

    _, _, (model, backend), tokenizer, folders = embedded
    llm = LLM(
        model=str(folders["float32"]), dtype="float32", max_model_len=256, kv_cache_tokens=512
    )
    prompt = "The capital of France is"
    output = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    # Greedy on the GGUF weights: prefill, then one decode step per token.
    harness = PagedHarness(model, backend, num_blocks=16, block_size=4)
    logits = harness.step({"r": tokenizer(prompt).input_ids})["r"]
    expected = []
    for _ in range(8):
        expected.append(int(logits[-1].argmax()))
        logits = harness.step({"r": expected[-1:]})["r"]
    assert list(output.token_ids) == expected


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_outtype_writes_a_quantized_gguf_octavo_computes_on(tmp_path, outtype):
    """--outtype q8_0 (llama.cpp's converter's flag): every matrix in Q8_0 blocks, rounded by
    gguf's quantizer from the source's weights, norms in F32; q4_k_m: each matrix in the type
    llama-quantize's rule gives it (Q4_K, Q6_K for the last layer's v and down and the tied
    embedding), rounded by octavo's K-quant quantizer; octavo loads either in those types."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader
    from gguf.quants import dequantize as deq

    from octavo.model.formats.ggml import quantize
    from octavo.model.loader.quantization import QuantizationPlan

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    hf_model = make_tiny_hf_model("llama", seed=9, tie_word_embeddings=True, **shape)
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_model, "llama")
    argv = [str(tmp_path / "tiny.gguf"), str(tmp_path / "out"), "--outtype", outtype]
    assert convert.main(argv) == 0
    plan = QuantizationPlan(outtype, 2, tied_embeddings=True)
    written = {t.name: t for t in GGUFReader(tmp_path / "out" / "model.gguf").tensors}
    source = {t.name: t for t in GGUFReader(tmp_path / "tiny.gguf").tensors}
    types = set()
    for name, tensor in written.items():
        original = np.asarray(source[name].data)
        if original.ndim == 2:
            qtype = plan.type_for(name, original.shape)
            assert tensor.tensor_type == qtype, name
            types.add(qtype.name)
            expected = deq(quantize(torch.from_numpy(original.copy()), qtype).blocks.numpy(), qtype)
            np.testing.assert_array_equal(deq(np.asarray(tensor.data), qtype), expected)
        else:
            assert tensor.tensor_type == Q.F32 and np.array_equal(tensor.data, original), name
    assert types == ({"Q8_0"} if outtype == "q8_0" else {"Q4_K", "Q6_K"})
    backend = cpu_backend()
    _, config = load_model(str(tmp_path / "out" / "model.gguf"), backend)
    assert set(config.weight_block_types) == types
    assert set(backend.weights_report["bytes_by_type"]) == types | {"float32"}
