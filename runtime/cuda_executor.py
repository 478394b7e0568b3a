"""The CUDA executor: runs an engine's plan for one step on the GPU with the engine's cubins.

Nothing is compiled here. The cubins that `build-engine` stored for this GPU's arch are loaded
with the driver API (`runtime.cuda_driver`), and each plan op is launched by its plugin's
`launch.py`, which mirrors what the plugin's `kernels.run` does through Triton's JIT. Memory is
set up once, as in the CPU executor: the weights are uploaded when the executor is built, one
arena on the device holds the step inputs and activations at the memory plan's offsets, the
KV cache is one pool, and the ops' scratch buffers (split-KV workspaces, attention_o_proj's
intermediate) are allocated for the engine's bounds. A step copies its inputs in, launches
every kernel on torch's current stream and copies the logits out; it allocates no device
memory. CUDA graphs come later.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from runtime.cuda_driver import CudaKernel, device_arch, load_kernel
from runtime.engine import Engine, EngineLoadError
from runtime.engine_file import read_engine_file
from runtime.executor import DTYPES, ArenaExecutor
from runtime.step import StepInputs


@dataclass(frozen=True)
class _CudaOp:
    """One plan op, ready to launch: its plugin's launcher and loaded kernels."""

    launcher: ModuleType
    kernels: list[CudaKernel]
    metas: list[dict]
    inputs: list[str | None]
    attrs: dict
    output: str


def _launcher(op_name: str) -> ModuleType:
    try:
        return importlib.import_module(f"plugins.{op_name}.launch")
    except ModuleNotFoundError as e:
        if e.name != f"plugins.{op_name}.launch":
            raise
        raise EngineLoadError(f"op {op_name!r} has no CUDA launcher (plugins/{op_name}/launch.py): "
                              "this engine cannot run on the GPU yet; use device='cpu'") from None


class CudaExecutor(ArenaExecutor):
    """Same interface as `CpuExecutor`: `run(step, copies)` returns the logits [L, vocab] as
    float32 on the CPU; `kv_cache` is the device pool [layers, 2, blocks, block_size, kv_heads,
    head_dim]."""

    def __init__(self, engine: Engine, num_kv_blocks: int):
        if engine.world_size > 1:
            # Row-parallel ops need their partial outputs summed over ranks (NCCL); not yet.
            raise EngineLoadError(f"this engine has {engine.world_size} tensor-parallel ranks; the CUDA executor "
                                  "runs single-rank engines only so far: build with --tp-size 1")
        if not torch.cuda.is_available():
            raise EngineLoadError("no CUDA device is visible to torch: use device='cpu'")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.arch = device_arch()
        if self.arch not in engine.manifest["targets"]:
            raise EngineLoadError(f"engine built for {', '.join(engine.manifest['targets'])}; this GPU needs "
                                  f"{self.arch}: rebuild with --target {self.arch}")
        # Torch's allocations come first: they make its primary context current, which is
        # the context load_kernel loads the cubins into.
        super().__init__(engine, num_kv_blocks, self.device)
        self.weights = {name: w.to(self.device) for name, w in engine.weights.items()}
        self.ops = self._load_ops()
        self.scratch = self._allocate_scratch()

    def _load_ops(self) -> list[_CudaOp]:
        m = self.engine.manifest
        # The Engine keeps no kernel blobs; they are memory-mapped from its file again here.
        blobs = read_engine_file(self.engine.path / f"rank{self.engine.rank}.engine", rank=self.engine.rank,
                                 verify=False).kernels
        loaded: dict[str, CudaKernel] = {}
        ops = []
        for op, entry in zip(self.engine.plan, m["plan"]):
            keys = entry.get("kernel_keys", {}).get(self.arch)
            if not keys:
                raise EngineLoadError(f"plan op {op.spec.name} -> {op.output} has no kernels for {self.arch}: "
                                      f"rebuild with --target {self.arch}")
            for key in keys:
                if key not in loaded:
                    info = m["kernels"][key]
                    loaded[key] = load_kernel(blobs[key], info["entry"], info["signature"],
                                              info["num_warps"], info["shared_bytes"])
            ops.append(_CudaOp(_launcher(op.spec.name), [loaded[k] for k in keys],
                               [m["kernels"][k]["launch"] for k in keys], list(op.inputs.values()),
                               op.attrs, op.output))
        return ops

    def _allocate_scratch(self) -> dict[str, torch.Tensor]:
        """One uint8 buffer per scratch name, sized for the largest need of any op."""
        kv = self.engine.kv_cache
        limits = {**self.engine.bounds, "block_size": kv["block_size"],
                  "element_bytes": DTYPES[self.engine.build["dtype"]].itemsize}
        sizes: dict[str, int] = {}
        for op in self.ops:
            if hasattr(op.launcher, "scratch_bytes"):
                for name, nbytes in op.launcher.scratch_bytes(op.attrs, limits).items():
                    sizes[name] = max(sizes.get(name, 0), nbytes)
        return {name: torch.empty(nbytes, dtype=torch.uint8, device=self.device) for name, nbytes in sizes.items()}

    def run(self, step: StepInputs, copies: list[tuple[int, int]] = ()) -> torch.Tensor:
        """Run one step, after the copy-on-write block copies the scheduler asked for; returns
        the logits of the requested rows, [L, vocab] in float32 on the CPU."""
        dims, values = self._begin(step, copies)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for op in self.ops:
            args = [None if t is None else values[t] if t in values else self.weights[t] for t in op.inputs]
            out = self._view(op.output, dims)
            op.launcher.launch(op.kernels, op.metas, args, op.attrs, out, dims, stream, self.scratch)
            values[op.output] = out
        # The copy to the host waits for the step's kernels on this stream.
        return values[self.output].cpu().float()

    def close(self) -> None:
        """Release the device arena, KV pool, weights and scratch (the cubins stay loaded in
        the context until the process ends)."""
        super().close()
        self.weights = self.scratch = None
