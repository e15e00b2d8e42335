"""One model step over the scheduler's work: flat inputs, the paged attention layout, the logits to sample.

The step's tokens (every sequence's share, `scheduler.Work`) are laid side by side in one row
with their own positions; their slots in the pool come from each sequence's block table. The
decoder runs as the runner's lean step where the architecture has one (`runtime.lean_decode`:
llama, mistral, qwen2, qwen3; its `flat_step` with `attention.attend_layer`), else through
transformers' forward with `attention.paged_attention` (Gemma 3), then the head runs
only on the last token of each sequence that samples this step (`runtime.lean_decode.Head`:
the head's GEMV choice and final logit soft-capping, as the runner computes logits).
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch
from torch import nn

from quantkit.engine.attention import Chunk, DecodeGroup, StepLayout, attend_layer, configs_of, paged
from quantkit.engine.kv_pool import KVPool
from quantkit.engine.scheduler import Work
from quantkit.runtime import lean_decode


class ModelRunner:
    def __init__(self, model: nn.Module, pool: KVPool):
        self.model, self.pool = model, pool
        embed = model.get_input_embeddings().weight
        self.device, self.dtype = embed.device, embed.dtype
        self.block_size = pool.block_size
        self.configs = configs_of(model)
        if not lean_decode.head_apart(model):
            raise ValueError(f"the engine does not run {model.config.model_type!r} models yet (supported: "
                             f"{', '.join(lean_decode.HEAD_APART)})")
        self.head = lean_decode.Head(model, self.device, self.dtype)
        self.lean = lean_decode.LeanDecoder(model, None) if lean_decode.supports(model) else None

    def _slots(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        table = torch.tensor(blocks, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def layout(self, work: Seq[Work]) -> tuple[torch.Tensor, torch.Tensor, StepLayout]:
        """(input ids [1, T], positions [1, T], the attention layout) of the step."""
        ids, positions, slots, chunks, dec_rows, dec_tables, dec_lengths = [], [], [], [], [], [], []
        row, bs = 0, self.block_size
        for w in work:
            seq = w.seq
            end = w.start + w.count
            ids.extend(seq.tokens[w.start : end])
            positions.append(torch.arange(w.start, end))
            slots.append(self._slots(seq.blocks, w.start, end))
            blocks = torch.tensor(seq.blocks[: -(-end // bs)], dtype=torch.long)
            if w.count == 1 and w.start > 0:
                dec_rows.append(row)
                dec_tables.append(blocks)
                dec_lengths.append(end)
            else:
                chunks.append(Chunk(row, w.count, end, blocks.to(self.device)))
            row += w.count
        decode = None
        if dec_rows:
            padded = torch.nn.utils.rnn.pad_sequence(dec_tables, batch_first=True, padding_value=0)
            decode = DecodeGroup(torch.tensor(dec_rows, device=self.device), padded.to(self.device),
                                 torch.tensor(dec_lengths, device=self.device), bs)
        layout = StepLayout(self.pool, torch.cat(slots).to(self.device), decode, chunks)
        return (torch.tensor(ids, dtype=torch.long, device=self.device)[None],
                torch.cat(positions).to(self.device)[None], layout)

    @torch.no_grad()
    def step(self, work: Seq[Work]) -> torch.Tensor:
        """Compute the step; the logits [n, vocab] (float32, on the CPU) of the work items that
        sample, in their order."""
        ids, positions, layout = self.layout(work)
        if self.lean is not None:
            scaling = self.lean.scaling
            hidden = self.lean.flat_step(ids, positions, lambda i, q, k, v: attend_layer(layout, i, q, k, v, scaling))
        else:
            with paged(self.configs):
                hidden = self.model.model(input_ids=ids, position_ids=positions, use_cache=False,
                                          quantkit_step=layout).last_hidden_state[0]
        ends, row = [], 0
        for w in work:
            row += w.count
            if w.sample:
                ends.append(row - 1)
        if not ends:
            return torch.empty(0, 0)
        return self.head(hidden[torch.tensor(ends, device=self.device)]).float().cpu()
