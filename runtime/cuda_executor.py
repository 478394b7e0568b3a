"""The CUDA executor: runs an engine's plan for one step on the GPU with the engine's cubins.

Nothing is compiled here. The cubins that `build-engine` stored for this GPU's arch are loaded
with the driver API (`runtime.cuda_driver`), and each plan op is launched by its plugin's
`launch.py`, which mirrors what the plugin's `kernels.run` does through Triton's JIT. Memory is
one device allocation made when the executor is built (`runtime.arena.Arena`): the weights,
the activations and step inputs at the memory plan's offsets, the KV-cache pool, the ops'
scratch buffers (split-KV workspaces, attention_o_proj's intermediate) sized for the engine's
bounds. A step packs its inputs into one pinned host buffer laid out like the arena's input region
and copies it over in one transfer; the engine loop's steps (`forward`, whose logits the sampler
takes where the LM head wrote them) allocate no device memory, and only `run`'s float32 copy of the
logits, for tests and tools, does.

Pure decode steps replay CUDA graphs captured when the executor is built, one per batch size
of `runtime.decode_graphs`, so a decode step costs one graph launch instead of a Python call
per kernel. Other steps (prefill chunks, mixed steps) launch the kernels one by one.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from kiln.dtypes import element_bytes
from kiln.plugins import PluginSpec
from kiln.plugins.driver_launch import sm_count
from kiln.plugins.linear.reference import all_gather_columns
from kiln.runtime.all_reduce import AllReduce
from kiln.runtime.cuda_driver import CudaKernel, device_arch, load_kernel, programmatic_launch
from kiln.runtime.decode_graphs import decode_batch_limit, graph_batch_sizes, is_pure_decode, pad_decode, padding_step
from kiln.runtime.engine import Engine, EngineLoadError
from kiln.runtime.executor import ArenaExecutor
from kiln.runtime.step import Feed, StepInputs


@dataclass(frozen=True)
class _CudaOp:
    """One plan op, ready to launch: its plugin's launcher and loaded kernels."""

    launcher: ModuleType
    kernels: list[CudaKernel]
    metas: list[dict]
    names: list[str]            # the spec's input names
    inputs: list[str | None]    # the tensors bound to them
    attrs: dict
    output: str
    added_once: tuple[str, ...]  # the spec's: inputs only rank 0 adds after the sum

    @property
    def reduces(self) -> bool:
        """A row-parallel op: its rank's partial output is summed over the ranks."""
        return bool(self.attrs.get("all_reduce"))

    @property
    def gathers(self) -> bool:
        """The vocabulary-parallel LM head: its rank's slice of the output columns is gathered
        from every rank."""
        return self.attrs.get("all_gather", 0) > 1


def _launcher(spec: PluginSpec) -> ModuleType:
    launcher = spec.module("launch")
    if launcher is None:
        raise EngineLoadError(f"op {spec.name!r} has no CUDA launcher ({spec.package}.launch): "
                              "this engine cannot run on the GPU yet; use device='cpu'")
    return launcher


def kernel_scratch(launch: dict, limits: dict[str, int]) -> dict[str, int]:
    """The scratch buffers one kernel's launch metadata names: sized at build time (the split-K
    GEMMs' workspaces), or in bytes per row of a step (the FP8 GEMMs' quantized rows)."""
    per_row = {name: nbytes * limits["T"] for name, nbytes in launch.get("scratch_per_row", {}).items()}
    return {**launch.get("scratch", {}), **per_row}


def op_scratch(launcher: ModuleType, attrs: dict, launches: list[dict], limits: dict[str, int]) -> dict[str, int]:
    """Bytes of each scratch buffer one op asks for: its launcher's and its kernels' (their launch
    metadata `launches`), the largest need of each."""
    needs = [launcher.scratch_bytes(attrs, limits)] if hasattr(launcher, "scratch_bytes") else []
    needs += [kernel_scratch(launch, limits) for launch in launches]
    sizes: dict[str, int] = {}
    for need in needs:
        for name, nbytes in need.items():
            sizes[name] = max(sizes.get(name, 0), nbytes)
    return sizes


def scratch_bytes(engine: Engine, launchers: list[ModuleType]) -> dict[str, int]:
    """Bytes of each scratch buffer the plan's launchers and kernels ask for: the largest need of any op."""
    m = engine.manifest
    limits = {**m.symbol_bounds, "block_size": m.kv.block_size, "element_bytes": element_bytes(m.dtype)}
    sizes: dict[str, int] = {}
    for op, launcher in zip(engine.plan, launchers):
        launches = [m.kernels[key].launch for keys in op.kernel_keys.values() for key in keys]
        for name, nbytes in op_scratch(launcher, op.attrs, launches, limits).items():
            sizes[name] = max(sizes.get(name, 0), nbytes)
    return sizes


def global_scratch_bytes(engine: Engine, arch: str, programs: int) -> int:
    """Room for `programs` programs of the arch's kernel that needs the most global scratch per
    program (the persistent TMA GEMMs: their launchers keep the grid within the GPU's SMs)."""
    keys = {key for op in engine.plan for key in op.kernel_keys.get(arch, ())}
    return max((engine.manifest.kernels[key].global_scratch for key in keys), default=0) * programs


