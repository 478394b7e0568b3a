"""The custom all-reduce on the CPU: its kernel's sum and push protocol under Triton's
interpreter, with every rank's buffer in this one process; the launcher's arguments; the size
switch between it and NCCL; the mode read from KILN_ALL_REDUCE; the buffer exchange's verdicts
(one over real gloo between two processes); and its cubin in tensor-parallel engines.

The kernel spins until every peer's partial has arrived in its own buffer, so one rank's call
can run here alone only after its peers' part is in place: their partials in their slots of
this rank's buffer, as their own calls would push them. The ranks then run one after another,
each finding the earlier ones' pushes. The GPU tests (tests/test_all_reduce_gpu.py) run it for
real between processes.
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



def _elements(dtype: torch.dtype) -> int:
    """A partial last block and, where the capacity allows it (bf16), more blocks than programs:
    program p then handles blocks p and p + PROGRAMS."""
    return min((PROGRAMS + 3) * kernels.BLOCK, CAPACITY_BYTES // dtype.itemsize - kernels.BLOCK) + 48


class Ranks:
    """Every rank's shared buffer in this process, and what a rank's call leaves in them."""

    def __init__(self, world: int, dtype: torch.dtype):
        self.layout = BufferLayout(world, CAPACITY_BYTES)
        self.buffers = [torch.zeros(self.layout.nbytes, dtype=torch.uint8) for _ in range(world)]
        self.dtype = dtype

    def counters(self, rank: int) -> torch.Tensor:
        return kernels.regions(self.buffers[rank], self.layout, self.dtype)[0]

    def slot(self, rank: int, call: int, writer: int) -> torch.Tensor:
        """What `writer` pushed into `rank`'s buffer in call `call`, as the message's dtype."""
        data = kernels.regions(self.buffers[rank], self.layout, self.dtype)[1]
        return data[call % 2, writer, :_elements(self.dtype)].view(self.dtype)

    def copy_bits(self, rank: int, call: int) -> torch.Tensor:
        return kernels.regions(self.buffers[rank], self.layout, self.dtype)[1][call % 2]

    def pushed(self, writer: int, call: int, partial: torch.Tensor, into: int) -> None:
        """What `writer`'s call `call` stores into rank `into`'s buffer: its partial, +0.0 as -0.0."""
        self.slot(into, call, writer).copy_(torch.where(partial == 0, -0.0, partial))


def _partials(world: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    partials = [torch.randn(_elements(dtype), generator=gen).to(dtype) for _ in range(world)]
    partials[0][:64] = 0.0   # zeros must not look unarrived: alone, and where every rank's is zero
    for partial in partials[1:]:
        partial[32:64] = 0.0
    return partials


def _is_negative_zero(t: torch.Tensor) -> torch.Tensor:
    return (t == 0) & torch.signbit(t)


@interpreted
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rank_gets_the_same_sum_and_the_copies_alternate(world, dtype):
    ranks = Ranks(world, dtype)
    for call in (0, 1, 2):
        partials = _partials(world, dtype, seed=call)
        results = []
        for rank in range(world):
            for later in range(rank + 1, world):  # their pushes precede this rank's reads
                ranks.pushed(later, call, partials[later], into=rank)
            out = partials[rank].clone()
            kernels.run(out, ranks.buffers, rank, ranks.layout)
            results.append(out)
            assert torch.equal(ranks.counters(rank), torch.full((PROGRAMS,), call + 1))
            # Its partial went to every rank whose call had not run yet, zeros as -0.0.
            for later in range(rank + 1, world):
                assert torch.equal(ranks.slot(later, call, rank), partials[rank])
                assert bool(_is_negative_zero(ranks.slot(later, call, rank)[:64]).all()) == (rank == 0)
        for result in results[1:]:
            assert torch.equal(result, results[0])  # bit for bit on every rank
        if dtype == torch.float32:
            assert torch.equal(results[0], reference(partials))
        else:  # the interpreter rounds float32 to bfloat16 toward zero, the GPU to nearest
            torch.testing.assert_close(results[0], reference(partials), rtol=2 ** -7, atol=0)
        for rank in range(world):
            # Each rank zeroed what it read; what is left are the pushes of the ranks that ran
            # after it, which in a real call arrive before it reads. The other copy is untouched.
            copy = ranks.copy_bits(rank, call)
            for writer in range(world):
                assert bool((copy[writer] == 0).all()) == (writer <= rank)
            copy.zero_()
            assert not ranks.copy_bits(rank, call + 1).any()


@interpreted
def test_a_peer_ahead_by_one_call_does_not_disturb_the_sum():
    """A peer that has finished call c has pushed call c + 1 into the other copy already; this
    rank's call c sums its copy alone and leaves the peer's next push in place."""
    ranks = Ranks(2, torch.float32)
    now, ahead = _partials(2, torch.float32, seed=7), _partials(2, torch.float32, seed=8)
    ranks.pushed(1, 0, now[1], into=0)
    ranks.pushed(1, 1, ahead[1], into=0)
    out = now[0].clone()
    kernels.run(out, ranks.buffers, 0, ranks.layout)
    assert torch.equal(out, reference(now))
    assert torch.equal(ranks.slot(0, 1, 1), ahead[1])
    assert not ranks.copy_bits(0, 0).any()


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
    own = ranks.buffers[rank].data_ptr()
    data = [b.data_ptr() + ranks.layout.data_offset for b in ranks.buffers]
    unused = [0] * (MAX_WORLD - world)
    assert grid == (PROGRAMS, 1, 1) and stream == 7
    assert args == [tensor.data_ptr(), tensor.data_ptr(), own, data[rank], *data, *unused, tensor.numel(), rank]
    assert kernels.regions(ranks.buffers[rank], ranks.layout, torch.bfloat16)[0].data_ptr() == own
    assert len(args) == len([t for t in aot.signature.values() if t != "constexpr"])
    assert aot.constexprs == {"WORLD": world, "CAPACITY": CAPACITY_BYTES // 2, "PROGRAMS": PROGRAMS,
                              "BLOCK": kernels.BLOCK, "SIGN": -2 ** 15}
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
