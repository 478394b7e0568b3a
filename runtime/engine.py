"""Loading an engine folder: one rank's engine file, its plan, and the model's tokenizer.

The runtime knows no architecture: everything it needs to run a step is in the manifest
(plan, memory plan, KV cache layout, bounds).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.plugins import PluginSpec, get_plugin
from kiln.runtime.engine_file import EngineFileError, read_engine_file


class EngineLoadError(EngineFileError):
    """An engine folder that cannot be loaded here; the message says what to do."""


@dataclass(frozen=True)
class PlanOp:
    spec: PluginSpec
    inputs: dict[str, str | None]
    attrs: dict
    output: str


@dataclass
class Engine:
    path: Path
    manifest: dict
    weights: dict[str, torch.Tensor]
    plan: list[PlanOp]

    @property
    def rank(self) -> int:
        return self.manifest["rank"]

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    @property
    def build(self) -> dict:
        return self.manifest["build"]

    @property
    def kv_cache(self) -> dict:
        return self.manifest["kv_cache"]

    @property
    def bounds(self) -> dict[str, int]:
        return self.manifest["memory_plan"]["bounds"]

    @property
    def tensors(self) -> dict[str, dict]:
        return self.manifest["tensors"]


def engine_world_size(engine_dir: str | Path) -> int:
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise EngineLoadError(f"engine folder {engine_dir} does not exist: build one with build-engine")
    ranks = sorted(engine_dir.glob("rank*.engine"))
    if not ranks:
        raise EngineLoadError(f"{engine_dir} holds no rank*.engine files: is it an engine folder built by build-engine?")
    return len(ranks)


def load_engine(engine_dir: str | Path, rank: int = 0, target: str = "cpu", verify: bool = True) -> Engine:
    """Load `rank{rank}.engine` from an engine folder, checking it belongs to this folder's
    tensor-parallel group and was built for `target`."""
    engine_dir = Path(engine_dir)
    world_size = engine_world_size(engine_dir)
    path = engine_dir / f"rank{rank}.engine"
    if not path.is_file():
        raise EngineLoadError(f"{engine_dir} has no rank{rank}.engine ({world_size} rank files found)")
    ef = read_engine_file(path, rank=rank, verify=verify)
    m = ef.manifest
    if m["world_size"] != world_size:
        raise EngineLoadError(f"{path} is rank {rank} of {m['world_size']} but the folder holds {world_size} "
                              "rank files: rebuild the engine into an empty folder")
    if target not in m["targets"]:
        raise EngineLoadError(f"engine built for {', '.join(m['targets'])}; this machine needs {target}: "
                              f"rebuild with --target {target}")
    plan = []
    for entry in m["plan"]:
        spec = get_plugin(entry["op"])
        if spec.version != entry["version"]:
            raise EngineLoadError(f"engine uses plugin {spec.name} v{entry['version']}, this Kiln has "
                                  f"v{spec.version}: rebuild the engine with this Kiln")
        plan.append(PlanOp(spec, entry["inputs"], entry["attrs"], entry["output"]))
    return Engine(engine_dir, m, ef.weights, plan)
