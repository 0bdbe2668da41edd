"""lm-evaluation-harness against the server: `local-completions` pointed at octavo scores a
multiple-choice task (by loglikelihood, through `echo` + `logprobs`) and a generate_until task
(exact match) as `hf` scores them on the same weights, item by item.

The model is a tiny random float32 llama saved as an HF checkpoint with a real tokenizer (the
embedded model's byte-level BPE, 49152 tokens), so that lm_eval splits contexts and
continuations as it would for any model. Both tasks are written here (YAML + JSONL, read
with `datasets`' local json builder: nothing is downloaded). Half of the generate_until targets
are transformers' own greedy continuation (cut at the task's stop string), the other half
something else, so that exact match is neither 0 nor 1. local-completions is set up as a user
would for a server that takes token ids: `tokenizer_backend="huggingface"` with the checkpoint
as `tokenizer`, `tokenized_requests=True` (lm_eval's default).
"""

from __future__ import annotations

import json
from pathlib import Path

import lm_eval
import pytest
import torch

from octavo.config import EngineArgs
from octavo.engine.async_engine import AsyncEngine
from octavo.engine.llm_engine import LLMEngine
from octavo.entrypoints.server.app import ServerConfig, make_server_app
from octavo.entrypoints.server.http_server import make_server
from octavo.model.loader.gguf import find_default_model

from ..model.tiny import save_tiny_checkpoint
from .utils import free_port, start_in_thread

pytestmark = pytest.mark.slow

NUM_ITEMS = 10
MAX_GEN_TOKS = 6
STOP = "\n"
SUBJECTS = ["The cat", "A river", "My friend", "The old house", "Every morning", "The train",
            "Our teacher", "The small dog", "This city", "The red car"]  # fmt: skip
ENDINGS = [" sat on the mat.", " flows to the sea.", " likes to read.", " is very quiet."]

MC_TASK = """\
task: octavo_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """\
task: octavo_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, object, object]:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("lm-eval-model")
    gguf = Path(find_default_model())
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(folder)
    model = save_tiny_checkpoint(
        folder,
        "llama",
        seed=11,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return folder, model, tokenizer


def _greedy_text(model, tokenizer, text: str) -> str:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_GEN_TOKS, do_sample=False, pad_token_id=0
        )
    generated = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    return generated.split(STOP)[0]


@pytest.fixture(scope="module")
def tasks(checkpoint, tmp_path_factory) -> Path:
    _, model, tokenizer = checkpoint
    tasks = tmp_path_factory.mktemp("lm-eval-tasks")
    mc = [
        {
            "question": SUBJECTS[i],
            "choices": ENDINGS[i % 4 :] + ENDINGS[: i % 4],
            "answer": i % 3,
        }
        for i in range(NUM_ITEMS)
    ]
    gen = []
    for i, subject in enumerate(SUBJECTS):
        question = f"{subject} said:"
        answer = _greedy_text(model, tokenizer, question) if i % 2 == 0 else " no."
        gen.append({"question": question, "answer": answer})
    for name, docs, template in (("mc", mc, MC_TASK), ("gen", gen, GEN_TASK)):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (tasks / f"{name}.yaml").write_text(template.format(data=data, max_gen_toks=MAX_GEN_TOKS))
    return tasks


@pytest.fixture(scope="module")
def base_url(checkpoint):
    folder, _, _ = checkpoint
    args = EngineArgs(
        model=str(folder),
        dtype="float32",
        kv_cache_tokens=4096,
        max_model_len=256,
        served_model_name="tiny",
    )
    async_engine = AsyncEngine.from_factory(lambda: LLMEngine.from_engine_args(args))
    config = ServerConfig(host="127.0.0.1", port=free_port(), shutdown_timeout_s=5)
    app = make_server_app(async_engine, config)
    uv = make_server(app, async_engine, config, log_level="warning")
    thread = start_in_thread(uv, "lm-eval-server", 60)
    yield f"http://127.0.0.1:{config.port}"
    uv.should_exit = True
    thread.join(30)


def _evaluate(model: str, model_args: dict, tasks: Path) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["octavo_mc", "octavo_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=1,
    )


def test_local_completions_scores_as_hf_does(checkpoint, tasks, base_url, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, _, _ = checkpoint
    hf = _evaluate("hf", {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}, tasks)
    local = _evaluate(
        "local-completions",
        {
            "model": "tiny",
            "base_url": f"{base_url}/v1/completions",
            "tokenizer": str(folder),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_length": 256,
        },
        tasks,
    )
    for task, metric in (("octavo_mc", "acc,none"), ("octavo_gen", "exact_match,none")):
        assert local["results"][task][metric] == hf["results"][task][metric], task
    # Exact match is 5/10 by construction: the even items' targets are transformers' output.
    assert hf["results"]["octavo_gen"]["exact_match,none"] == 0.5

    def by_doc(result: dict, task: str) -> list[dict]:
        return sorted(result["samples"][task], key=lambda sample: sample["doc_id"])

    for hf_sample, local_sample in zip(by_doc(hf, "octavo_mc"), by_doc(local, "octavo_mc")):
        hf_lls = [ll for ll, _ in (r[0] for r in hf_sample["resps"])]
        local_lls = [ll for ll, _ in (r[0] for r in local_sample["resps"])]
        assert local_lls == pytest.approx(hf_lls, abs=1e-3)
        assert local_sample["acc"] == hf_sample["acc"]
    for hf_sample, local_sample in zip(by_doc(hf, "octavo_gen"), by_doc(local, "octavo_gen")):
        assert local_sample["filtered_resps"] == hf_sample["filtered_resps"]
    assert len(by_doc(local, "octavo_mc")) == len(by_doc(local, "octavo_gen")) == NUM_ITEMS
