"""Acceptance: engines built with --tp-size 2 and 4, run as that many torch.distributed (gloo)
processes, give the same logits as the --tp-size 1 engine (relative 1e-5), step after step.

The scenario (tests/tp_worker.py): one step with two prefills of different lengths (one asking
for all its logits), then 8 greedy decode steps of both sequences. qwen2 with 8 heads and 2 kv
heads has q/k/v biases and, at tp 4, kv heads replicated over ranks; llama3 with 4 heads and 4
kv heads at tp 2 splits its kv heads.
"""
from __future__ import annotations

import multiprocessing.connection
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import tp_worker  # noqa: E402  (tests/ is on sys.path: pytest rootdir-relative import of a package-less tests folder)

from kiln.builder.build import build_engine  # noqa: E402
from kiln.builder.config import BuildConfig  # noqa: E402
from kiln.models.random_checkpoint import write_random_checkpoint  # noqa: E402
from kiln.runtime.engine import load_engine  # noqa: E402

TOL = 1e-5
JOIN_TIMEOUT_S = 120


@dataclass(frozen=True)
class Family:
    name: str
    num_heads: int
    num_kv_heads: int
    tp_sizes: tuple[int, ...]
    hidden: int = 64

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


FAMILIES = {
    # q/k/v biases; 2 kv heads over 4 ranks are replicated (each on 2 ranks).
    "qwen2": Family("qwen2", num_heads=8, num_kv_heads=2, tp_sizes=(2, 4)),
    # 4 kv heads split over 2 ranks, 2 each.
    "llama3": Family("llama3", num_heads=4, num_kv_heads=4, tp_sizes=(2,)),
    # Gemma 3: a post-norm after each row-parallel projection (normed after the sum), q/k norm,
    # GeGLU, windowed and global layers, soft-capped logits.
    "gemma3": Family("gemma3", num_heads=4, num_kv_heads=2, tp_sizes=(2,)),
}
CASES = [(name, tp) for name, fam in FAMILIES.items() for tp in fam.tp_sizes]
parametrize_cases = pytest.mark.parametrize("family,tp", CASES, ids=[f"{f}-tp{t}" for f, t in CASES])


@dataclass
class Built:
    family: Family
    engines: dict[int, Path]
    reference: dict


