"""Executors run an engine's plan for one step. This file holds what every backend shares
(`ArenaExecutor`) and the CPU executor, which runs the plugins' PyTorch references.

All step inputs and activations live in one arena allocated when the executor is built, at
the offsets of the engine's memory plan, beside the KV cache's pool of blocks (one
`runtime.arena.Arena`). Bfloat16 and float32 engines both run on the CPU.
"""
from __future__ import annotations

import math

import torch

from kiln.dtypes import torch_dtype
from kiln.plugins import STEP_INPUTS
from kiln.plugins.step_inputs import decode_rows
from kiln.runtime.arena import Arena
from kiln.runtime.engine import Engine
from kiln.runtime.sampler import Picks, SequenceSampler
from kiln.runtime.step import Feed, SampledIds, StepInputs

# Arena views kept for reuse (`ArenaExecutor._view`): every tensor of the plan for a few hundred
# step shapes; past that the cache starts over.
VIEW_CACHE = 65536


class InputRegion:
    """The arena bytes [start, end) that hold every step input's slot, at the memory plan's
    offsets. A buffer laid out like it carries a step's inputs in one piece: the CUDA executor
    stages them with one copy, and a tensor-parallel engine hands them to its ranks in it."""

    def __init__(self, engine: Engine):
        m = engine.manifest
        self.slots = {s.name: (m.slots[s.name].offset, m.slots[s.name].nbytes) for s in STEP_INPUTS}
        self.start = min(offset for offset, _ in self.slots.values())
        self.end = max(offset + nbytes for offset, nbytes in self.slots.values())
        self.blocks_per_seq = m.blocks_per_sequence

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def _slot(self, buffer: torch.Tensor, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
        offset = self.slots[name][0] - self.start
        return buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def pack(self, step: StepInputs, buffer: torch.Tensor) -> int:
        """Write the step inputs into `buffer` (uint8, `nbytes` long) where the arena holds them; returns
        how many bytes from the start hold them, all that a copy of this step needs."""
        used = 0
        for spec in STEP_INPUTS:
            value = getattr(step, spec.name)
            self._slot(buffer, spec.name, torch_dtype(spec.dtype), value.shape).copy_(value)
            used = max(used, self.slots[spec.name][0] - self.start + value.numel() * value.element_size())
        return used

    def unpack(self, buffer: torch.Tensor, sizes: tuple[int, int, int]) -> StepInputs:
        """The step that `pack` wrote into `buffer`, as views of it; `sizes` are its tokens,
        sequences and logit rows (`StepInputs.sizes`)."""
        dims = dict(zip("TSL", sizes), B=self.blocks_per_seq)
        return StepInputs(**{spec.name: self._slot(buffer, spec.name, torch_dtype(spec.dtype),
                                                   [dims[d] for d in spec.shape])
                             for spec in STEP_INPUTS})


class ArenaExecutor:
    """The activations, the KV pool and the step inputs in them, on `device`; subclasses run
    the ops. Everything is one `Arena`: the memory plan's activations, the KV pool, then the
    `extra` regions a subclass asks for (name -> bytes). Sampling state lives beside them, on
    the same device (`runtime.sampler.SequenceSampler`)."""

    def __init__(self, engine: Engine, num_kv_blocks: int, device: torch.device | str = "cpu",
                 extra: dict[str, int] | None = None):
        self.engine = engine
        m = engine.manifest
        kv_shape = m.kv.pool_shape(num_kv_blocks)
        kv_dtype = torch_dtype(m.kv.dtype)
        self.memory = Arena({"activations": m.arena_bytes,
                             "kv_cache": math.prod(kv_shape) * kv_dtype.itemsize, **(extra or {})}, device)
        self.kv_cache = self.memory.view("kv_cache", kv_dtype, kv_shape)
        self.arena = self.memory.bytes("activations")
        self.layout = m.slots
        self.inputs = InputRegion(engine)
        self.output = m.logits
        self.sampler = SequenceSampler(device, m.eos_token_ids)
        self._views: dict[tuple, torch.Tensor] = {}

    def execute(self, step: StepInputs, copies: list[tuple[int, int]] = (), feed: Feed | None = None,
                picks: Picks | None = None) -> SampledIds | None:
        """`run` the step, then pick the tokens `picks` asks for where the logits are: the token
        ids (int64 [rows], left on the device, a copy to the host started) and the logprobs
        entries; None without picks. Nothing waits for the device."""
        logits = self.forward(step, copies, feed)
        return SampledIds(*self.sampler.pick(logits, picks)) if picks is not None else None

    def forward(self, step: StepInputs, copies: list[tuple[int, int]] = (), feed: Feed | None = None) -> torch.Tensor:
        """The step's logits rows as the sampler may take them, before anything else runs on the device:
        `run`'s here; an executor that can hand them over without a copy overrides it."""
        return self.run(step, copies, feed)

    def _view(self, name: str, dims: dict[str, int]) -> torch.Tensor:
        # Remembered per tensor and dims (a bounded number of them): making the views anew was a
        # sizeable share of an eager GPU step's host time. They alias the arena, which never moves.
        key = (name, *dims.items())
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= VIEW_CACHE:
                self._views.clear()
            info = self.engine.manifest.tensors[name]
            shape = info.resolve(dims)
            dtype = torch_dtype(info.dtype)
            offset = self.layout[name].offset
            size = math.prod(shape) * dtype.itemsize
            view = self._views[key] = self.arena[offset:offset + size].view(dtype).view(shape)
        return view

    def _dims(self, step: StepInputs) -> dict[str, int]:
        """The step's value of each symbolic dim, checked against the engine's limits."""
        m = self.engine.manifest
        tokens, seqs, rows = step.sizes
        for count, what, limit in ((tokens, "tokens", m.max_num_tokens), (seqs, "sequences", m.max_batch_size),
                                   (rows, "logit rows", m.max_batch_size)):
            if count > limit:
                raise ValueError(f"step has {count} {what}; the engine was built for at most {limit}")
        if step.block_tables.shape[1] != m.blocks_per_sequence:
            raise ValueError(f"block tables must have {m.blocks_per_sequence} columns, got {step.block_tables.shape[1]}")
        return {**m.symbol_bounds, "T": tokens, "S": seqs, "L": rows,
                "D": seqs if tokens == seqs else decode_rows(step.query_lens)}

    def _prepare(self, step: StepInputs, copies: list[tuple[int, int]], feed: Feed | None = None) -> dict[str, int]:
        """Do the copy-on-write copies and put the step inputs in the arena, with the fed token
        ids (see `runtime.step.Feed`) in place; returns the step's dims."""
        self.copy_blocks(copies)
        dims = self._dims(step)
        self._stage_inputs(step, dims)
        if feed is not None:
            feed.apply(self._view("input_ids", dims))
        return dims

    def _begin(self, step: StepInputs, copies: list[tuple[int, int]],
               feed: Feed | None = None) -> tuple[dict[str, int], dict]:
        """`_prepare`, then the tensors bound so far (the KV cache and the step inputs)."""
        dims = self._prepare(step, copies, feed)
        values: dict[str, torch.Tensor] = {"kv_cache": self.kv_cache}
        values.update((spec.name, self._view(spec.name, dims)) for spec in STEP_INPUTS)
        return dims, values

    def _stage_inputs(self, step: StepInputs, dims: dict[str, int]) -> None:
        """Copy the step inputs into their arena slots."""
        for spec in STEP_INPUTS:
            self._view(spec.name, dims).copy_(getattr(step, spec.name))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a sequence its own copy of a shared, partly filled block."""
        for src, dst in copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])

    def close(self) -> None:
        """Release the arena (activations, KV pool and the rest)."""
        self.memory = self.arena = self.kv_cache = None


class CpuExecutor(ArenaExecutor):
    def run(self, step: StepInputs, copies: list[tuple[int, int]] = (), feed: Feed | None = None) -> torch.Tensor:
        """Run one step, after the copy-on-write block copies the scheduler asked for; returns
        the logits of the requested rows, [L, vocab] in float32."""
        dims, values = self._begin(step, copies, feed)
        weights = self.engine.weights
        for op in self.engine.plan:
            args = [None if t is None else values[t] if t in values else weights[t] for t in op.inputs.values()]
            out = self._view(op.output, dims)
            out.copy_(op.spec.call_reference(args, op.attrs))
            values[op.output] = out
        return values[self.output].float().clone()
