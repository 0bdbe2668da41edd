"""ModelRunner: turns a SchedulerOutput into one flat forward pass and sampled tokens.

It owns every tensor: the model, the paged KV cache, the persistent InputBatch and the sampler.
It never touches Request objects; what it knows of requests arrives as SchedulerOutput deltas,
and what it returns is plain data (ModelRunnerOutput) with one device-to-host copy per step.

One request must not fail the others. Whatever is prepared per request (its row of the batch,
its generator, its sampling parameters, its draw) is prepared so that an exception is pinned
to that request: it is left out of the step and reported in ModelRunnerOutput.failed, and the
rest of the batch runs as if it had not been there (a failed batched draw is redone row by
row from the same logits and generator states). Only what cannot be pinned to one request
(the forward itself) raises.

Logits are computed where a token is sampled, and, for a request that asked for prompt
logprobs, at every prompt position of each of its chunks but the prompt's last (whose logits
sample the first token). Those are scored chunk by chunk, keeping only the requested top-k on
the host, gathered in order across the chunks, and returned once, beside the first token.

A pooling request (a pooling model's) samples nothing: the final-norm hidden states of the
positions its pooler reads (LAST: the prompt's last; MEAN: every one, summed chunk by chunk;
CLS: the first) leave the model beside the sampled rows, and the step that computes its last
prompt token returns its vector in ModelRunnerOutput.pooled (model/pooling.py).

Speculative decoding: a request with proposed tokens (SchedulerOutput.scheduled_spec_decode_
tokens) runs its last token and the proposals as one chunk, and gets logits at each of those
k + 1 positions. Each position is sampled like an ordinary row ("a sample position"), with the
proposals before it counted as output (penalties, min_tokens, bad words), and the rejection
sampler (sample/rejection_sampler.py) keeps the proposals while the drawn tokens agree, then
the first token drawn after them. A seeded request's generator is set back to the draws of the
tokens it emitted, so its stream does not depend on how many tokens were proposed. With a
draft model (worker/drafter.py) the runner also makes the next step's proposals: after
sampling, the draft runs over the tokens the step made known and proposes for the requests
the scheduler asked (ModelRunnerOutput.draft_token_ids).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from octavo.config import CacheConfig, PoolerConfig, SchedulerConfig
from octavo.core.outputs import ModelRunnerOutput, PromptTokenLogprobs, TokenLogprobs
from octavo.core.scheduler_output import NewRequestData, SchedulerOutput
from octavo.model.attention.layer import PagedAttention
from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.backends import ModelBackend
from octavo.model.backends.base import AttentionPlan
from octavo.model.config import ModelConfig
from octavo.model.kv_cache import allocate_kv_cache
from octavo.model.pooling import finish_pooling
from octavo.sample.metadata import ROW_PARAMS, SamplingMetadata
from octavo.sample.ops.allowed import banned_by_bad_words
from octavo.sample.ops.bitmask import allows_other_tokens, apply_token_bitmask
from octavo.sample.ops.logprobs import compute_logprobs, gather_logprobs
from octavo.sample.rejection_sampler import num_accepted_one_hot
from octavo.sample.sampler import Sampler
from octavo.worker.drafter import DraftChunk, Drafter
from octavo.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

# Prompt positions scored per log_softmax pass: bounds the (rows, vocab) float32 logits a long
# prompt chunk would otherwise make at once.
PROMPT_LOGPROBS_ROWS = 256


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    # The attention backend's plan of this step's AttentionMetadata, shared by every layer.
    attn_plan: AttentionPlan
    # Batch rows scheduled this step, in flat-batch order.
    scheduled_rows: list[int]
    # Rows (subset of scheduled_rows) whose last scheduled token is sampled, and how many
    # proposed tokens each verifies (0 without speculation).
    sample_rows: list[int]
    num_draft_tokens: list[int]
    # (num_sample_positions + num_prompt_positions,) int64: the flat indices of the sampled
    # positions (one per sample row, 1 + k for one verifying k proposals), then those of
    # prompt_chunks' positions, chunk after chunk.
    logits_indices: torch.Tensor
    # Per scheduled row: the token count in the cache once this step has run.
    seq_lens: list[int]
    # (row, first position, number of positions) of the prompt positions whose logits score
    # the prompt token after them, for rows that asked for prompt logprobs.
    prompt_chunks: list[tuple[int, int, int]]
    # Pooling rows: (row, number of hidden-state rows their pooler reads this step, whether
    # this step computes the prompt's last token); those rows follow the prompt positions'.
    pool_chunks: list[tuple[int, int, bool]]

    @property
    def num_sample_positions(self) -> int:
        return len(self.sample_rows) + sum(self.num_draft_tokens)


@dataclass(slots=True)
class _PoolingState:
    """One pooling request's pooler input so far, across its prompt chunks."""

    dimensions: int | None
    normalize: bool
    # (hidden,) float32: the sum of the rows read so far (MEAN), or the one row (LAST, CLS).
    pooled: torch.Tensor | None = None


