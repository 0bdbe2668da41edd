"""The embedded model as bfloat16 under `--dtype auto` on a CPU with bfloat16 dot products
(AVX512-BF16 or AMX): every matmul of up to 4096 rows on the weights' tile-order copy (x
rounded to bfloat16, float32 sums), prompt attention on bfloat16 products, a bfloat16 cache.
As in test_engine_invariance, greedy output must not depend on how the engine ran a prompt
(alone, in a batch, chunked, after a prefix hit, after a preemption), and nothing may leak;
and it stays the float32 products' output up to near-ties."""

from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.model.backends import select
from octavo.model.cpu import build, ops
from octavo.model.cpu.calibration import MatmulCalibration

from .test_engine_invariance import OTHERS, PROMPT
from .utils import assert_greedy_agrees, assert_no_leak, write_draft_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (build.load() and ops.bf16_tiles_available()),
        reason="no bfloat16 dot products on this CPU (avx512_bf16 in /proc/cpuinfo)",
    ),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)


class _TilesEverywhere(MatmulCalibration):
    """Nothing timed: the tiles take every matmul of 1-4096 rows (the panels none, and no
    oneDNN copy), whichever is faster on this machine, so that the tests run that path."""

    def __init__(self, fixed_rows: int | None = None) -> None:
        super().__init__()

    def packed_max_rows(self, weight, packed) -> int:
        return 0

    def onednn_faster(self, weight, onednn_weight) -> bool:
        return False

    def bf16_tiles_max_rows(self, fmt) -> int:
        return 4096

    def panels_before_tiles(self, fmt) -> int:
        return 0


@pytest.fixture(scope="module")
def make_bf16(tmp_path_factory):
    # The whole model (no layer skipped), its weights in bfloat16.
    folder = write_draft_model(tmp_path_factory.mktemp("bf16") / "model", skipped=range(0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(select, "MatmulCalibration", _TilesEverywhere)

        def make(**overrides) -> LLM:
            settings = dict(
                model=str(folder),
                dtype="auto",
                kv_cache_dtype="bfloat16",
                max_model_len=512,
                kv_cache_tokens=8192,
                block_size=16,
                seed=0,
            )
            settings.update(overrides)
            return LLM(**settings)

        yield make


@pytest.fixture(scope="module")
def bf16_llm(make_bf16) -> LLM:
    return make_bf16()


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_the_engine_runs_the_bf16_products(bf16_llm) -> None:
    choices = bf16_llm.llm_engine.config.backend_choices
    assert choices["compute_dtype"] == "float32" and choices["weight_dtype"] == "bfloat16"
    assert choices["weights"]["tiles_bytes"] > 0
    assert choices["prefill_attention"].startswith(("amx_tiles", "avx512_bf16"))
    assert choices["decode_attention"].startswith("avx512_bf16")
    assert choices["fused_decode_layer"] == "on"


def test_alone_in_a_batch_chunked_and_after_a_prefix_hit(make_bf16, bf16_llm) -> None:
    alone = _tokens(bf16_llm.generate([PROMPT], GREEDY, use_tqdm=False))[0]
    batch = bf16_llm.generate(OTHERS[:8] + [PROMPT] + OTHERS[8:], GREEDY, use_tqdm=False)
    assert _tokens(batch)[8] == alone
    chunked = make_bf16(max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _tokens(chunked.generate([PROMPT] + OTHERS[:3], GREEDY, use_tqdm=False))[0] == alone
    assert_no_leak(chunked)
    prompt = " ".join(OTHERS[:6])  # several full blocks
    first = bf16_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = bf16_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert_no_leak(bf16_llm)


def test_preemption_keeps_greedy_output(make_bf16, bf16_llm) -> None:
    """A preempted request is recomputed as a prefill of what it had decoded: the prompt
    kernel sums those positions in another order than the decode kernel did, so, as with the
    block kernels' rounded activations, a request may part at a near-tie."""
    prompts = [PROMPT] + OTHERS[:7]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    roomy = bf16_llm.generate(prompts, params, use_tqdm=False)
    tight = make_bf16(kv_cache_tokens=192, max_model_len=192)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.make_stats().num_preemptions > 0
    assert all(len(tokens) == 48 for tokens in _tokens(outputs))
    assert_greedy_agrees(roomy, outputs)
    assert_no_leak(tight)


def test_the_float32_products_give_the_same_text_up_to_near_ties(make_bf16, bf16_llm) -> None:
    """The same bfloat16 weights with every product and the cache in float32 (--dtype float32
    --kv-cache-dtype float32: no tiles, float32 prompt attention)."""
    prompts = [PROMPT] + OTHERS[:7]
    fast = bf16_llm.generate(prompts, GREEDY, use_tqdm=False)
    exact = make_bf16(dtype="float32", kv_cache_dtype="float32")
    assert exact.llm_engine.config.backend_choices["weights"]["tiles_bytes"] == 0
    exact_outputs = exact.generate(prompts, GREEDY, use_tqdm=False)
    assert_greedy_agrees(exact_outputs, fast, near_tie=0.2)
