"""Does programmatic dependent launch (PDL) shorten a chain of decode GEMMs? (a developer's probe)

    PYTHONPATH=. python3 scripts/probe_dependent_launch.py compile cubins.pkl   # anywhere: AOT
    PYTHONPATH=. python3 scripts/probe_dependent_launch.py run cubins.pkl       # on the GPU

A decode step at batch 1 is a chain of ~200 weight-streaming kernels. With PDL a kernel's
programs can be placed while its predecessor runs and wait in `griddepcontrol.wait`. This
times one CUDA graph of 32 layers x (qkv, o, gate/up, down) shaped split-K GEMMs (T = 1,
distinct weights, 14 GB: nothing comes from the L2), for each placement of the wait and the
signal to the next kernel (MODE), launched with and without the PDL attribute through
`runtime.cuda_driver`. Measured on an H200 on 2026-11-30 (BENCHMARKS.md): no placement gains
more than 1%, and signalling before the main loop costs 36%; Kiln's kernels do not use PDL.
"""
import ctypes
import itertools
import pickle
import sys

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.plugins.aot import AotKernel, compile_cubin, pointer_params
from kiln.plugins.linear.kernels import gemm_tile, split_k_sum
from scripts.gpu_timing import replay_ms

# MODE: 0 no PDL instructions; 1 wait, then signal, before the main loop; 2 wait only (the
# signal is implicit at exit); 3 wait first, signal after the main loop; 4 the main loop first,
# then signal and wait (reads x before the wait: only valid here, where x never changes).
VARIANTS = ("plain", "wait_trigger", "wait_only", "wait_trigger_late", "trigger_wait_late")
SHAPES = {"qkv": (6144, 4096, 4, 64), "o": (4096, 4096, 4, 64), "gate_up": (28672, 4096, 1, 32),
          "down": (4096, 14336, 4, 64)}


@triton.jit
def probe_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, T, N: tl.constexpr, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 MODE: tl.constexpr):
    if MODE == 1:
        gdc_wait()
        gdc_launch_dependents()
    if MODE == 2 or MODE == 3:
        gdc_wait()
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < T
    mask_n = offs_n < N
    acc, sumsq = gemm_tile(x_ptr, None, w_ptr, offs_m, mask_m, offs_n, mask_n, K, BLOCK_M, BLOCK_N, BLOCK_K,
                           False, False, SPLIT_K)
    if MODE == 3:
        gdc_launch_dependents()
    if MODE == 4:
        gdc_launch_dependents()
        gdc_wait()
    last = True
    if SPLIT_K > 1:
        acc, sumsq, last = split_k_sum(acc, sumsq, part_ptr, count_ptr, mask_m, BLOCK_M, BLOCK_N, SPLIT_K, False)
    if last:
        out_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def launcher(kernel, pdl: bool):
    """`kernel.launch`, or a launch with the programmatic-stream-serialization attribute."""
    if not pdl:
        return kernel.launch
    from cuda.bindings import driver

    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.attrs, config.numAttrs = [attr], 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 32 * kernel.num_warps, 1, 1
    config.sharedMemBytes = kernel.shared_bytes

    def launch(grid, args, stream):
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.hStream = stream
        pointers = kernel.params(args)
        err, = driver.cuLaunchKernelEx(config, kernel.function, ctypes.addressof(pointers), 0)
        assert err == driver.CUresult.CUDA_SUCCESS, err
    return launch


def kernels() -> list:
    out = []
    for (name, (n, k, split, bn)), mode in itertools.product(SHAPES.items(), range(len(VARIANTS))):
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
               "part_ptr": "*fp32" if split > 1 else "constexpr", "count_ptr": "*i32" if split > 1 else "constexpr",
               "T": "i32", "N": "constexpr", "K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
               "BLOCK_K": "constexpr", "SPLIT_K": "constexpr", "MODE": "constexpr"}
        cx = {"N": n, "K": k, "BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": split, "MODE": mode}
        if split == 1:
            cx.update(part_ptr=None, count_ptr=None)
        out.append(((name, mode), AotKernel(probe_kernel, sig, cx, num_warps=4, num_stages=3,
                                            aligned=pointer_params(sig))))
    return out


def compile_all(path: str) -> None:
    entries = [(key, k.signature, compile_cubin(k, "sm_90")) for key, k in kernels()]
    with open(path, "wb") as f:
        pickle.dump(entries, f)
    print(len(entries), "cubins")


def run_all(path: str) -> None:
    import torch
    from kiln.runtime.cuda_driver import load_kernel
    with open(path, "rb") as f:
        entries = pickle.load(f)
    layers = 32
    x = torch.randn(16, 14336, device="cuda", dtype=torch.bfloat16)
    ws = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
          for name, (n, k, _, _) in SHAPES.items()}
    outs = {name: torch.empty(16, n, device="cuda", dtype=torch.bfloat16) for name, (n, _, _, _) in SHAPES.items()}
    part = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    count = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    copy = 2 * src.numel() / replay_ms(lambda: dst.copy_(src)) / 1e9
    wbytes = sum(w.nbytes for l in ws.values() for w in l)
    print(f"copy {copy:.2f} TB/s; weights {wbytes / 1e9:.2f} GB -> limit {wbytes / copy / 1e9:.3f} ms")
    for mode, variant in enumerate(VARIANTS):
        for pdl in ([False, True] if mode else [False]):
            fns = {}
            for (name, m), sig, cubin in entries:
                if m == mode:
                    fns[name] = launcher(load_kernel(cubin.binary, cubin.name,
                                                     [t for t in sig.values() if t != "constexpr"],
                                                     cubin.num_warps, cubin.shared_bytes), pdl)
            def step():
                s = torch.cuda.current_stream().cuda_stream
                for l in range(layers):
                    for name, (n, k, split, bn) in SHAPES.items():
                        ws_args = [part.data_ptr(), count.data_ptr()] if split > 1 else []
                        fns[name]((1, n // bn, split), [x.data_ptr(), ws[name][l].data_ptr(),
                                         outs[name].data_ptr(), *ws_args, 1], s)
            t = replay_ms(step)
            print(f"{variant:18s} pdl={pdl!s:5s}: {t:.3f} ms  ({wbytes / t / 1e9:.2f} TB/s)")
    ref = x[:1, :4096].float() @ ws["o"][layers - 1].float().T
    print("rel err o", ((outs["o"][:1].float() - ref).norm() / ref.norm()).item())


if __name__ == "__main__":
    {"compile": compile_all, "run": run_all}[sys.argv[1]](sys.argv[2])
