"""Chained hashing of full KV blocks: the keys of the prefix cache.

A full block's key is the hash of (parent block's key, its token ids, extra keys). Chaining
makes a key stand for the whole prefix up to and including the block, so two requests share a
block only if everything before it matches too. Only full blocks get a key: a partial block's
contents are still changing.

This module owns the key function and the rule for extending a request's list of keys. It
must not look at blocks, pools or requests' states: it maps token ids to ints and nothing else.

Why Python's built-in `hash`: on a tuple of ints it is deterministic across processes (ints
hash to themselves modulo 2**61 - 1; PYTHONHASHSEED only salts str/bytes), it runs in C and
costs about a microsecond per block. It is not collision resistant: the tuple hash is unkeyed
and invertible, so colliding prompts can be built on purpose. The block pool therefore also
keeps each cached block's token ids and confirms a hit by comparing them (as nano-vllm does):
a wrong hit would silently serve another prompt's KV, and the comparison costs `block_size`
int compares per hit, nothing next to the forward pass that the hit saves.
"""

from __future__ import annotations

from collections.abc import Sequence

# Parent key of a request's first block. A fixed int, not None: before Python 3.12 hash(None)
# depends on None's address, which would make keys differ between processes.
ROOT_BLOCK_HASH = 0x6F637461766F

# Extra keys tell apart blocks with equal tokens but different KV (a LoRA adapter, a
# multimodal input). Keep them ints or tuples of ints: str keys are salted per process.
ExtraKeys = tuple[object, ...]


def hash_block_tokens(
    parent_block_hash: int | None,
    token_ids: tuple[int, ...],
    extra_keys: ExtraKeys | None = None,
) -> int:
    """The key of one full block; `parent_block_hash` None means the request's first block."""
    parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    if extra_keys is None:
        return hash((parent, token_ids))
    return hash((parent, token_ids, extra_keys))


def extend_block_hashes(
    block_hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys | None = None,
) -> int:
    """Append keys for the full blocks of `token_ids` that `block_hashes` does not cover yet.

    `block_hashes` is a request's list, already correct for its first len(block_hashes) blocks
    (token ids only grow). Mutates `block_hashes` in place; returns the number of keys added.
    """
    num_full_blocks = len(token_ids) // block_size
    start = len(block_hashes)
    for block_idx in range(start, num_full_blocks):
        parent = block_hashes[block_idx - 1] if block_idx > 0 else None
        begin = block_idx * block_size
        block_tokens = tuple(token_ids[begin : begin + block_size])
        block_hashes.append(hash_block_tokens(parent, block_tokens, extra_keys))
    return max(num_full_blocks - start, 0)
