"""Loading one rank of an engine folder: its engine file, read once, and the plugins of its plan.

The runtime knows no architecture: everything it needs to run a step is in the engine's typed
`Manifest` (plan, memory plan, KV-cache layout, step limits) and its weights and kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.engines.format import EngineFileError, read_engine_file
from kiln.engines.manifest import Manifest
from kiln.plugins import PluginSpec, get_plugin


class EngineLoadError(EngineFileError):
    """An engine folder that cannot be loaded here; the message says what to do."""


@dataclass(frozen=True)
class PlanOp:
    spec: PluginSpec
    inputs: dict[str, str | None]
    attrs: dict
    output: str
    kernel_keys: dict[str, tuple[str, ...]]  # per GPU target


@dataclass
class Engine:
    path: Path                     # the engine folder
    manifest: Manifest
    weights: dict[str, torch.Tensor]
    kernels: dict[str, bytes]      # every target's kernel blobs, by key
    plan: list[PlanOp]

    def require_target(self, target: str) -> None:
        """Refuse to run where the engine was not built for: `target` is a GPU arch or "cpu"."""
        if target not in self.manifest.targets:
            raise EngineLoadError(f"engine built for {', '.join(self.manifest.targets)}; this machine needs "
                                  f"{target}: rebuild with --target {target}")


def engine_world_size(engine_dir: str | Path) -> int:
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise EngineLoadError(f"engine folder {engine_dir} does not exist: build one with build-engine")
    ranks = sorted(engine_dir.glob("rank*.engine"))
    if not ranks:
        raise EngineLoadError(f"{engine_dir} holds no rank*.engine files: is it an engine folder built by build-engine?")
    return len(ranks)


def load_engine(engine_dir: str | Path, rank: int = 0, target: str | None = "cpu", verify: bool = True) -> Engine:
    """Load `rank{rank}.engine` from an engine folder, checking it belongs to this folder's
    tensor-parallel group and, unless `target` is None, that it was built for `target`."""
    engine_dir = Path(engine_dir)
    world_size = engine_world_size(engine_dir)
    path = engine_dir / Manifest.rank_file(rank)
    if not path.is_file():
        raise EngineLoadError(f"{engine_dir} has no {path.name} ({world_size} rank files found)")
    ef = read_engine_file(path, rank=rank, verify=verify)
    m = ef.manifest
    if m.world_size != world_size:
        raise EngineLoadError(f"{path} is rank {rank} of {m.world_size} but the folder holds {world_size} "
                              "rank files: rebuild the engine into an empty folder")
    plan = []
    for entry in m.plan:
        spec = get_plugin(entry.op)
        if spec.version != entry.version:
            raise EngineLoadError(f"engine uses plugin {spec.name} v{entry.version}, this Kiln has "
                                  f"v{spec.version}: rebuild the engine with this Kiln")
        # In the plugin's input order, which the executors pass them in; an optional input the
        # plugin gained after the engine was built (attention's kv_scales) is absent.
        inputs = {name: entry.inputs.get(name) for name in spec.input_names}
        plan.append(PlanOp(spec, inputs, entry.attrs, entry.output, entry.kernel_keys))
    engine = Engine(engine_dir, m, ef.weights, ef.kernels, plan)
    if target is not None:
        engine.require_target(target)
    return engine