def _build_config(tp: int) -> BuildConfig:
    return BuildConfig(max_batch_size=8, max_seq_len=64, max_num_tokens=64, kv_block_size=4, tp_size=tp)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """get(family) -> Built, made once per family for the whole module: one random checkpoint,
    its engines for tp 1 and the family's tp sizes, and the tp 1 engine's scenario result, run
    in this process without torch.distributed."""
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            fam = FAMILIES[name]
            root = tmp_path_factory.mktemp(f"tp-{name}")
            ckpt = write_random_checkpoint(root / "ckpt", name, hidden_size=fam.hidden, num_layers=2,
                                           num_heads=fam.num_heads, num_kv_heads=fam.num_kv_heads,
                                           intermediate_size=128, dtype="float32", seed=0)
            engines = {}
            for tp in (1, *fam.tp_sizes):
                engines[tp] = root / f"engine-tp{tp}"
                build_engine(ckpt, engines[tp], _build_config(tp))
            assert not dist.is_initialized()
            cache[name] = Built(fam, engines, tp_worker.run_scenario(load_engine(engines[1], 0)))
        return cache[name]

    return get


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(engine_dir: Path, world_size: int, out_dir: Path) -> list[dict]:
    """Run the scenario on every rank of `engine_dir` as `world_size` spawned processes;
    returns each rank's result. Fails the test, stopping every process, if one exits
    non-zero or they do not all finish within JOIN_TIMEOUT_S."""
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    outs = [out_dir / f"rank{r}.pt" for r in range(world_size)]
    procs = [ctx.Process(target=tp_worker.run_rank, args=(r, world_size, str(engine_dir), port, str(outs[r])),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    started = time.monotonic()
    deadline = started + JOIN_TIMEOUT_S
    try:
        # Stop waiting as soon as one rank fails: the others would block in a collective.
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()],
                                            timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        elapsed = time.monotonic() - started
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    if failed or hung:
        errors = "\n".join(f"--- rank {r}:\n{Path(str(o) + '.err').read_text()}"
                           for r, o in enumerate(outs) if Path(str(o) + ".err").is_file())
        pytest.fail(f"tp {world_size}: (rank, exit code) of failed ranks {failed}; ranks still running after "
                    f"{elapsed:.0f} s (limit {JOIN_TIMEOUT_S} s), terminated: {hung}\n{errors}")
    return [torch.load(o) for o in outs]


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@parametrize_cases
def test_tp_logits_match_tp1(builds, family, tp, tmp_path):
    built = builds(family)
    ref = built.reference
    results = run_tp(built.engines[tp], tp, tmp_path)
    rank0 = results[0]
    assert len(rank0["logits"]) == len(ref["logits"]) == 1 + tp_worker.DECODE_STEPS
    for step, (got, want) in enumerate(zip(rank0["logits"], ref["logits"])):
        assert got.dtype == torch.float32 and got.shape == want.shape, f"step {step}"
        # prefill: 7 rows for the all-logits sequence + 1; decode: 1 per sequence
        assert got.shape[0] == (len(tp_worker.PROMPTS[0]) + 1 if step == 0 else 2)
        assert torch.isfinite(got).all()
        diff = _rel_diff(got, want)
        assert diff <= TOL, f"{family} tp {tp}, step {step}: max |diff| / max |ref| = {diff:.3g}"
    assert rank0["tokens"] == ref["tokens"]
    # Every rank computes the full logits (the LM head is replicated after the all-reduces).
    for r, res in enumerate(results[1:], start=1):
        assert res["tokens"] == rank0["tokens"], f"rank {r}"
        for step, (got, want) in enumerate(zip(res["logits"], rank0["logits"])):
            assert torch.equal(got, want), f"rank {r} step {step}: logits differ from rank 0's"


def _kv_head_first(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    if num_kv_heads % world == 0:
        return rank * (num_kv_heads // world), num_kv_heads // world
    return rank // (world // num_kv_heads), 1


def _first_layer_qkv(engine) -> dict[int, torch.Tensor]:
    """The first layer's fused qkv weight (dim 2) and, if any, bias (dim 1), by dimension."""
    found = {w.dim(): w for name, w in engine.weights.items() if "qkv" in name and "layers.0." in name}
    assert 2 in found, f"no first-layer qkv weight among {sorted(engine.weights)}"
    return found


@parametrize_cases
def test_qkv_weights_are_sharded(builds, family, tp):
    built = builds(family)
    fam = built.family
    hd, nh, nkv = fam.head_dim, fam.num_heads, fam.num_kv_heads
    full = _first_layer_qkv(load_engine(built.engines[1], 0))
    assert full[2].shape[0] == (nh + 2 * nkv) * hd
    assert (1 in full) == (fam.name == "qwen2")
    shards = {}
    for rank in range(tp):
        engine = load_engine(built.engines[tp], rank)
        assert (engine.manifest.rank, engine.manifest.world_size) == (rank, tp)
        shards[rank] = _first_layer_qkv(engine)
        qn = nh // tp
        k0, kn = _kv_head_first(nkv, rank, tp)
        assert shards[rank][2].shape[0] < full[2].shape[0]
        assert shards[rank][2].shape == ((qn + 2 * kn) * hd, fam.hidden)
        assert engine.manifest.kv.num_kv_heads == kn
        # This rank's rows are exactly its heads' rows of the tp 1 weight (and bias).
        q_rows, kv_rows = nh * hd, nkv * hd
        for dim, w in full.items():
            q, k, v = w[:q_rows], w[q_rows:q_rows + kv_rows], w[q_rows + kv_rows:]
            want = torch.cat([q[rank * qn * hd:(rank + 1) * qn * hd], k[k0 * hd:(k0 + kn) * hd],
                              v[k0 * hd:(k0 + kn) * hd]])
            assert torch.equal(shards[rank][dim], want), f"rank {rank} qkv dim {dim}"
    assert not torch.equal(shards[0][2], shards[1][2])
