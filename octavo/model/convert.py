"""`octavo convert`: a GGUF file -> a Hugging Face folder, or a GGUF file of plain float tensors.

Owns writing what other engines need to serve the weights octavo serves: `config.json` (the
transformers fields of our ModelConfig), `generation_config.json`, `model.safetensors`, and the
tokenizer files (`tokenizer.json`, `tokenizer_config.json` with the chat template,
`special_tokens_map.json`) from the tokenizer transformers builds out of the GGUF metadata.
Weights come from octavo's own GGUF loader, already dequantised and in Hugging Face layout (the
loader undoes llama.cpp's q/k row permutation), so the folder holds exactly the numbers octavo
computes with, rounded once to the requested dtype. `--format gguf` instead rewrites the GGUF
itself with float tensors (for llama.cpp, which wants its own layout back).

Runs as its own program (`python -m octavo.model.convert`, which `octavo convert` starts) so that
the CLI stays off model code. Must not know requests, engines or servers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file
from torch import Tensor

from octavo.model.arch import get_spec
from octavo.model.config import ModelConfig
from octavo.model.formats.ggml import QuantizedTensor
from octavo.model.formats.ggml import quantize as quantize_matrix
from octavo.model.loader.errors import ModelLoadError
from octavo.model.loader.gguf import open_gguf_checkpoint
from octavo.model.loader.quantization import PLANS, QuantizationPlan

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FORMATS = ("hf", "gguf")

# generation_config.json key for each SamplingParams default (ModelConfig keeps vLLM's names).
_GENERATION_KEYS = {"max_tokens": "max_new_tokens"}
# dtype -> (GGUF tensor type, GGUF file type) for --format gguf; a block type or a mix quantizes
# the matrices by its plan (loader/quantization.py; None here: the plan's types).
_GGUF_TYPES = {
    "bfloat16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "float16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "float32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "q8_0": (None, LlamaFileType.MOSTLY_Q8_0),
    "q6_k": (None, LlamaFileType.MOSTLY_Q6_K),
    "q5_k": (None, LlamaFileType.MOSTLY_Q5_K_S),
    "q5_1": (None, LlamaFileType.MOSTLY_Q5_1),
    "q5_0": (None, LlamaFileType.MOSTLY_Q5_0),
    "q4_k": (None, LlamaFileType.MOSTLY_Q4_K_S),
    "q4_1": (None, LlamaFileType.MOSTLY_Q4_1),
    "q4_0": (None, LlamaFileType.MOSTLY_Q4_0),
    "q4_k_m": (None, LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k_m": (None, LlamaFileType.MOSTLY_Q5_K_M),
}
# --outtype (llama.cpp's converter's spelling) -> the GGUF type key above.
OUTTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"} | {name: name for name in PLANS}


def convert_gguf(
    source: str | Path, out_dir: str | Path, dtype: str = "bfloat16", fmt: str = "hf"
) -> Path:
    """Convert the GGUF file `source` into `out_dir` (created if missing; files of the same
    names are overwritten). Returns the folder for `fmt="hf"`, the written `model.gguf` for
    `fmt="gguf"`. Raises ValueError for an unknown dtype or format and ModelLoadError for a
    file octavo cannot load or a model transformers cannot describe."""
    allowed = _GGUF_TYPES if fmt == "gguf" else DTYPES
    if dtype not in allowed:
        raise ValueError(f"dtype={dtype!r} is not supported (choose from {', '.join(allowed)}).")
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not supported (choose from {', '.join(FORMATS)}).")
    source, out = Path(source), Path(out_dir)
    if not source.is_file() or source.suffix != ".gguf":
        raise ModelLoadError(f"{source}: expected an existing .gguf file.")
    config, weights = open_gguf_checkpoint(source)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "gguf":
        return write_float_gguf(source, out / "model.gguf", dtype)
    write_hf_folder(config, weights, load_gguf_tokenizer(source), out, dtype)
    return out


def write_hf_folder(
    config: ModelConfig,
    weights: Iterable[tuple[str, Tensor | QuantizedTensor]],
    tokenizer: Any,
    out: Path,
    dtype: str,
) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer files of
    one model into the existing folder `out`. `weights` are HF-named tensors in HF layout (what
    the loaders yield; GGML blocks are dequantized); each is cast to `dtype` as it arrives, so
    memory holds one copy."""
    (out / "config.json").write_text(_dump(hf_config_dict(config, dtype)))
    (out / "generation_config.json").write_text(_dump(generation_config_dict(config)))
    target = DTYPES[dtype]
    renames = get_spec(config.architecture).hf_renames
    tensors = {
        _checkpoint_name(name, renames): (
            t.dequantize(target) if isinstance(t, QuantizedTensor) else t.to(target)
        ).contiguous()
        for name, t in weights
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer_files(tokenizer, out, config.max_position_embeddings)


def _checkpoint_name(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """octavo's module name -> the architecture's checkpoint name (ArchSpec.hf_renames
    undone, last first)."""
    for old, new in reversed(renames):
        name = name.replace(new, old)
    return name


def hf_config_dict(config: ModelConfig, dtype: str) -> dict[str, Any]:
    """config.json for `config` in the transformers 4 layout (`rope_theta`, `rope_scaling`,
    `torch_dtype`), which transformers 5 and vLLM read as well. Raises ModelLoadError where
    transformers has no field for what the model does."""
    try:
        spec = get_spec(config.architecture)
        extras = spec.hf_config_extras(config)
    except ValueError as exc:
        raise ModelLoadError(f"cannot write a config.json: {exc}") from None
    hf: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": spec.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _eos_value(config.eos_token_ids),
    }
    hf.update(extras)
    return hf


def generation_config_dict(config: ModelConfig) -> dict[str, Any]:
    """generation_config.json: bos/eos (what HF's generate stops on) and the sampling defaults
    the model ships, under their transformers names."""
    generation: dict[str, Any] = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _eos_value(config.eos_token_ids),
    }
    for field, value in config.sampling_defaults:
        generation[_GENERATION_KEYS.get(field, field)] = value
    return generation


