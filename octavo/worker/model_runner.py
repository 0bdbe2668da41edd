"""ModelRunner: turns a SchedulerOutput into one flat forward pass and sampled tokens.

It owns every tensor: the model, the paged KV cache, the persistent InputBatch and the sampler.
It never touches Request objects; what it knows of requests arrives as SchedulerOutput deltas,
and what it returns is plain data (ModelRunnerOutput) with one device-to-host copy per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from octavo.config import CacheConfig, SchedulerConfig
from octavo.core.outputs import ModelRunnerOutput, TokenLogprobs
from octavo.core.scheduler_output import SchedulerOutput
from octavo.model.attention.metadata import AttentionMetadata
from octavo.model.backends import ModelBackend
from octavo.model.backends.base import AttentionPlan
from octavo.model.config import ModelConfig
from octavo.model.kv_cache import allocate_kv_cache
from octavo.sample.metadata import ROW_PARAMS, SamplingMetadata
from octavo.sample.ops.bitmask import allows_other_tokens, apply_token_bitmask
from octavo.sample.sampler import Sampler, SamplerOutput
from octavo.worker.input_batch import InputBatch


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    # The attention backend's plan of this step's AttentionMetadata, shared by every layer.
    attn_plan: AttentionPlan
    # Batch rows scheduled this step, in flat-batch order.
    scheduled_rows: list[int]
    # Rows (subset of scheduled_rows) whose last scheduled token is sampled, and the flat index
    # of that token.
    sample_rows: list[int]
    logits_indices: torch.Tensor  # (num_sampled,) int64
    # Per scheduled row: the token count in the cache once this step has run.
    seq_lens: list[int]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        backend: ModelBackend,
    ) -> None:
        """`model` was built and loaded with `backend` (model.loader.load_model)."""
        self.model = model
        self.model_config = model_config
        self.backend = backend
        self.block_size = cache_config.block_size
        self.device = backend.device
        self.vocab_size = model_config.vocab_size
        self.kv_caches = allocate_kv_cache(
            model_config,
            cache_config.num_blocks,
            cache_config.block_size,
            backend.kv_cache_dtype,
            backend.device,
            backend.huge_pages,
        )
        max_model_len = scheduler_config.max_model_len
        max_blocks_per_req = -(-max_model_len // self.block_size)
        self.input_batch = InputBatch(
            scheduler_config.max_num_seqs, max_model_len, max_blocks_per_req
        )
        # On a CPU the draw (softmax, cumulative sum, search) is one kernel pass.
        self.sampler = Sampler(draw=backend.draw)
        # Seeded requests keep their generator across preemptions, so a preempted request
        # resumes its random stream where it stopped instead of replaying it.
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's deltas to the persistent batch, run the model once, sample."""
        self._update_batch(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput([], [], [])
        inputs = self._prepare_inputs(scheduler_output)
        hidden_states = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.attn_plan,
            inputs.logits_indices,
        )
        logits = self.model.compute_logits(hidden_states)
        metadata = self._sampling_metadata(inputs.sample_rows)
        if scheduler_output.grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, metadata, inputs.sample_rows, scheduler_output)
        sampler_output = self.sampler(logits, metadata)
        return self._make_output(inputs, sampler_output)

    # --- persistent batch -------------------------------------------------------------------

    def _update_batch(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for request_id in scheduler_output.finished_req_ids:
            batch.remove(request_id)
            self.generators.pop(request_id, None)
        for request_id in scheduler_output.preempted_req_ids:
            batch.remove(request_id)
        for data in scheduler_output.scheduled_new_reqs:
            seed = data.sampling_params.seed
            generator = self.generators.get(data.request_id)
            if generator is None and seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seed)
                self.generators[data.request_id] = generator
            batch.add(data, generator)
        for data in scheduler_output.scheduled_cached_reqs:
            row = batch.row_of[data.request_id]
            batch.append_block_ids(row, data.new_block_ids)
            batch.num_computed_tokens[row] = data.num_computed_tokens

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        num_scheduled = scheduler_output.num_scheduled_tokens
        scheduled_rows = [
            row for row, state in enumerate(batch.rows) if state.request_id in num_scheduled
        ]
        token_chunks, position_chunks, slot_chunks = [], [], []
        query_start_loc, seq_lens, sample_rows, logits_indices = [0], [], [], []
        for row in scheduled_rows:
            start = int(batch.num_computed_tokens[row])
            end = start + num_scheduled[batch.rows[row].request_id]
            positions = np.arange(start, end, dtype=np.int64)
            # slot = block_id * block_size + offset within the block
            block_ids = batch.block_table[row, positions // self.block_size].astype(np.int64)
            token_chunks.append(batch.token_ids[row, start:end])
            position_chunks.append(positions)
            slot_chunks.append(block_ids * self.block_size + positions % self.block_size)
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)
            # Only a request whose every known token has been computed yields a new one;
            # a prefill chunk that is not the last produces no sample.
            if end >= batch.num_tokens[row]:
                sample_rows.append(row)
                logits_indices.append(query_start_loc[-1] - 1)
        max_blocks = max(int(batch.num_blocks[row]) for row in scheduled_rows)
        block_table = batch.block_table[scheduled_rows, :max_blocks]
        attn_metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=self._to_device(np.concatenate(slot_chunks)),
            block_table=self._to_device(block_table),
            block_size=self.block_size,
        )
        return StepInputs(
            input_ids=self._to_device(np.concatenate(token_chunks)),
            positions=self._to_device(np.concatenate(position_chunks)),
            attn_plan=self.backend.attention.plan(attn_metadata),
            scheduled_rows=scheduled_rows,
            sample_rows=sample_rows,
            logits_indices=self._to_device(np.asarray(logits_indices, dtype=np.int64)),
            seq_lens=seq_lens,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    # --- sampling ---------------------------------------------------------------------------

    def _apply_grammar_bitmask(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        sample_rows: list[int],
        scheduler_output: SchedulerOutput,
    ) -> None:
        """Structured-output rows get -inf on the tokens their grammar forbids, before the
        sampler: its logprobs, penalties and filters all see the constrained distribution."""
        bitmask = scheduler_output.grammar_bitmask
        assert bitmask is not None
        index_of_row = {row: i for i, row in enumerate(sample_rows)}
        logits_rows, mask_rows = [], []
        for mask_row, request_id in enumerate(scheduler_output.structured_output_req_ids):
            logits_row = index_of_row.get(self.input_batch.row_of.get(request_id, -1))
            if logits_row is None:
                continue
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

    def _sampling_metadata(self, rows: list[int]) -> SamplingMetadata:
        batch = self.input_batch
        states = [batch.rows[row] for row in rows]
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
        for i, (row, state) in enumerate(zip(rows, states)):
            num_output = int(batch.num_tokens[row] - batch.num_prompt_tokens[row])
            if num_output < state.sampling_params.min_tokens and state.stop_token_ids:
                min_tokens_stop_ids[i] = state.stop_token_ids
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
            logit_bias={
                i: s.sampling_params.logit_bias
                for i, s in enumerate(states)
                if s.sampling_params.logit_bias
            },
            max_num_logprobs=max(requested) if requested else None,
        )
        if reads_tokens:
            self._add_token_ids(metadata, rows)
        return metadata

    def _add_token_ids(self, metadata: SamplingMetadata, rows: list[int]) -> None:
        """The prompt and output tokens of the rows, for the penalties that count them."""
        batch = self.input_batch
        prompt_lens = batch.num_prompt_tokens[rows]
        # (num_rows, max_prompt_len), padded with vocab_size (a column the penalties drop).
        prompts = np.full((len(rows), int(prompt_lens.max())), self.vocab_size, dtype=np.int64)
        for i, row in enumerate(rows):
            prompts[i, : prompt_lens[i]] = batch.token_ids[row, : prompt_lens[i]]
        metadata.prompt_token_ids = self._to_device(prompts)
        metadata.output_token_ids = [batch.output_token_ids(row) for row in rows]

    def _make_output(self, inputs: StepInputs, sampler_output: SamplerOutput) -> ModelRunnerOutput:
        batch = self.input_batch
        # The step's one device-to-host copy (plus logprobs when asked).
        sampled = sampler_output.sampled_token_ids.tolist()
        logprobs_lists = None
        if sampler_output.logprobs is not None:
            lp = sampler_output.logprobs
            logprobs_lists = (
                lp.token_ids.tolist(),
                lp.logprobs.tolist(),
                lp.sampled_ranks.tolist(),
            )
        sampled_by_row: dict[int, int] = {}
        logprobs_by_row: dict[int, TokenLogprobs] = {}
        for i, row in enumerate(inputs.sample_rows):
            sampled_by_row[row] = sampled[i]
            k = batch.rows[row].sampling_params.logprobs
            if logprobs_lists is not None and k is not None:
                ids, values, ranks = logprobs_lists
                logprobs_by_row[row] = TokenLogprobs(ids[i][: k + 1], values[i][: k + 1], ranks[i])
        req_ids, sampled_token_ids, logprobs = [], [], []
        for row, seq_len in zip(inputs.scheduled_rows, inputs.seq_lens):
            batch.num_computed_tokens[row] = seq_len
            req_ids.append(batch.rows[row].request_id)
            if row in sampled_by_row:
                batch.append_token(row, sampled_by_row[row])
                sampled_token_ids.append([sampled_by_row[row]])
                logprobs.append([logprobs_by_row[row]] if row in logprobs_by_row else None)
            else:
                sampled_token_ids.append([])
                logprobs.append(None)
        return ModelRunnerOutput(req_ids, sampled_token_ids, logprobs)