def executor_scratch(engine: Engine, launchers: list[ModuleType], arch: str, programs: int) -> dict[str, int]:
    """Every scratch buffer an executor for `arch` with `programs` SMs allocates: the launchers'
    and kernels' (`scratch_bytes`), and "global" where a kernel needs global scratch."""
    scratch = scratch_bytes(engine, launchers)
    if tma := global_scratch_bytes(engine, arch, programs):
        scratch["global"] = tma
    return scratch


class CudaExecutor(ArenaExecutor):
    """Same interface as `CpuExecutor`: `run(step, copies)` returns the logits [L, vocab] as
    float32 (on the GPU); `kv_cache` is the device pool [layers, 2, blocks, block_size, kv_heads,
    head_dim]."""

    def __init__(self, engine: Engine, num_kv_blocks: int, cuda_graphs: bool = True,
                 all_reduce: AllReduce | None = None):
        """A tensor-parallel rank's executor expects torch.distributed to be initialised with
        NCCL, one GPU per rank (`runtime.tp_worker` does it); `all_reduce` sums the row-parallel
        ops' outputs (NCCL alone when None)."""
        if not torch.cuda.is_available():
            raise EngineLoadError("no CUDA device is visible to torch: use device='cpu'")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.arch = device_arch()
        engine.require_target(self.arch)
        # The one arena comes first: torch's allocation makes its primary context current, which
        # is the context load_kernel loads the cubins into. One KV block more than asked for:
        # the padding sequences of graph batches write their KV there.
        launchers = [_launcher(op.spec) for op in engine.plan]
        scratch = executor_scratch(engine, launchers, self.arch, sm_count())
        self.all_reduce = all_reduce or AllReduce()
        super().__init__(engine, num_kv_blocks + 1, self.device,
                         {**{f"weight:{n}": w.nbytes for n, w in engine.weights.items()},
                          **{f"scratch:{n}": b for n, b in scratch.items()},
                          "zeros": self._zeros_bytes(engine), "gathered": self._gathered_bytes(engine)})
        self.pad_block = num_kv_blocks
        self.weights = {n: self.memory.view(f"weight:{n}", w.dtype, w.shape).copy_(w)
                        for n, w in engine.weights.items()}
        self.scratch = {n: self.memory.bytes(f"scratch:{n}") for n in scratch}
        self.zeros = self.memory.bytes("zeros")  # never written: the arena starts zeroed
        self.gathered = self.memory.bytes("gathered")
        self.ops = self._load_ops(launchers)
        self.staging = torch.empty(self.inputs.nbytes, dtype=torch.uint8, pin_memory=True)
        self.staged = torch.cuda.Event()
        self.graphs = self._capture_decode_graphs() if cuda_graphs else {}

    def _load_ops(self, launchers: list[ModuleType], load: Callable[..., CudaKernel] = load_kernel) -> list[_CudaOp]:
        """Each plan op with its launcher and its kernels for this arch, loaded by `load` (into the
        GPU; `scripts/profile_launch_host.py` passes one that does not)."""
        index = self.engine.manifest.kernels
        loaded: dict[str, CudaKernel] = {}
        ops = []
        for op, launcher in zip(self.engine.plan, launchers):
            keys = op.kernel_keys.get(self.arch)
            if not keys:
                raise EngineLoadError(f"plan op {op.spec.name} -> {op.output} has no kernels for {self.arch}: "
                                      f"rebuild with --target {self.arch}")
            for key in keys:
                if key not in loaded:
                    info = index[key]
                    loaded[key] = load(self.engine.kernels[key], info.entry, list(info.signature),
                                       info.num_warps, info.shared_bytes, info.global_scratch)
                    loaded[key].programmatic = programmatic_launch(info.launch)
                    if info.global_scratch:
                        buffer = self.scratch["global"]
                        loaded[key].scratch = (buffer.data_ptr(), buffer.numel() // info.global_scratch)
            ops.append(_CudaOp(launcher, [loaded[k] for k in keys],
                               [index[k].launch for k in keys], list(op.inputs),
                               list(op.inputs.values()), op.attrs, op.output, op.spec.added_once))
        return ops

    def _stage_inputs(self, step: StepInputs, dims: dict[str, int]) -> None:
        """Pack the inputs into the pinned buffer, then one asynchronous copy to the arena of the bytes
        they fill. The copy runs between two steps' kernels, and the region is sized for the engine's
        bounds: about 410 KB at 8,192 tokens and 256 sequences of 4,352 tokens, 280 KB of them block
        tables, which the memory plan puts last. A decode step of a few sequences fills a few of their
        rows, so its copy ends about 130 KB in."""
        self.staged.synchronize()  # the previous step's copy has left the buffer
        used = self.inputs.pack(step, self.staging)
        start = self.inputs.start
        self.arena[start:start + used].copy_(self.staging[:used], non_blocking=True)
        self.staged.record()

    @staticmethod
    def _zeros_bytes(engine: Engine) -> int:
        """Room for the largest input a row-parallel op adds once (`PluginSpec.added_once`)."""
        if engine.manifest.world_size == 1:
            return 0
        planned = engine.manifest.slots  # activations, sized for the bounds
        tensors = [op.inputs[name] for op in engine.plan if op.attrs.get("all_reduce") for name in op.spec.added_once]
        return max((engine.weights[t].nbytes if t in engine.weights else planned[t].nbytes
                    for t in tensors if t is not None), default=0)

    @staticmethod
    def _gathered_bytes(engine: Engine) -> int:
        """Room for the ranks' slices of the output of an op that gathers it (the LM head)."""
        return max((engine.manifest.slots[op.output].nbytes for op in engine.plan
                    if op.attrs.get("all_gather", 0) > 1), default=0)

    def _launch(self, dims: dict[str, int], values: dict[str, torch.Tensor], stream: int | None = None) -> None:
        """Launch every op of the plan on `stream` (a raw handle; default torch's current stream,
        captured when it is capturing).
        A row-parallel op's output is summed over the ranks right after it, on the same stream
        (`runtime.all_reduce`: the custom kernel or NCCL), so graphs capture the collectives too.
        The LM head of a tensor-parallel engine writes its slice of the logits' columns into the
        start of its output, and NCCL gathers the slices over it (`all_gather_columns`), also on
        that stream."""
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        tensor_parallel = self.engine.manifest.world_size > 1
        for op in self.ops:
            args = [None if t is None else values[t] if t in values else self.weights[t] for t in op.inputs]
            if tensor_parallel and op.reduces and self.engine.manifest.rank > 0:
                # Only rank 0 adds these after the sum; the kernels were built with them, so
                # the other ranks pass zeros.
                args = [self._zeros_like(a) if name in op.added_once and a is not None else a
                        for name, a in zip(op.names, args)]
            out = self._view(op.output, dims)
            part = self._column_slice(out, op.attrs["all_gather"]) if op.gathers else out
            op.launcher.launch(op.kernels, op.metas, args, op.attrs, part, dims, stream, self.scratch)
            if tensor_parallel and op.reduces:
                self.all_reduce(out)
            if op.gathers:
                all_gather_columns(part, self.gathered[:out.nbytes].view(out.dtype).view(-1, part.shape[1]), out)
            values[op.output] = out

    @staticmethod
    def _column_slice(out: torch.Tensor, ranks: int) -> torch.Tensor:
        """A contiguous [rows, columns / ranks] view at the start of `out`: one rank's slice."""
        rows, columns = out.shape
        return out.view(-1)[:out.numel() // ranks].view(rows, columns // ranks)

    def _zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        return self.zeros[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)

    def _capture_decode_graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        m = self.engine.manifest
        graphs = {}
        for batch in graph_batch_sizes(decode_batch_limit(m.max_num_tokens, m.max_batch_size, self.pad_block)):
            dims, values = self._begin(padding_step(batch, self.pad_block, m.kv.block_size, m.blocks_per_sequence), ())
            self._launch(dims, values)  # an eager run first, as CUDA graph capture advises
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._launch(dims, values)
            graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        return graphs

    def forward(self, step: StepInputs, copies: list[tuple[int, int]] = (), feed: Feed | None = None) -> torch.Tensor:
        """Run one step, after the copy-on-write block copies the scheduler asked for, with the
        `feed` token ids taken from the previous step's sampled ids on the device; returns the
        logits of the requested rows, [L, vocab] in the engine's dtype, where the LM head wrote
        them in the arena. The next step's kernels overwrite them: what reads them must be
        enqueued before (the sampler is, on the same stream). No float32 copy: the sampler's
        argmax takes bf16 as it is (exact), and it converts the rows it samples from. Everything is
        enqueued on the current stream: nothing here waits for the GPU."""
        rows = step.logits_indices.shape[0]
        batch = next((b for b in self.graphs if b >= step.num_tokens), None) if is_pure_decode(step) else None
        if batch is not None:
            step = pad_decode(step, batch, self.pad_block, self.engine.manifest.kv.block_size)
            dims = self._prepare(step, copies, feed)
            self.graphs[batch].replay()
        else:
            dims, values = self._begin(step, copies, feed)
            self._launch(dims, values)
        return self._view(self.output, dims)[:rows]

    def run(self, step: StepInputs, copies: list[tuple[int, int]] = (), feed: Feed | None = None) -> torch.Tensor:
        """`forward`, with the logits as float32 in a tensor of their own that the next step's kernels
        do not touch."""
        return self.forward(step, copies, feed).to(torch.float32, copy=True)

    def close(self) -> None:
        """Release the device arena, KV pool, weights, scratch and graphs (the cubins stay
        loaded in the context until the process ends)."""
        super().close()
        # Every view of the arena goes: one left behind keeps the whole allocation (the bench
        # ran out of memory opening an engine after closing one that still held `zeros`).
        self.weights = self.scratch = self.staging = self.zeros = self.gathered = None
        self.graphs = {}
