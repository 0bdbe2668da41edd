"""Tensor parallelism over torch.distributed (gloo, processes on this machine): the collectives
give the single-process result; a model split over two ranks gives the tokens it gives on one
(greedy and seeded samples, float32, tiny random Llama and Qwen3, and a Q4_1 GGUF's blocks
split by rows and columns); what does not split is refused at start-up with the reason."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from octavo import LLM, SamplingParams
from octavo.model.parallel import TPGroup, incompatibility

from .test_families_engine import _save_tokenizer
from .tiny import TINY_SHAPE, save_tiny_checkpoint, tiny_model_config


def _collectives(rank: int, size: int, init_method: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    tp = TPGroup(rank, size)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 7, generator=generator)
    torch.save(
        {"x": x, "sum": tp.all_reduce(x.clone()), "gathered": tp.all_gather(x)},
        os.path.join(out_dir, f"{rank}.pt"),
    )
    dist.destroy_process_group()


def test_all_reduce_and_all_gather_give_the_single_process_result(tmp_path) -> None:
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_collectives, args=(3, init_method, str(tmp_path)), nprocs=3, join=True)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(3)]
    inputs = [r["x"] for r in results]
    for result in results:
        torch.testing.assert_close(result["sum"], inputs[0] + inputs[1] + inputs[2])
        assert torch.equal(result["gathered"], torch.cat(inputs, dim=-1))
    # Every rank holds the very same sum (the ranks' states must not drift apart).
    assert all(torch.equal(r["sum"], results[0]["sum"]) for r in results)
    trivial = TPGroup()
    x = torch.ones(2, 3)
    assert trivial.all_reduce(x) is x and trivial.all_gather(x) is x


PROMPTS = [[5, 9, 17, 33, 2, 71], [100, 4, 4, 8], [3] * 11, [250, 1, 7]]


def _generate(folder, tensor_parallel_size: int, **kwargs):
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=4,
        kv_cache_tokens=256,
        max_model_len=64,
        tensor_parallel_size=tensor_parallel_size,
        **kwargs,
    )
    try:
        runner = llm.llm_engine.model_runner
        if tensor_parallel_size > 1:  # rank 0 here holds its share of the heads
            attention = runner.runner.model.model.layers[0].self_attn
            assert attention.num_heads * tensor_parallel_size == TINY_SHAPE["num_attention_heads"]
            assert runner.backend.fused_decode_layer.startswith("off: tensor parallelism")
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        return [
            [list(out.outputs[0].token_ids) for out in llm.generate(prompts, p, use_tqdm=False)]
            for p in (greedy, seeded)
        ]
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("llama", {}), ("qwen3", {"head_dim": 16}), ("llama", {"attention_bias": True})],
    ids=["llama", "qwen3", "llama-biases"],
)
def test_two_ranks_give_one_ranks_tokens(tmp_path, model_type, overrides) -> None:
    save_tiny_checkpoint(tmp_path, model_type, seed=5, **overrides)
    _save_tokenizer(tmp_path)
    threads = torch.get_num_threads()
    expected = _generate(tmp_path, 1)
    assert _generate(tmp_path, 2) == expected
    # The executor gave back the thread count it changed for rank 0.
    assert torch.get_num_threads() == threads


TOKENS = [3, 17, 200, 45, 9, 31, 128, 77, 5, 250, 64]


def _gguf_logits(rank: int, size: int, init_method: str, path: str, out_dir: str) -> None:
    from octavo.model.loader import load_model
    from octavo.model.parallel import rank_model_config

    from .tiny import PagedHarness, cpu_backend

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    torch.set_num_threads(1)
    backend = cpu_backend(max_rows=0)  # dequantized float GEMMs: no kernel chosen by timing
    model, config = load_model(path, backend, tp=TPGroup(rank, size))
    model.config = rank_model_config(config, size)  # the harness's KV cache: this rank's heads
    logits = PagedHarness(model, backend, num_blocks=16, block_size=4).step({"r": TOKENS})["r"]
    torch.save(logits, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_gguf_blocks_split_by_rows_and_columns(tmp_path) -> None:
    """A GGUF of a tiny Llama in Q8_0 (one Q4_1 matrix): q/k/v, gate/up and the tied head
    split by rows, o and down by columns at 32-column block boundaries; the logits are those
    of the whole model (the sums only run in another order)."""
    from gguf import GGMLQuantizationType as Q

    from .test_quantized import all_linear, tiny_quantized_gguf

    types = {**all_linear(Q.Q8_0), "blk.0.ffn_down.weight": Q.Q4_1}
    path = tmp_path / "tiny.gguf"
    tiny_quantized_gguf(path, "llama", types)
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_gguf_logits, args=(2, init_method, str(path), str(tmp_path)), nprocs=2, join=True)
    whole_dir = tmp_path / "whole"
    whole_dir.mkdir()
    init_method = f"file://{tmp_path / 'rendezvous-1'}"
    mp.spawn(_gguf_logits, args=(1, init_method, str(path), str(whole_dir)), nprocs=1, join=True)
    whole = torch.load(whole_dir / "0.pt")
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"{rank}.pt"), whole, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_the_embedded_model_over_three_ranks_gives_one_ranks_tokens() -> None:
    """9 query and 3 key-value heads: three ranks (on however many CPUs). Its Q4_1 / Q8_0
    blocks are multiplied dequantized (packed_max_rows=0): the block kernels, chosen per shape
    by timing on each rank, round activations to 8 bits where a float GEMM does not, so with
    them the split model's tokens may part from the whole one's after a near tie."""
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    results = []
    for size in (1, 3):
        llm = LLM(
            dtype="float32",
            packed_max_rows=0,
            kv_cache_tokens=2048,
            max_model_len=512,
            tensor_parallel_size=size,
        )
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results.append([list(out.outputs[0].token_ids) for out in outputs])
        finally:
            llm.llm_engine.core.shutdown()
    assert results[0] == results[1]


def test_what_does_not_split_is_refused_with_the_reason(tmp_path) -> None:
    config = tiny_model_config()
    assert incompatibility(config, 1) is None and incompatibility(config, 2) is None
    assert "attention heads" in incompatibility(config, 3)
    moe = tiny_model_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert "mixture-of-experts" in incompatibility(moe, 2)
    with pytest.raises(ValueError, match="9 attention heads do not split evenly over 2 ranks"):
        LLM(tensor_parallel_size=2)  # the embedded model: 9 heads
    save_tiny_checkpoint(tmp_path, "llama", seed=5)  # its heads split over 2 ranks
    _save_tokenizer(tmp_path)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node=2"):
        LLM(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="external_launcher")


# One rank of a torchrun group (external_launcher): the same prompts as _generate, its tokens
# written to OUT/<rank>.json.
TORCHRUN_SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
from tests.model.test_tensor_parallel import _generate
tokens = _generate({folder!r}, 2, distributed_executor_backend="external_launcher")
with open(os.path.join({out!r}, os.environ["RANK"] + ".json"), "w") as f:
    json.dump(tokens, f)
"""


