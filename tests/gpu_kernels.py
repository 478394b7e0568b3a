"""Loading a plugin's AOT kernels on this GPU for a test that launches them through the plugin's
driver launcher (GPU only), as the CUDA executor would: compiled for this GPU's target, loaded
through `runtime.cuda_driver`, with the scratch buffers the launcher and its kernels ask for."""
from __future__ import annotations

import importlib

import torch

from kiln.plugins.aot import compile_cubin
from kiln.runtime.cuda_executor import op_scratch


def load_plugin_kernels(plugin: str, shapes: dict, attrs: dict, max_rows: int):
    """(the plugin's launcher, its kernels for `shapes` loaded on this GPU, their metas, the
    scratch buffers the launcher takes, sized for `max_rows` rows)."""
    from kiln.plugins.driver_launch import sm_count
    from kiln.runtime.cuda_driver import device_arch, load_kernel

    arch = device_arch()
    launcher = importlib.import_module(f"kiln.plugins.{plugin}.launch")
    aot = [k for k in importlib.import_module(f"kiln.plugins.{plugin}.kernels").aot_kernels("bfloat16", shapes)
           if k.targets is None or arch in k.targets]
    limits = {"T": max_rows, "S": 1, "B": 1, "block_size": 16, "element_bytes": 2}
    # Zeroed, as the CUDA executor's arena is: the split-K arrival counts start at zero.
    scratch = {name: torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
               for name, nbytes in op_scratch(launcher, attrs, [k.meta for k in aot], limits).items()}
    cubins = [compile_cubin(k, arch) for k in aot]
    scratch["global"] = torch.zeros(max(1, sm_count() * max(c.global_scratch for c in cubins)), dtype=torch.uint8,
                                    device="cuda")
    fns = []
    for k, cubin in zip(aot, cubins):
        fn = load_kernel(cubin.binary, cubin.name, [t for t in k.signature.values() if t != "constexpr"],
                         cubin.num_warps, cubin.shared_bytes, cubin.global_scratch)
        if cubin.global_scratch:
            fn.scratch = (scratch["global"].data_ptr(), scratch["global"].numel() // cubin.global_scratch)
        fns.append(fn)
    return launcher, fns, [k.meta for k in aot], scratch