def load_gguf_tokenizer(source: Path) -> Any:
    """The fast tokenizer transformers builds from the GGUF's vocabulary, merges and template
    (the same one octavo serves the GGUF with). Raises ModelLoadError if it cannot."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as exc:  # transformers raises many types; one message names the file
        raise ModelLoadError(f"{source}: cannot build a tokenizer ({exc}).") from exc
    finally:
        hf_logging.set_verbosity(previous)


def save_tokenizer_files(tokenizer: Any, out: Path, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json, written by hand
    rather than with save_pretrained: transformers 5 names its own backend class and moves the
    chat template to a separate file, which older transformers (vLLM pins one) cannot read.
    `PreTrainedTokenizerFast` over tokenizer.json loads the same in transformers 4 and 5."""
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    special = {
        key: str(value)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (value := getattr(tokenizer, key, None)) is not None
    }
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": bool(tokenizer.clean_up_tokenization_spaces),
    }
    if tokenizer.chat_template:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(_dump(tokenizer_config))
    (out / "special_tokens_map.json").write_text(_dump(special))


def copy_gguf_metadata(
    reader: GGUFReader, writer: GGUFWriter, skip_prefixes: tuple[str, ...] = ()
) -> None:
    """Every key/value of `reader` (the tokenizer included) into `writer`, but the header's
    own (GGUF.*), the architecture and file type (the writer sets those) and keys starting
    with `skip_prefixes`."""
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", *skip_prefixes)) or field.name in (
            "general.architecture",
            "general.file_type",
        ):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)


def write_float_gguf(source: Path, target: Path, dtype: str) -> Path:
    """Rewrite `source` as `target` with every tensor dequantised to `dtype` (a _GGUF_TYPES
    key): metadata (the tokenizer included), names and llama.cpp's layout are kept. 1-D tensors
    (norms, biases) are stored as F32, as llama.cpp's own converter leaves them, but hold
    `dtype`'s values. Rounding to bf16/f16 is round-to-nearest-even, the same as torch's cast,
    so this file and the HF folder of the same dtype hold identical numbers. For a block type
    or a mix, each matrix is quantized to the type its plan gives it (loader/quantization.py)
    and every other tensor is exact F32."""
    reader = GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    writer = GGUFWriter(str(target), arch)
    copy_gguf_metadata(reader, writer)
    tensor_type, file_type = _GGUF_TYPES[dtype]
    writer.add_file_type(file_type)
    plan = None
    if tensor_type is None:
        names = [tensor.name for tensor in reader.tensors]
        layers = 1 + max((int(n.split(".")[1]) for n in names if n.startswith("blk.")), default=-1)
        plan = QuantizationPlan(dtype, layers, tied_embeddings="output.weight" not in names)
    for tensor in reader.tensors:
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        array = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)
        if plan is not None:
            qtype = plan.type_for(tensor.name, shape)
            if qtype is None:  # a vector, or rows that are not whole blocks: exact F32
                writer.add_tensor(tensor.name, np.ascontiguousarray(array, dtype=np.float32))
            else:
                blocks = quantize_matrix(torch.from_numpy(array.copy()), qtype).blocks.numpy()
                writer.add_tensor(tensor.name, blocks, raw_dtype=qtype)
        elif tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, np.ascontiguousarray(array, dtype=np.float32))
        elif len(shape) == 1:
            # Stored as F32 but rounded like the rest, so every engine sees the same numbers.
            rounded = dequantize(quantize(array, tensor_type), tensor_type)
            writer.add_tensor(tensor.name, np.ascontiguousarray(rounded, dtype=np.float32))
        else:
            writer.add_tensor(tensor.name, quantize(array, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


# -------------------------------------------------------------------- command line


def add_convert_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", metavar="GGUF", help="the .gguf file to convert")
    parser.add_argument("out_dir", metavar="OUTDIR", help="folder to write (created if missing)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=list(DTYPES),
        help="dtype of the written weights (default: bfloat16)",
    )
    parser.add_argument(
        "--format",
        dest="fmt",
        default="hf",
        choices=list(FORMATS),
        help="hf: config.json + model.safetensors + tokenizer files; "
        "gguf: OUTDIR/model.gguf with float tensors (for llama.cpp)",
    )
    parser.add_argument(
        "--outtype",
        choices=list(OUTTYPES),
        help="write OUTDIR/model.gguf with its matrices in this type (llama.cpp's converter's "
        "flag; q8_0 ... q4_0 quantize with llama.cpp's reference rounding, q6_k, q5_k, q4_k "
        "and the mixes q4_k_m, q5_k_m with octavo's K-quant quantizer); implies "
        "--format gguf and replaces --dtype",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="octavo convert", description="GGUF -> Hugging Face folder (or float GGUF)"
    )
    add_convert_args(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
    )
    start_s = time.perf_counter()
    if ns.outtype is not None:
        ns.dtype, ns.fmt = OUTTYPES[ns.outtype], "gguf"
    try:
        written = convert_gguf(ns.gguf, ns.out_dir, ns.dtype, ns.fmt)
    except (ValueError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logger.info(
        "wrote %s (%s, %s) in %.1f s", written, ns.fmt, ns.dtype, time.perf_counter() - start_s
    )
    print(written)
    return 0


# -------------------------------------------------------------------- helpers


def _eos_value(eos_token_ids: tuple[int, ...]) -> int | list[int] | None:
    if not eos_token_ids:
        return None
    return eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids)


def _dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    sys.exit(main())
