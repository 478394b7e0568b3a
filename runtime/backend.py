"""Where an engine runs: the device it runs on, its KV pool, the executor that runs its steps
there (the CPU, one GPU, or one worker process per tensor-parallel rank) and the tokenizer its
text goes through.

`EngineCore` asks this module once, when it opens an engine folder; the engine loop itself
only sees what it returns.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kiln.runtime.all_reduce import all_reduce_mode
from kiln.runtime.cuda_driver import device_arch
from kiln.runtime.cuda_executor import CudaExecutor
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.engine import Engine, EngineLoadError, load_engine
from kiln.runtime.executor import CpuExecutor, InputRegion
from kiln.runtime.kv_cache import BlockManager
from kiln.runtime.kv_pool import KVPool, size_kv_pool
from kiln.runtime.tp_executor import TensorParallelExecutor

log = logging.getLogger(__name__)


def open_engine(engine_dir: str | Path, device: str | None) -> tuple[Engine, bool]:
    """Rank 0 of the engine folder, read once, and whether it runs on the GPU: "auto" (or None)
    picks the GPU when there is one and the engine holds cubins for its arch, the CPU otherwise.
    `device` was checked with the other options (`engine_core.check_engine_options`)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineLoadError("device 'cuda' was asked for but torch sees no CUDA GPU here: "
                              "use device 'cpu' (an engine built with --target cpu) or 'auto'")
    engine = load_engine(engine_dir, target=None)
    on_gpu = device == "cuda" or (device in (None, "auto") and torch.cuda.is_available()
                                  and device_arch() in engine.manifest.targets)
    # A GPU runs the cubins built for its arch, so the engine must list that target.
    engine.require_target(device_arch() if on_gpu else "cpu")
    return engine, on_gpu


def kv_pool(engine: Engine, on_gpu: bool, kv_cache_fraction: float | None, max_kv_tokens: int | None,
            prefix_caching: bool) -> tuple[KVPool, BlockManager]:
    """The KV pool chosen for `engine` (runtime/kv_pool.py says how), logged, and the block
    manager over its blocks."""
    pool = size_kv_pool(engine, on_gpu, kv_cache_fraction, max_kv_tokens)
    log.info(pool.describe())
    return pool, BlockManager(pool.num_blocks, pool.block_size, prefix_caching)


def open_executor(engine: Engine, on_gpu: bool, num_blocks: int, worker_timeout: float):
    """The executor for `engine` with a pool of `num_blocks` KV blocks; a tensor-parallel engine
    gets one worker process per rank, summing over the ranks as KILN_ALL_REDUCE says
    (`runtime.all_reduce`)."""
    world = engine.manifest.world_size
    if on_gpu and world > torch.cuda.device_count():
        raise EngineLoadError(f"this engine has {world} tensor-parallel ranks, one GPU each, but this machine has "
                              f"{torch.cuda.device_count()} GPU(s): rebuild with --tp-size "
                              f"{torch.cuda.device_count()} or fewer, or run it on a machine with {world} GPUs")
    if world > 1:
        return TensorParallelExecutor(engine.path, world, num_blocks, InputRegion(engine), worker_timeout,
                                      "cuda" if on_gpu else "cpu", all_reduce_mode())
    return CudaExecutor(engine, num_blocks) if on_gpu else CpuExecutor(engine, num_blocks)


def open_tokenizer(engine: Engine) -> tuple[Tokenizer | None, Detokenizer | None]:
    """The engine folder's tokenizer and the detokenizer over it; None for both when the
    checkpoint had no tokenizer (then requests give token ids)."""
    name = engine.manifest.tokenizer_file
    if name is None:
        return None, None
    tokenizer = Tokenizer.from_file(str(engine.path / name))
    return tokenizer, Detokenizer(tokenizer)
