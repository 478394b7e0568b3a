"""The custom all-reduce on the CPU: its kernel's sum and flag protocol under Triton's
interpreter, with every rank's buffer in this one process; the launcher's arguments; the size
switch between it and NCCL; the mode read from KILN_ALL_REDUCE; the buffer exchange's verdicts
(one over real gloo between two processes); and its cubin in tensor-parallel engines.

The kernel spins until every peer has published the call's epoch, so one rank's call can run
here alone only after its peers' part is in place: their partial in the right half of their
buffer and their flags in this rank's table, as their own calls would leave them. The ranks
then run one after another, each finding the earlier ones' flags. The GPU tests
(tests/test_all_reduce_gpu.py) run it for real between processes.
"""
import os

# Must precede the first `import triton` anywhere: @triton.jit reads it when it decorates.
os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from gpu_build import build_cli, compiled_json  # noqa: E402
from kiln.engines.format import read_engine_file  # noqa: E402
from kiln.engines.manifest import Manifest  # noqa: E402
from kiln.plugins.all_reduce import kernels  # noqa: E402
from kiln.plugins.all_reduce.launch import CAPACITY_BYTES, MAX_WORLD, PROGRAMS, BufferLayout, launch  # noqa: E402
from kiln.plugins.all_reduce.reference import all_reduce as reference  # noqa: E402
from kiln.runtime.all_reduce import AllReduce, CustomAllReduce, all_reduce_mode  # noqa: E402
from kiln.runtime.peer_buffers import HANDLE_BYTES, Offer, PeerBufferError, PeerBuffers, agree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
interpreted = pytest.mark.skipif(not isinstance(kernels.all_reduce_kernel, InterpretedFunction),
                                 reason="runs the kernel in Triton's interpreter (set when torch sees no GPU)")
# The interpreter passes scalar arguments as 1-element arrays and converts them with int().
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# More blocks than programs, and a partial last block: program p handles blocks p and p + PROGRAMS.
ELEMENTS = (PROGRAMS + 3) * kernels.BLOCK + 48