# Row -> the tokens it emits this step and their logprobs (None where not asked for).
Sampled = dict[int, tuple[list[int], list[TokenLogprobs] | None]]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        backend: ModelBackend,
        reload_model: Callable[[], nn.Module] | None = None,
        logprobs_mode: str = "raw_logprobs",
        pooler: PoolerConfig | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """`model` was built and loaded with `backend` (model.loader.load_model);
        `reload_model` loads it again from its files (what wake_up needs after a sleep that
        released the weights; None: such a sleep is refused); `logprobs_mode` is the
        sampler's (what reported logprobs are); `pooler`: a pooling model's (how its pooling
        requests are pooled; None: a generation model, whose requests all sample); `drafter`:
        speculative decoding's draft model (None: proposals, if any, are the scheduler's)."""
        self.model: nn.Module | None = model
        self.model_config = model_config
        self.backend = backend
        self.block_size = cache_config.block_size
        self.device = backend.device
        self.vocab_size = model_config.vocab_size
        self._cache_config = cache_config
        self._reload_model = reload_model
        self.kv_caches = self._allocate_kv_cache()
        # KV cache groups: each attention layer reads and writes through its group's block
        # table (config.kv_cache_groups); one group: every layer through the one table.
        self.group_windows = cache_config.group_windows
        if len(self.group_windows) > 1:
            attentions = [m for m in model.modules() if isinstance(m, PagedAttention)]
            for attention, (group, _) in zip(attentions, cache_config.layer_groups, strict=True):
                attention.kv_group = group
        max_model_len = scheduler_config.max_model_len
        max_blocks_per_req = -(-max_model_len // self.block_size)
        self.input_batch = InputBatch(
            scheduler_config.max_num_seqs,
            max_model_len,
            max_blocks_per_req,
            len(self.group_windows),
        )
        # On a CPU the draw (softmax, cumulative sum, search) is one kernel pass, and so is the
        # greedy pick.
        self.sampler = Sampler(
            draw=backend.draw, logprobs_mode=logprobs_mode, argmax=backend.argmax
        )
        # Seeded requests keep their generator across preemptions, so a preempted request
        # resumes its random stream where it stopped instead of replaying it.
        self.generators: dict[str, torch.Generator] = {}
        # Requests whose prompt logprobs are being gathered, and those of the chunks so far.
        self.prompt_logprobs: dict[str, PromptTokenLogprobs] = {}
        self.pooler = pooler
        # Pooling requests in the batch, and what their pooler has read so far.
        self.pooling: dict[str, _PoolingState] = {}
        self.drafter = drafter

    def _allocate_kv_cache(self) -> list[torch.Tensor]:
        cache = self._cache_config
        return allocate_kv_cache(
            self.model_config,
            cache.num_blocks,
            cache.block_size,
            self.backend.kv_cache_dtype,
            self.backend.device,
            self.backend.huge_pages,
            cache.layer_groups,
        )

    def check_health(self) -> None:
        """Nothing can fail here between steps (the tensor-parallel executor's workers can)."""

    # --- sleep mode ---------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Release memory between steps; the core has ended every request first, so no step
        reads what is released, and none runs until wake_up has restored it. Level 1: the KV
        cache's tensors (their contents are forgotten). The weights stay where a CPU holds
        them, in host memory already; on another device they are released too and reloaded
        from the model files at wake-up (octavo keeps no host copy). Level 2: the weights
        too, on any device. The caller collects the garbage (the model may hold cycles)."""
        if level >= 2 or self.device.type != "cpu":
            if self._reload_model is None:
                raise ValueError(
                    f"sleep level {level}: this runner cannot reload its weights "
                    "(enable_sleep_mode was off when it was built)."
                )
            self.model = None
        self.kv_caches = []
        if self.drafter is not None:
            self.drafter.kv_caches = []

    def wake_up(self, tags: Iterable[str]) -> None:
        """Restore what sleep released among `tags`: "weights" (loaded again from the model
        files, the same as at start-up) and "kv_cache" (a zeroed pool of the same shape)."""
        tags = set(tags)
        if "weights" in tags and self.model is None:
            assert self._reload_model is not None
            self.model = self._reload_model()
        if "kv_cache" in tags and not self.kv_caches:
            self.kv_caches = self._allocate_kv_cache()
            if self.drafter is not None:
                self.drafter.kv_caches = self.drafter.allocate_kv_cache()

    def shutdown(self) -> None:
        """Nothing to stop in process (the tensor-parallel executor stops its workers)."""

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's deltas to the persistent batch, run the model once, sample. A
        request whose own preparation or draw raises is in the output's `failed`; the others
        are unaffected. Raises only for what concerns the whole batch (the forward)."""
        failed: dict[str, str] = {}
        self._update_batch(scheduler_output, failed)
        if scheduler_output.is_empty:
            return ModelRunnerOutput([], [], [], failed)
        inputs = self._prepare_inputs(scheduler_output)
        if inputs is None:  # everything scheduled failed to join the batch
            return ModelRunnerOutput([], [], [], failed)
        assert self.model is not None and self.kv_caches, "a step while asleep"
        hidden_states = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.attn_plan,
            inputs.logits_indices,
        )
        num_sampled = inputs.num_sample_positions
        num_scored = num_sampled + sum(count for _, _, count in inputs.prompt_chunks)
        self._score_prompts(hidden_states[num_sampled:num_scored], inputs, failed)
        pooled = self._pool(hidden_states[num_scored:], inputs, failed)
        sampled = (
            self._sample(hidden_states[:num_sampled], inputs, scheduler_output, failed)
            if num_sampled
            else {}
        )
        output = self._make_output(inputs, sampled, failed, pooled)
        if self.drafter is not None:
            chunks = self._draft_chunks(inputs, scheduler_output, sampled, failed)
            try:
                drafts = self.drafter.propose(self.input_batch, chunks)
            except Exception:
                # Proposals only ever cost acceptance, never correctness (every one is
                # verified): a draft that fails proposes nothing, and the step stands.
                logger.exception("the draft model failed; no proposals this step")
                drafts = {}
            output = dataclasses.replace(output, draft_token_ids=drafts)
        return output

    def _draft_chunks(
        self,
        inputs: StepInputs,
        scheduler_output: SchedulerOutput,
        sampled: Sampled,
        failed: dict[str, str],
    ) -> list[DraftChunk]:
        """What the draft runs after this step (call after _make_output appended the emitted
        tokens): each scheduled row's chunk less its rejected proposals; a row the scheduler
        asked proposals of also runs its emitted token and proposes as many tokens as its
        lookahead slots allow (the furthest proposal's input is written at the step's last
        slot + lookahead)."""
        batch = self.input_batch
        lookahead = scheduler_output.num_lookahead_tokens
        k = self.drafter.num_speculative_tokens
        chunks: list[DraftChunk] = []
        for row, seq_len in zip(inputs.scheduled_rows, inputs.seq_lens, strict=True):
            request_id = batch.rows[row].request_id
            if request_id in failed:
                continue
            start = seq_len - scheduler_output.num_scheduled_tokens[request_id]
            if row not in sampled:  # a prompt chunk that is not the last
                chunks.append(DraftChunk(row, start, seq_len, 0))
                continue
            num_tokens = int(batch.num_tokens[row])
            num_drafts = 0
            if request_id in lookahead:
                num_drafts = min(k, seq_len + lookahead[request_id] - num_tokens + 1)
            if num_drafts > 0:
                chunks.append(DraftChunk(row, start, num_tokens, num_drafts))
            else:
                chunks.append(DraftChunk(row, start, num_tokens - 1, 0))
        return chunks

    # --- persistent batch -------------------------------------------------------------------

    def _update_batch(self, scheduler_output: SchedulerOutput, failed: dict[str, str]) -> None:
        batch = self.input_batch
        for request_id in scheduler_output.finished_req_ids:
            batch.remove(request_id)
            self.generators.pop(request_id, None)
            self.prompt_logprobs.pop(request_id, None)
            self.pooling.pop(request_id, None)
        for request_id in scheduler_output.preempted_req_ids:
            batch.remove(request_id)
            # Recomputed from the first position on resume (if it has no token yet).
            self.prompt_logprobs.pop(request_id, None)
            self.pooling.pop(request_id, None)
        for data in scheduler_output.scheduled_new_reqs:
            try:
                self._add_request(data)
            except Exception as exc:
                failed[data.request_id] = _failure(data.request_id, exc, "joining the batch")
                batch.remove(data.request_id)
                self.generators.pop(data.request_id, None)
                self.prompt_logprobs.pop(data.request_id, None)
                self.pooling.pop(data.request_id, None)
        for data in scheduler_output.scheduled_cached_reqs:
            row = batch.row_of[data.request_id]
            batch.append_block_ids(row, data.new_block_ids, data.new_group_block_ids)
            batch.num_computed_tokens[row] = data.num_computed_tokens

    def _add_request(self, data: NewRequestData) -> None:
        if data.pooling_params is not None:
            if self.pooler is None:
                raise ValueError("a pooling request for a generation model")
            params = data.pooling_params
            self.pooling[data.request_id] = _PoolingState(
                params.dimensions,
                self.pooler.use_activation
                if params.use_activation is None
                else params.use_activation,
            )
        seed = data.sampling_params.seed
        generator = self.generators.get(data.request_id)
        if generator is None and seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.generators[data.request_id] = generator
        self.input_batch.add(data, generator)
        # A request resumed with output tokens has had its prompt logprobs (with its first).
        if data.sampling_params.prompt_logprobs is not None and not data.output_token_ids:
            self.prompt_logprobs[data.request_id] = []

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs | None:
        """The step's flat inputs, or None when no scheduled request is in the batch."""
        batch = self.input_batch
        num_scheduled = scheduler_output.num_scheduled_tokens
        scheduled_rows = [
            row for row, state in enumerate(batch.rows) if state.request_id in num_scheduled
        ]
        if not scheduled_rows:
            return None
        token_chunks, position_chunks, slot_chunks = [], [], []
        group_slot_chunks: list[list[np.ndarray]] = [[] for _ in batch.group_tables]
        query_start_loc, seq_lens, sample_rows, logits_indices = [0], [], [], []
        num_draft_tokens: list[int] = []
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        prompt_chunks: list[tuple[int, int, int]] = []
        prompt_indices: list[np.ndarray] = []
        pool_chunks: list[tuple[int, int, bool]] = []
        pool_indices: list[np.ndarray] = []
        for row in scheduled_rows:
            drafts = spec_tokens.get(batch.rows[row].request_id, ())
            if drafts:
                batch.write_draft_tokens(row, drafts)
            start = int(batch.num_computed_tokens[row])
            end = start + num_scheduled[batch.rows[row].request_id]
            positions = np.arange(start, end, dtype=np.int64)
            # slot = block_id * block_size + offset within the block
            block_ids = batch.block_table[row, positions // self.block_size].astype(np.int64)
            token_chunks.append(batch.token_ids[row, start:end])
            position_chunks.append(positions)
            slot_chunks.append(block_ids * self.block_size + positions % self.block_size)
            for table, chunks in zip(batch.group_tables, group_slot_chunks, strict=True):
                group_ids = table[row, positions // self.block_size].astype(np.int64)
                chunks.append(group_ids * self.block_size + positions % self.block_size)
            if batch.rows[row].request_id in self.prompt_logprobs:
                # Positions start .. last - 1 score prompt tokens start + 1 .. last; the
                # prompt's last position samples instead.
                last = min(end, int(batch.num_prompt_tokens[row]) - 1)
                if last > start:
                    prompt_chunks.append((row, start, last - start))
                    prompt_indices.append(np.arange(last - start) + query_start_loc[-1])
            if batch.rows[row].request_id in self.pooling:
                rows = self._pooled_rows(start, end, int(batch.num_prompt_tokens[row]))
                pool_chunks.append((row, len(rows), end >= batch.num_prompt_tokens[row]))
                pool_indices.append(rows + query_start_loc[-1])
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)
            # Only a request whose every known token has been computed yields a new one;
            # a prefill chunk that is not the last produces no sample, and a pooling
            # request none at all.
            if end >= batch.num_tokens[row] and batch.rows[row].request_id not in self.pooling:
                sample_rows.append(row)
                num_draft_tokens.append(len(drafts))
                # The last known token's position, then each proposal's.
                last = query_start_loc[-1]
                logits_indices.extend(range(last - 1 - len(drafts), last))
        max_blocks = max(int(batch.num_blocks[row]) for row in scheduled_rows)
        block_table = batch.block_table[scheduled_rows, :max_blocks]
        attn_metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=self._to_device(np.concatenate(slot_chunks)),
            block_table=self._to_device(block_table),
            block_size=self.block_size,
        )
        attention = self.backend.attention
        if batch.group_tables.shape[0]:
            group_metadata = [attn_metadata] + [
                AttentionMetadata(
                    query_start_loc=query_start_loc,
                    seq_lens=seq_lens,
                    slot_mapping=self._to_device(np.concatenate(chunks)),
                    block_table=self._to_device(table[scheduled_rows, :max_blocks]),
                    block_size=self.block_size,
                )
                for table, chunks in zip(batch.group_tables, group_slot_chunks, strict=True)
            ]
            attn_plan = attention.plan_groups(group_metadata, self.group_windows)
        else:
            attn_plan = attention.plan_step(attn_metadata, self.model_config.attention_windows)
        return StepInputs(
            input_ids=self._to_device(np.concatenate(token_chunks)),
            positions=self._to_device(np.concatenate(position_chunks)),
            attn_plan=attn_plan,
            scheduled_rows=scheduled_rows,
            sample_rows=sample_rows,
            num_draft_tokens=num_draft_tokens,
            logits_indices=self._to_device(
                np.concatenate([np.asarray(logits_indices), *prompt_indices, *pool_indices]).astype(
                    np.int64
                )
            ),
            seq_lens=seq_lens,
            prompt_chunks=prompt_chunks,
            pool_chunks=pool_chunks,
        )

    def _pooled_rows(self, start: int, end: int, num_prompt_tokens: int) -> np.ndarray:
        """The rows of a chunk over positions start..end - 1 that the pooler reads, as offsets
        into the chunk."""
        assert self.pooler is not None
        kind = self.pooler.pooling_type
        if kind == "MEAN":
            return np.arange(end - start)
        if kind == "CLS":
            return np.arange(1) if start == 0 else np.arange(0)
        # LAST
        return np.asarray([end - 1 - start]) if end >= num_prompt_tokens else np.arange(0)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    # --- prompt logprobs --------------------------------------------------------------------

    def _score_prompts(
        self, hidden_states: torch.Tensor, inputs: StepInputs, failed: dict[str, str]
    ) -> None:
        """Append to each prompt_chunks request's gathered prompt logprobs those of this
        chunk: per position, the next prompt token's log_softmax value and rank, then the top
        k (the raw model distribution, as vLLM reports prompt logprobs whatever its
        logprobs_mode). `hidden_states` holds the chunks' positions in order. A request whose
        scoring raises is in `failed`."""
        batch = self.input_batch
        offset = 0
        for row, first, count in inputs.prompt_chunks:
            chunk, offset = hidden_states[offset : offset + count], offset + count
            state = batch.rows[row]
            k = state.sampling_params.prompt_logprobs
            k = self.vocab_size if k == -1 else k
            targets = batch.token_ids[row, first + 1 : first + 1 + count].astype(np.int64)
            try:
                for lo in range(0, count, PROMPT_LOGPROBS_ROWS):
                    hi = lo + PROMPT_LOGPROBS_ROWS
                    logprobs = compute_logprobs(self.model.compute_logits(chunk[lo:hi]))
                    top = gather_logprobs(logprobs, k, self._to_device(targets[lo:hi]))
                    self.prompt_logprobs[state.request_id].extend(
                        map(
                            TokenLogprobs,
                            top.token_ids.tolist(),
                            top.logprobs.tolist(),
                            top.sampled_ranks.tolist(),
                        )
                    )
            except Exception as exc:
                failed[state.request_id] = _failure(
                    state.request_id, exc, "computing prompt logprobs"
                )
                self.prompt_logprobs.pop(state.request_id, None)

    # --- pooling ----------------------------------------------------------------------------

    def _pool(
        self, hidden_states: torch.Tensor, inputs: StepInputs, failed: dict[str, str]
    ) -> dict[int, list[float]]:
        """Row -> embedding for each pooling row whose prompt's last token this step computed;
        the other pooling rows add this chunk's rows to what their pooler has read. A request
        whose pooling raises is in `failed`."""
        batch = self.input_batch
        pooled: dict[int, list[float]] = {}
        offset = 0
        for row, count, is_last in inputs.pool_chunks:
            rows, offset = hidden_states[offset : offset + count], offset + count
            request_id = batch.rows[row].request_id
            state = self.pooling[request_id]
            try:
                if count:
                    chunk = rows.float().sum(dim=0)  # (hidden,)
                    state.pooled = chunk if state.pooled is None else state.pooled + chunk
                if is_last:
                    vector = state.pooled
                    assert vector is not None, "no hidden state was pooled"
                    if self.pooler.pooling_type == "MEAN":
                        vector = vector / int(batch.num_prompt_tokens[row])
                    pooled[row] = finish_pooling(vector, state.dimensions, state.normalize).tolist()
            except Exception as exc:
                failed[request_id] = _failure(request_id, exc, "pooling")
                self.pooling.pop(request_id, None)
        return pooled

    # --- sampling ---------------------------------------------------------------------------

    def _sample(
        self,
        hidden_states: torch.Tensor,
        inputs: StepInputs,
        scheduler_output: SchedulerOutput,
        failed: dict[str, str],
    ) -> Sampled:
        """Row -> (emitted tokens, their logprobs) for every sample row that did not fail. One
        batched draw over every sample position; if it raises, the generators are put back as
        they were and each row is drawn alone from the logits computed again (the batched
        attempt may have edited them), so that one row's failure costs the others nothing,
        seeded draws included."""
        rows, num_extra = self._sample_positions(inputs)
        saved = {
            row: generator.get_state()
            for row in inputs.sample_rows
            if (generator := self.input_batch.rows[row].generator) is not None
        }
        try:
            logits = self.model.compute_logits(hidden_states)
            drawn = self._draw(logits, rows, num_extra, scheduler_output)
            return self._verify(inputs.sample_rows, inputs.num_draft_tokens, drawn, saved)
        except Exception:
            logger.exception("sampling %d rows failed; drawing them one by one", len(rows))
        for row, state in saved.items():
            self.input_batch.rows[row].generator.set_state(state)
        logits = self.model.compute_logits(hidden_states)
        sampled: Sampled = {}
        first = 0
        for row, num_drafts in zip(inputs.sample_rows, inputs.num_draft_tokens):
            last = first + num_drafts + 1
            try:
                drawn = self._draw(
                    logits[first:last], rows[first:last], num_extra[first:last], scheduler_output
                )
                sampled.update(self._verify([row], [num_drafts], drawn, saved))
            except Exception as exc:
                request_id = self.input_batch.rows[row].request_id
                failed[request_id] = _failure(request_id, exc, "sampling")
            first = last
        return sampled

    def _sample_positions(self, inputs: StepInputs) -> tuple[list[int], np.ndarray]:
        """Per sample position, in logits order: its row, and the proposed tokens before it
        (0 for a row's first position, 1..k for those after its proposals)."""
        rows: list[int] = []
        num_extra: list[int] = []
        for row, num_drafts in zip(inputs.sample_rows, inputs.num_draft_tokens):
            rows.extend([row] * (num_drafts + 1))
            num_extra.extend(range(num_drafts + 1))
        return rows, np.asarray(num_extra, dtype=np.int64)

    def _verify(
        self,
        sample_rows: list[int],
        num_draft_tokens: list[int],
        drawn: list[tuple[int, TokenLogprobs | None]],
        saved: dict[int, torch.Tensor],
    ) -> Sampled:
        """Each row's emitted tokens from the tokens drawn at its positions (`drawn`, in
        position order): the one drawn token of a row without proposals; else the accepted
        proposals and the token drawn after them (rejection_sampler.num_accepted_one_hot). A
        seeded row's generator is then set to where drawing only the emitted tokens would
        have left it (it drew one uniform per position, or none in an all-greedy draw)."""
        batch = self.input_batch
        sampled: Sampled = {}
        first = 0
        for row, num_drafts in zip(sample_rows, num_draft_tokens):
            positions = drawn[first : first + num_drafts + 1]
            first += num_drafts + 1
            tokens = [token for token, _ in positions]
            entries = [entry for _, entry in positions]
            if num_drafts:
                start = int(batch.num_tokens[row])
                drafts = batch.token_ids[row, start : start + num_drafts].tolist()
                num_emitted = num_accepted_one_hot(tokens, drafts) + 1
                tokens, entries = tokens[:num_emitted], entries[:num_emitted]
                generator = batch.rows[row].generator
                if generator is not None and not torch.equal(generator.get_state(), saved[row]):
                    generator.set_state(saved[row])
                    for _ in range(num_emitted):
                        torch.empty(1, device=self.device).uniform_(generator=generator)
            sampled[row] = (tokens, None if entries[0] is None else entries)
        return sampled

    def _draw(
        self,
        logits: torch.Tensor,
        rows: list[int],
        num_extra: np.ndarray,
        scheduler_output: SchedulerOutput,
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """Sample each position (its row's logits in `rows` order, `num_extra` proposed tokens
        of the row before it); the step's one device-to-host copy."""
        metadata = self._sampling_metadata(rows, num_extra)
        if scheduler_output.grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, metadata, rows, num_extra, scheduler_output)
        output = self.sampler(logits, metadata)
        tokens = output.sampled_token_ids.tolist()
        if output.logprobs is None:
            return [(token, None) for token in tokens]
        lp = output.logprobs
        ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.sampled_ranks.tolist()
        drawn: list[tuple[int, TokenLogprobs | None]] = []
        for i, row in enumerate(rows):
            k = self.input_batch.rows[row].sampling_params.logprobs
            entry = (
                None if k is None else TokenLogprobs(ids[i][: k + 1], values[i][: k + 1], ranks[i])
            )
            drawn.append((tokens[i], entry))
        return drawn

    def _apply_grammar_bitmask(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        sample_rows: list[int],
        num_extra: np.ndarray,
        scheduler_output: SchedulerOutput,
    ) -> None:
        """Structured-output positions get -inf on the tokens their grammar forbids, before the
        sampler: its logprobs, penalties and filters all see the constrained distribution. A
        request's mask rows are consecutive, one per position: after its accepted tokens,
        then after each of its proposed tokens (SchedulerOutput.grammar_mask_rows)."""
        bitmask = scheduler_output.grammar_bitmask
        assert bitmask is not None
        first_mask_row = scheduler_output.grammar_mask_rows()
        logits_rows, mask_rows = [], []
        for logits_row, (row, extra) in enumerate(zip(sample_rows, num_extra, strict=True)):
            first = first_mask_row.get(self.input_batch.rows[row].request_id)
            if first is None:
                continue
            mask_row = first + int(extra)
            logits_rows.append(logits_row)
            mask_rows.append(mask_row)
            stop_ids = metadata.min_tokens_stop_ids.get(logits_row)
            if stop_ids and not allows_other_tokens(bitmask[mask_row], stop_ids):
                # A complete grammar allows only EOS; min_tokens would forbid that too and
                # leave the row nothing to sample. The grammar wins.
                del metadata.min_tokens_stop_ids[logits_row]
        apply_token_bitmask(
            logits,
            self._to_device(bitmask[mask_rows]),
            self._to_device(np.asarray(logits_rows, dtype=np.int64)),
        )

    def _sampling_metadata(self, rows: list[int], num_extra: np.ndarray) -> SamplingMetadata:
        """The metadata of sample positions: `rows` (a row once per position), each seeing its
        row's tokens and `num_extra` of the proposed tokens after them as its history."""
        batch = self.input_batch
        states = [batch.rows[row] for row in rows]
        # (num_positions,): the tokens before each position, proposals included.
        num_tokens = batch.num_tokens[rows] + num_extra
        # 1) The per-row parameters: a tensor where some row leaves the neutral value.
        values: dict[str, torch.Tensor | None] = {}
        reads_tokens = False
        for param in ROW_PARAMS:
            column = batch.sampling[param.name][rows]
            is_on = param.always or bool((column != param.neutral).any())
            values[param.name] = self._to_device(column) if is_on else None
            reads_tokens |= is_on and param.reads_tokens
        # 2) What the sampler derives from the temperatures once.
        temperature = batch.sampling["temperature"][rows]
        # 3) Per-row lookups only for the rows that need them.
        min_tokens_stop_ids: dict[int, frozenset[int]] = {}
        bad_words_banned: dict[int, frozenset[int]] = {}
        for i, (row, state) in enumerate(zip(rows, states)):
            num_output = int(num_tokens[i] - batch.num_prompt_tokens[row])
            if num_output < state.sampling_params.min_tokens and state.stop_token_ids:
                min_tokens_stop_ids[i] = state.stop_token_ids
            words = state.sampling_params.bad_words_token_ids
            if words:
                # Only the output's last tokens can complete a word.
                end = int(num_tokens[i])
                start = max(int(batch.num_prompt_tokens[row]), end - max(map(len, words)) + 1)
                banned = banned_by_bad_words(batch.token_ids[row, start:end].tolist(), words)
                if banned:
                    bad_words_banned[i] = frozenset(banned)
        requested = [
            s.sampling_params.logprobs for s in states if s.sampling_params.logprobs is not None
        ]
        metadata = SamplingMetadata(
            **values,
            all_greedy=bool((temperature == 0).all()),
            all_random=bool((temperature > 0).all()),
            scale_by_temperature=bool(((temperature != 0) & (temperature != 1)).any()),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            min_tokens_stop_ids=min_tokens_stop_ids,
            allowed_token_ids={
                i: s.sampling_params.allowed_token_ids
                for i, s in enumerate(states)
                if s.sampling_params.allowed_token_ids is not None
            },
            bad_words_banned=bad_words_banned,
            logit_bias={
                i: s.sampling_params.logit_bias
                for i, s in enumerate(states)
                if s.sampling_params.logit_bias
            },
            max_num_logprobs=max(requested) if requested else None,
        )
        if reads_tokens:
            self._add_token_ids(metadata, rows, num_tokens)
        return metadata

    def _add_token_ids(
        self, metadata: SamplingMetadata, rows: list[int], num_tokens: np.ndarray
    ) -> None:
        """The prompt and output tokens of the positions (their rows' up to num_tokens), for
        the penalties that count them."""
        batch = self.input_batch
        prompt_lens = batch.num_prompt_tokens[rows]
        # (num_rows, max_prompt_len), padded with vocab_size (a column the penalties drop).
        prompts = np.full((len(rows), int(prompt_lens.max())), self.vocab_size, dtype=np.int64)
        for i, row in enumerate(rows):
            prompts[i, : prompt_lens[i]] = batch.token_ids[row, : prompt_lens[i]]
        metadata.prompt_token_ids = self._to_device(prompts)
        metadata.output_token_ids = [
            batch.token_ids[row, batch.num_prompt_tokens[row] : end].tolist()
            for row, end in zip(rows, num_tokens)
        ]

    def _make_output(
        self,
        inputs: StepInputs,
        sampled: Sampled,
        failed: dict[str, str],
        pooled: dict[int, list[float]],
    ) -> ModelRunnerOutput:
        batch = self.input_batch
        req_ids, sampled_token_ids, logprobs = [], [], []
        prompt_logprobs: dict[str, PromptTokenLogprobs] = {}
        pooled_by_id: dict[str, list[float]] = {}
        for row, seq_len in zip(inputs.scheduled_rows, inputs.seq_lens):
            batch.num_computed_tokens[row] = seq_len
            request_id = batch.rows[row].request_id
            req_ids.append(request_id)
            if row in pooled:
                pooled_by_id[request_id] = pooled[row]
            if row in sampled and request_id in self.prompt_logprobs:
                prompt_logprobs[request_id] = self.prompt_logprobs.pop(request_id)
            if row in sampled:
                token_ids, entries = sampled[row]
                for token_id in token_ids:
                    batch.append_token(row, token_id)
                # Every known token but the last has its KV now (rejected proposals' is
                # overwritten by the next step).
                batch.num_computed_tokens[row] = batch.num_tokens[row] - 1
                sampled_token_ids.append(token_ids)
                logprobs.append(entries)
            else:
                sampled_token_ids.append([])
                logprobs.append(None)
        return ModelRunnerOutput(
            req_ids, sampled_token_ids, logprobs, failed, prompt_logprobs, pooled_by_id
        )


def _failure(request_id: str, exc: Exception, stage: str) -> str:
    """What a failed request is told; logged once, without the others' noise."""
    reason = f"{stage} failed: {type(exc).__name__}: {exc}"
    logger.warning("request %s: %s", request_id, reason)
    return reason
