"""vLLM's import paths: `import octavo` and the vLLM-named modules load without torch, and a
script written for vLLM, with `vllm` replaced by `octavo` in its imports, runs offline and
async and agrees with octavo's own API."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from .model.test_families_engine import _save_tokenizer
from .model.tiny import save_tiny_checkpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETTINGS = dict(dtype="float32", kv_cache_tokens=512, block_size=4, max_model_len=64)

VLLM_STYLE_SCRIPT = textwrap.dedent(
    """
    import asyncio
    import json
    import sys

    from octavo import LLM, LLMEngine, SamplingParams, TokensPrompt
    from octavo.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from octavo.engine.async_llm_engine import AsyncLLMEngine
    from octavo.inputs import TextPrompt
    from octavo.outputs import CompletionOutput, RequestOutput
    from octavo.sampling_params import RequestOutputKind
    from octavo.sampling_params import SamplingParams as SamplingParamsByPath

    assert SamplingParams is SamplingParamsByPath
    model, settings = sys.argv[1], json.loads(sys.argv[2])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [TextPrompt(prompt="t5 t33 t90"), TokensPrompt(prompt_token_ids=[200, 3, 45])]

    llm = LLM(model=model, **settings)
    offline = llm.generate(prompts, params, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) for o in offline)
    assert all(isinstance(o.outputs[0], CompletionOutput) for o in offline)

    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **settings))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    stepped = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            # Cumulative: the last output of a request holds all of its text.
            stepped[output.request_id] = output.outputs[0].text


    async def stream(engine, prompt, request_id):
        delta = SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        text = ""
        async for output in engine.generate(prompt, delta, request_id):
            text += output.outputs[0].text
        return text


    async def main():
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model, **settings))
        try:
            return await asyncio.gather(
                *(stream(engine, prompt, str(i)) for i, prompt in enumerate(prompts))
            )
        finally:
            engine.shutdown()


    streamed = asyncio.run(main())
    texts = [o.outputs[0].text for o in offline]
    print(json.dumps({"offline": texts, "engine": [stepped["0"], stepped["1"]], "async": streamed}))
    """
)


def run_python(*args: str) -> subprocess.CompletedProcess:
    """This checkout's octavo, whatever is installed."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    )


def test_vllm_paths_import_without_torch():
    code = (
        "import sys\n"
        "import octavo, octavo.sampling_params, octavo.inputs, octavo.outputs\n"
        "import octavo.engine.arg_utils, octavo.beam_search\n"
        "from octavo.sampling_params import BeamSearchParams\n"
        "from octavo.beam_search import BeamSearchOutput, BeamSearchSequence\n"
        "from octavo import TokensPrompt, TextPrompt, PromptType, EngineArgs, AsyncEngineArgs\n"
        "from octavo import PoolingParams\n"
        "from octavo.pooling_params import PoolingParams as ByPath\n"
        "from octavo.outputs import EmbeddingRequestOutput, PoolingRequestOutput\n"
        "assert PoolingParams is ByPath\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    run_python("-c", code)


def test_a_vllm_style_script_agrees_with_the_plain_api(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama", seed=5)
    _save_tokenizer(tmp_path)
    script = tmp_path / "vllm_style.py"
    script.write_text(VLLM_STYLE_SCRIPT)
    run = run_python(str(script), str(tmp_path), json.dumps(SETTINGS))
    result = json.loads(run.stdout.strip().splitlines()[-1])

    from octavo.core.sampling_params import SamplingParams
    from octavo.entrypoints.llm import LLM

    llm = LLM(str(tmp_path), **SETTINGS)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = [
        o.outputs[0].text
        for o in llm.generate(["t5 t33 t90", [200, 3, 45]], params, use_tqdm=False)
    ]
    assert plain[0] and result == {"offline": plain, "engine": plain, "async": plain}
    # A prompt dict key octavo does not support is refused by name, not dropped.
    image_prompt = {"prompt": "t5 t33", "multi_modal_data": {"image": None}}
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported"):
        llm.generate(image_prompt, params, use_tqdm=False)
    assert llm.generate("t5 t33 t90", params, use_tqdm=False)[0].outputs[0].text == plain[0]
