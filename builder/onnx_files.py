"""Writing an exported ONNX model: the engine's weights as its initializers, embedded or
streamed to a side file (`OUT.onnx.data`), and the files put in place atomically.

External data is written tensor by tensor straight from the engine's memory map, so the export
never holds a second copy of the weights. Each file is written under a temporary name and
renamed, so a failed export leaves what was there before.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from kiln.atomic import atomic_file, write_bytes
from kiln.dtypes import dtype_name

PAGE = 4096  # external tensors start on a page, so onnxruntime can map them
PROTOBUF_LIMIT = 2**31 - 1
_TYPES = {"float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16", "int32": "INT32", "int64": "INT64",
          "bool": "BOOL"}


class OnnxExportError(ValueError):
    """The engine cannot be exported to ONNX as asked; the message says why and what to do."""


def onnx_module() -> ModuleType:
    """The `onnx` package, which only the export needs."""
    try:
        import onnx
        import onnx.helper
        import onnx.inliner
        import onnx.parser
    except ImportError:
        raise OnnxExportError("ONNX export needs the onnx package (1.23 or newer): "
                              "pip install 'kiln[onnx]' (or pip install onnx)") from None
    return onnx


def tensor_type(onnx: ModuleType, dtype: str) -> int:
    if dtype not in _TYPES:
        raise OnnxExportError(f"dtype {dtype!r} has no ONNX tensor type here; known: {', '.join(_TYPES)}")
    return getattr(onnx.TensorProto, _TYPES[dtype])


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy for the engine's (contiguous, memory-mapped) weights."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _initializer(onnx: ModuleType, model, name: str, t: torch.Tensor):
    init = model.graph.initializer.add()
    init.name = name
    init.data_type = tensor_type(onnx, dtype_name(t.dtype))
    init.dims.extend(t.shape)
    return init


def write_model(onnx: ModuleType, model, weights: dict[str, torch.Tensor], path: Path, external: bool) -> Path | None:
    """Add the weights to `model` and write it to `path` (and its data to `path.data` when
    `external`); returns the data file's path, or None when the weights are embedded."""
    total = sum(t.nbytes for t in weights.values())
    if not external and total > PROTOBUF_LIMIT:
        raise OnnxExportError(f"{total / 2**30:.1f} GiB of weights do not fit in one ONNX file (protobuf stops at "
                              "2 GiB): export with external data")
    if path.is_dir():
        raise OnnxExportError(f"{path} is a folder: name the .onnx file to write")
    if not external:
        for name, t in weights.items():
            _initializer(onnx, model, name, t).raw_data = bytes(_raw(t))
        write_bytes(path, model.SerializeToString())
        return None
    data_path = path.with_name(f"{path.name}.data")
    # The model is renamed into place inside the data's staging, so a failure leaves both as they were.
    with atomic_file(data_path) as f:
        for name, t in weights.items():
            f.write(bytes(-f.tell() % PAGE))
            offset = f.tell()
            f.write(_raw(t))
            init = _initializer(onnx, model, name, t)
            init.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data_path.name), ("offset", offset), ("length", t.nbytes)):
                entry = init.external_data.add()
                entry.key, entry.value = key, str(value)
        write_bytes(path, model.SerializeToString())
    return data_path