class Ranks:
    """Every rank's shared buffer in this process, and what a rank's call leaves in them."""

    def __init__(self, world: int, dtype: torch.dtype):
        self.layout = BufferLayout(world, CAPACITY_BYTES)
        self.buffers = [torch.zeros(self.layout.nbytes, dtype=torch.uint8) for _ in range(world)]
        self.dtype = dtype

    def counters(self, rank: int) -> torch.Tensor:
        return kernels._regions(self.buffers[rank], self.layout, self.dtype)[0]

    def flags(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s flag table, [writer, program]."""
        return kernels._regions(self.buffers[rank], self.layout, self.dtype)[1].view(-1, PROGRAMS)

    def half(self, rank: int, epoch: int, n: int) -> torch.Tensor:
        data = kernels._regions(self.buffers[rank], self.layout, self.dtype)[2]
        start = (epoch % 2) * (CAPACITY_BYTES // self.dtype.itemsize)
        return data[start:start + n]

    def published(self, rank: int, epoch: int, partial: torch.Tensor) -> None:
        """What rank `rank`'s call `epoch` leaves before it waits: its partial in its buffer and
        its flags in every rank's table."""
        self.half(rank, epoch, partial.numel()).copy_(partial)
        for table in range(len(self.buffers)):
            self.flags(table)[rank] = epoch


def _partials(world: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(ELEMENTS, generator=gen).to(dtype) for _ in range(world)]


@interpreted
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rank_gets_the_same_sum_and_the_halves_alternate(world, dtype):
    ranks = Ranks(world, dtype)
    for epoch in (1, 2, 3):
        partials = _partials(world, dtype, seed=epoch)
        for peer in range(1, world):
            ranks.published(peer, epoch, partials[peer])
        earlier = ranks.half(0, epoch - 1, ELEMENTS).clone()
        results = []
        for rank in range(world):
            out = partials[rank].clone()
            kernels.run(out, ranks.buffers, rank, ranks.layout)
            results.append(out)
            assert torch.equal(ranks.counters(rank), torch.full((PROGRAMS,), epoch))
            # Checked before the next rank runs: without these flags it would wait forever.
            assert all(torch.equal(ranks.flags(t)[rank], torch.full((PROGRAMS,), epoch)) for t in range(world))
        for result in results[1:]:
            assert torch.equal(result, results[0])  # bit for bit on every rank
        if dtype == torch.float32:
            assert torch.equal(results[0], reference(partials))
        else:  # the interpreter rounds float32 to bfloat16 toward zero, the GPU to nearest
            torch.testing.assert_close(results[0], reference(partials), rtol=2 ** -7, atol=0)
        # Rank 0 wrote its partial into this epoch's half; the other half, which a slow peer may
        # still read, kept the previous call's data.
        assert torch.equal(ranks.half(0, epoch, ELEMENTS), partials[0])
        assert torch.equal(ranks.half(0, epoch - 1, ELEMENTS), earlier)


@interpreted
def test_a_peer_ahead_by_one_call_does_not_stall_the_sum():
    """A peer that has finished call e and published e + 1 has overwritten its flag for e; the
    kernel waits for "at least e", and call e's data is still in the other half."""
    ranks = Ranks(2, torch.float32)
    partials = _partials(2, torch.float32, seed=7)
    ranks.published(1, 1, partials[1])
    ranks.flags(0)[1] = 2  # rank 1 already in its next call
    out = partials[0].clone()
    kernels.run(out, ranks.buffers, 0, ranks.layout)
    assert torch.equal(out, reference(partials))


def test_launch_passes_the_kernel_what_run_passes():
    """The driver launch gives the kernel the addresses of the same regions that `run` hands the
    JIT as tensors, in its signature's order and count."""
    world, rank = 3, 1
    ranks = Ranks(world, torch.bfloat16)
    tensor = torch.zeros(4096, dtype=torch.bfloat16)
    calls = []

    class Recorder:
        def launch(self, grid, args, stream):
            calls.append((grid, args, stream))

    (aot,) = kernels.aot_kernels("bfloat16", world)
    launch(Recorder(), aot.meta, tensor, [b.data_ptr() for b in ranks.buffers], rank, ranks.layout, stream=7)
    ((grid, args, stream),) = calls
    regions = [kernels._regions(b, ranks.layout, torch.bfloat16) for b in ranks.buffers]
    counters, flags, data = ([r[i].data_ptr() for r in regions] for i in range(3))
    unused = [0] * (MAX_WORLD - world)
    assert grid == (PROGRAMS, 1, 1) and stream == 7
    assert args == [tensor.data_ptr(), tensor.data_ptr(), counters[rank], data[rank], flags[rank],
                    *data, *unused, *flags, *unused, tensor.numel(), rank]
    assert len(args) == len([t for t in aot.signature.values() if t != "constexpr"])
    assert aot.constexprs == {"WORLD": world, "CAPACITY": CAPACITY_BYTES // 2, "PROGRAMS": PROGRAMS,
                              "BLOCK": kernels.BLOCK}
    with pytest.raises(ValueError, match="does not take"):
        launch(Recorder(), aot.meta, torch.zeros(CAPACITY_BYTES, dtype=torch.bfloat16), [0] * world, rank,
               ranks.layout, stream=0)


def test_aot_kernels_serve_two_to_eight_ranks():
    assert [k.meta["world_size"] for k in kernels.aot_kernels("float32", MAX_WORLD)] == [MAX_WORLD]
    for world in (1, MAX_WORLD + 1):
        with pytest.raises(ValueError, match=f"2 to {MAX_WORLD} ranks"):
            kernels.aot_kernels("bfloat16", world)


def test_size_switch_sends_decode_sized_messages_to_the_custom_kernel():
    """Up to 512 KiB in the engine's dtype (a decode step of 64 rows of 4096 bf16) the custom
    kernel takes the message; anything else goes to NCCL, the same way on every rank."""
    custom = CustomAllReduce(kernel=None, meta={"capacity_bytes": CAPACITY_BYTES}, dtype=torch.bfloat16,
                             buffers=PeerBuffers(bases=[0, 0], rank=0, gather=list))
    both = AllReduce(custom)
    decode = torch.empty(64, 4096, dtype=torch.bfloat16)
    assert both.uses_custom(decode) and both.uses_custom(decode[:1])
    assert not both.uses_custom(torch.empty(65, 4096, dtype=torch.bfloat16))  # 520 KiB: a prefill chunk
    assert not both.uses_custom(torch.empty(64, 4096, dtype=torch.float32))  # not the engine's dtype
    assert not both.uses_custom(decode[:, :2048])  # not contiguous
    assert not both.uses_custom(torch.empty(3, 5, dtype=torch.bfloat16))  # not a multiple of 16 elements
    assert not AllReduce().uses_custom(decode)


def test_mode_comes_from_the_environment():
    assert all_reduce_mode({}) == "auto"
    assert all_reduce_mode({"KILN_ALL_REDUCE": " NCCL "}) == "nccl"
    with pytest.raises(ValueError, match=r"KILN_ALL_REDUCE='custom' is not an all-reduce mode: use 'auto'.*'nccl'"):
        all_reduce_mode({"KILN_ALL_REDUCE": "custom"})


HANDLE = bytes(range(HANDLE_BYTES))


def test_exchange_agrees_when_every_rank_offers_a_buffer():
    assert agree([Offer(4096, HANDLE), Offer(4096, HANDLE)], 4096) is None


def test_exchange_names_every_rank_that_cannot_take_part():
    reason = agree([Offer(4096, HANDLE), Offer(4096, problem="cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"),
                    Offer(1, problem="no kernel for sm_90")], 4096)
    assert reason == "rank 1: cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY; rank 2: no kernel for sm_90"


def test_exchange_refuses_offers_no_rank_of_one_build_makes():
    with pytest.raises(PeerBufferError, match="rank 1 shares a buffer of 2048 bytes, this rank one of 4096: the "
                                              "engine folder mixes builds"):
        agree([Offer(4096, HANDLE), Offer(2048, HANDLE)], 4096)
    with pytest.raises(PeerBufferError, match="rank 0 offered no valid memory handle \\(3 bytes, not 64\\)"):
        agree([Offer(4096, b"abc"), Offer(4096, HANDLE)], 4096)
    with pytest.raises(PeerBufferError, match="rank 1 offered no valid memory handle \\(0 bytes"):
        agree([Offer(4096, HANDLE), Offer(4096)], 4096)


EXCHANGE_SCRIPT = """
import datetime, json, sys
import torch.distributed as dist
from kiln.runtime.all_reduce import gloo_gather
from kiln.runtime.peer_buffers import open_peer_buffers
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
problem = "no all-reduce kernel for sm_90" if rank == 1 else "peer access unsupported"
print(json.dumps(open_peer_buffers(1 << 20, rank, gloo_gather(dist.new_group(backend="gloo")), problem)))
dist.destroy_process_group()
"""


def test_ranks_reach_the_same_verdict_over_gloo():
    """Two processes exchange their offers over a real gloo group: each learns every rank's
    problem, so both go without the custom path."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", EXCHANGE_SCRIPT, str(rank), str(port)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    verdicts = [json.loads(out) for out, _ in outputs]
    assert verdicts == ["rank 0: peer access unsupported; rank 1: no all-reduce kernel for sm_90"] * 2


def test_manifest_without_the_field_reads_as_none(factory):
    """Engines written before the field load, and sum with NCCL alone."""
    path = factory.engine(factory.checkpoint("llama3"), tp_size=2) / "rank0.engine"
    data = read_engine_file(path).manifest.to_json()
    assert data.pop("all_reduce_kernels") == {}
    assert Manifest.from_json(data).all_reduce_kernels == {}


COMPILE_SCRIPT = """
import json, sys
from kiln.plugins.aot import TARGET_CC, compile_cubin
from kiln.plugins.all_reduce.kernels import aot_kernels
sizes = {f"{dtype} {world} {target}": len(compile_cubin(kernel, target).binary)
         for dtype, world in (("bfloat16", 2), ("bfloat16", 8), ("float32", 2))
         for kernel in aot_kernels(dtype, world) for target in TARGET_CC}
sys.stdout.write(json.dumps(sizes))
"""


def test_kernel_compiles_for_every_target():
    """In a child without TRITON_INTERPRET: compiling needs the kernel built for the GPU."""
    sizes = compiled_json(COMPILE_SCRIPT)
    assert len(sizes) == 12 and all(size > 0 for size in sizes.values()), sizes


def test_tensor_parallel_gpu_engine_stores_the_kernel(factory, tmp_path):
    ckpt = factory.checkpoint("llama3")
    for tp in (1, 2):
        result = build_cli(ckpt, tmp_path / f"tp{tp}", ["cpu", "sm_90"], tmp_path / "cache",
                           extra=["--tp-size", str(tp)])
        assert result.returncode == 0, result.stderr + result.stdout
    assert read_engine_file(tmp_path / "tp1" / "rank0.engine").manifest.all_reduce_kernels == {}
    for rank in range(2):
        m = read_engine_file(tmp_path / "tp2" / f"rank{rank}.engine").manifest
        (key,) = m.all_reduce_kernels["sm_90"]
        entry = m.kernels[key]
        assert (entry.plugin, entry.target, entry.entry) == ("all_reduce", "sm_90", "all_reduce_kernel")
        assert entry.launch["world_size"] == 2 and entry.launch["capacity_bytes"] == CAPACITY_BYTES