def test_ranks_torchrun_starts_give_one_ranks_tokens(tmp_path) -> None:
    """distributed_executor_backend='external_launcher': torchrun starts two processes, each a
    whole engine holding one rank's share; every rank's tokens are those of one rank alone."""
    import json

    from tests.server.utils import free_port

    save_tiny_checkpoint(tmp_path, "llama", seed=5)
    _save_tokenizer(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_SCRIPT.format(root=root, folder=str(tmp_path), out=str(tmp_path)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _generate(tmp_path, 1)
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == expected


@pytest.fixture
def ray_cluster():
    """A local Ray cluster (`ray start --head`, 2 CPUs) the engine finds through RAY_ADDRESS;
    stopped afterwards. Its temporary folder is short: Ray's socket paths must fit in 107 bytes."""
    pytest.importorskip("ray")
    import shutil
    import tempfile

    from tests.server.utils import free_port

    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    start = [ray_cli, "start", "--head", "--port", str(port), "--num-cpus", "2"]
    start += ["--include-dashboard=false", "--disable-usage-stats"]
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    start += ["--object-store-memory", str(100 * 2**20), "--temp-dir", temp_dir]
    done = subprocess.run(start, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_ranks_as_ray_actors_give_one_ranks_tokens_and_a_killed_actor_fails_the_step(
    tmp_path, ray_cluster
) -> None:
    import ray

    from octavo.worker.executor import WorkerDeadError

    save_tiny_checkpoint(tmp_path, "llama", seed=5)
    _save_tokenizer(tmp_path)
    expected = _generate(tmp_path, 1)
    assert _generate(tmp_path, 2, distributed_executor_backend="ray") == expected
    assert not ray.is_initialized()  # the engine that connected has disconnected
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        kv_cache_tokens=256,
        max_model_len=64,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    try:
        executor = llm.llm_engine.model_runner
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        prompt = {"prompt_token_ids": PROMPTS[0]}
        assert len(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        ray.kill(executor._actors[0])
        with pytest.raises(WorkerDeadError, match="worker 1 \\(Ray actor\\)"):
            for _ in range(50):  # until Ray has seen the actor die
                llm.generate(prompt, params, use_tqdm=False)
                time.sleep(0.1)
    finally:
        llm.llm_engine.core.shutdown()


def _serve_tiny(folder, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "octavo.entrypoints.cli",
        "serve",
        str(folder),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
        "--kv-cache-tokens",
        "256",
        "--tensor-parallel-size",
        "2",
    ]
    from tests.server.utils import start_server_process

    return start_server_process(command, port)


def _core_and_worker(server: subprocess.Popen) -> tuple[psutil.Process, psutil.Process]:
    spawned = [
        p
        for p in psutil.Process(server.pid).children(recursive=True)
        if "spawn_main" in " ".join(p.cmdline())
    ]
    (core,) = [p for p in spawned if p.ppid() == server.pid]
    (worker,) = [p for p in spawned if p.ppid() == core.pid]
    return core, worker


@pytest.mark.slow
def test_serve_with_two_ranks_a_killed_worker_stops_the_server(tmp_path) -> None:
    from tests.server.utils import free_port

    save_tiny_checkpoint(tmp_path, "llama", seed=5)
    _save_tokenizer(tmp_path)
    port = free_port()
    server = _serve_tiny(tmp_path, port)
    base_url = f"http://127.0.0.1:{port}"
    try:
        body = {"model": str(tmp_path), "prompt": "t5 t9 t17", "max_tokens": 5, "temperature": 0}
        models = httpx.get(base_url + "/v1/models", timeout=10).json()["data"]
        body["model"] = models[0]["id"]
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5
        core, worker = _core_and_worker(server)
        worker.kill()
        # The idle core notices within its poll and exits; the server then answers 503 (or
        # has closed already) and exits 1.
        core.wait(30)  # (its exit code is its parent's to read)
        try:
            assert httpx.get(base_url + "/health", timeout=5).status_code == 503
        except httpx.ConnectError:
            pass
        assert server.wait(60) == 1
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.slow
def test_serve_with_two_ranks_a_killed_server_leaves_no_process(tmp_path) -> None:
    from tests.server.utils import free_port

    save_tiny_checkpoint(tmp_path, "llama", seed=5)
    _save_tokenizer(tmp_path)
    server = _serve_tiny(tmp_path, free_port())
    try:
        core, worker = _core_and_worker(server)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        _, alive = psutil.wait_procs([core, worker], timeout=15)
        assert not alive, alive
    finally:
        if server.poll() is None:
            server.kill()
