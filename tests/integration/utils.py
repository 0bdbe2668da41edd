"""Shared checks for engine tests."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from octavo import LLM
from octavo.model.convert import load_gguf_tokenizer, write_hf_folder
from octavo.model.loader import find_default_model
from octavo.model.loader.gguf import open_gguf_checkpoint


def assert_no_leak(llm: LLM) -> None:
    """No request left anywhere, and every KV block back in the pool."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    stats = engine.make_stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    engine.scheduler.check_integrity()


def assert_greedy_agrees(expected, got, near_tie: float = 0.1) -> None:
    """Greedy outputs (generated with logprobs=2) of two runs that compute in different but
    equally valid orders: token for token the same, except that they may part where the
    expected run's two best tokens were within `near_tie` of each other in logprob and the
    other run took the second; nothing after a parting is comparable. Returns nothing; fails
    naming the request and position otherwise."""
    assert len(expected) == len(got)
    for index, (e, g) in enumerate(zip(expected, got)):
        e, g = e.outputs[0], g.outputs[0]
        for position, (a, b) in enumerate(zip(e.token_ids, g.token_ids)):
            if a == b:
                continue
            top = sorted(e.logprobs[position].items(), key=lambda item: -item[1].logprob)[:2]
            gap = top[0][1].logprob - top[1][1].logprob
            assert b == top[1][0] and gap < near_tie, (
                f"request {index} parts at token {position}: {b} where {a} was ahead by {gap}"
            )
            break
        else:
            assert list(e.token_ids) == list(g.token_ids), f"request {index}: lengths differ"


def write_draft_model(out: Path, skipped: range) -> Path:
    """The embedded model without its layers in `skipped` (the others renumbered in order),
    with its embeddings, final norm and output head, as a bfloat16 Hugging Face folder in
    `out`: a draft model with the model's own tokenizer whose guesses are right some of the
    time (layer skipping)."""
    source = Path(find_default_model())
    config, weights = open_gguf_checkpoint(source)
    kept = [i for i in range(config.num_hidden_layers) if i not in skipped]
    renumber = {old: new for new, old in enumerate(kept)}
    config = dataclasses.replace(config, num_hidden_layers=len(kept))

    def tensors():
        for name, tensor in weights:
            match = re.search(r"layers\.(\d+)\.", name)
            if match is None:
                yield name, tensor
            elif int(match[1]) in renumber:
                layer = f"layers.{renumber[int(match[1])]}."
                yield name[: match.start()] + layer + name[match.end() :], tensor

    out.mkdir(parents=True, exist_ok=True)
    write_hf_folder(config, tensors(), load_gguf_tokenizer(source), out, "bfloat16")
    return out
