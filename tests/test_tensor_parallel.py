"""Acceptance: engines built with --tp-size 2 and 4, run as that many torch.distributed (gloo)
processes, give the same logits as the --tp-size 1 engine (relative 1e-5), step after step.

The scenario (tests/tp_worker.py): one step with two prefills of different lengths (one asking
for all its logits), then 8 greedy decode steps of both sequences. qwen2 with 8 heads and 2 kv
heads has q/k/v biases and, at tp 4, kv heads replicated over ranks; llama3 with 4 heads and 4
kv heads at tp 2 splits its kv heads. The LM head is vocabulary parallel (each rank keeps its
rows, the logits are gathered) with untied and tied embeddings; a vocabulary that does not
divide over the ranks keeps it whole.
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
    vocab: int = 512
    tie: bool | None = None  # the family's choice of tied embeddings unless set

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
    # The LM head's weight is the embedding's (qwen2 above is untied).
    "qwen2-tied": Family("qwen2", num_heads=8, num_kv_heads=2, tp_sizes=(2,), tie=True),
    # 513 rows do not split over 2 ranks: the head runs whole on each.
    "llama3-uneven-vocab": Family("llama3", num_heads=4, num_kv_heads=4, tp_sizes=(2,), vocab=513),
}
CASES = [(name, tp) for name, fam in FAMILIES.items() for tp in fam.tp_sizes]
parametrize_cases = pytest.mark.parametrize("family,tp", CASES, ids=[f"{f}-tp{t}" for f, t in CASES])


@dataclass
class Built:
    family: Family
    engines: dict[int, Path]
    reference: dict
    notes: dict[int, list[str]]  # each build summary's notes


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
            ckpt = write_random_checkpoint(root / "ckpt", fam.name, hidden_size=fam.hidden, num_layers=2,
                                           num_heads=fam.num_heads, num_kv_heads=fam.num_kv_heads,
                                           intermediate_size=128, vocab_size=fam.vocab, dtype="float32", seed=0,
                                           tie_word_embeddings=fam.tie)
            engines, notes = {}, {}
            for tp in (1, *fam.tp_sizes):
                engines[tp] = root / f"engine-tp{tp}"
                notes[tp] = build_engine(ckpt, engines[tp], _build_config(tp)).notes
            assert not dist.is_initialized()
            cache[name] = Built(fam, engines, tp_worker.run_scenario(load_engine(engines[1], 0)), notes)
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
    # Every rank holds the full logits (gathered from the ranks' slices of the vocabulary).
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


def _lm_head(engine):
    """The plan's LM head (the linear whose source is the model's lm_head) and its weight."""
    (head,) = [op for op in engine.manifest.plan if op.op == "linear" and op.source == "lm_head"]
    return head, engine.weights[head.inputs["weight"]]


@parametrize_cases
def test_lm_head_keeps_this_ranks_rows_of_the_vocabulary(builds, family, tp):
    """Each rank's LM head weight is its [vocab / tp, hidden] rows of the tp 1 head (a tied
    embedding stays whole beside it) and the logits are whole; an uneven vocabulary keeps the
    head whole, and the build summary says so."""
    built = builds(family)
    fam = built.family
    _, whole = _lm_head(load_engine(built.engines[1], 0))
    assert whole.shape == (fam.vocab, fam.hidden) and built.notes[1] == []
    even = fam.vocab % tp == 0
    per = fam.vocab // tp if even else fam.vocab
    for rank in range(tp):
        engine = load_engine(built.engines[tp], rank)
        head, weight = _lm_head(engine)
        assert head.attrs.get("all_gather", 0) == (tp if even else 0)
        rows = slice(rank * per, (rank + 1) * per) if even else slice(None)
        assert torch.equal(weight, whole[rows])
        embed = next(op for op in engine.manifest.plan if op.op == "embedding")
        assert engine.weights[embed.inputs["weight"]].shape == (fam.vocab, fam.hidden)
        assert engine.manifest.tensors[engine.manifest.logits].shape == ("L", fam.vocab)
    if even:
        assert built.notes[tp] == []
    else:
        assert built.notes[tp] == [f"the LM head runs whole on every rank: its vocabulary ({fam.vocab}) does not "
                                   f"split evenly over --tp-size {tp}"]


def test_fp8_lm_head_is_cut_with_its_scales(tmp_path):
    """--quantization fp8 --quantize-lm-head at tp 2, embeddings tied: each rank's e4m3 head
    holds its rows of the tp 1 head with their scales, the embedding stays whole, and the
    logits and tokens are tp 1's. Calibrated (static) activation scales quantize each element
    alike whether a row-parallel projection sees all of a token or its rank's slice."""
    ckpt = write_random_checkpoint(tmp_path / "ckpt", "qwen2", hidden_size=64, num_layers=2, num_heads=8,
                                   num_kv_heads=2, intermediate_size=128, dtype="float32", seed=0,
                                   tie_word_embeddings=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\njumps over the lazy dog\n")
    engines = {}
    for tp in (1, 2):
        engines[tp] = tmp_path / f"engine-tp{tp}"
        cfg = BuildConfig(max_batch_size=8, max_seq_len=64, max_num_tokens=64, kv_block_size=4, tp_size=tp,
                          quantization="fp8", quantize_lm_head=True, calibration_prompts=str(prompts),
                          activation_scales="static")
        build_engine(ckpt, engines[tp], cfg)
    whole_engine = load_engine(engines[1], 0)
    whole_head, whole = _lm_head(whole_engine)
    whole_scale = whole_engine.weights[whole_head.inputs["weight_scale"]]
    assert whole.dtype == torch.float8_e4m3fn and whole.shape == (512, 64)
    for rank in range(2):
        engine = load_engine(engines[2], rank)
        head, weight = _lm_head(engine)
        rows = slice(rank * 256, (rank + 1) * 256)
        assert torch.equal(weight.view(torch.uint8), whole[rows].view(torch.uint8))
        assert torch.equal(engine.weights[head.inputs["weight_scale"]], whole_scale[rows])
        embed = next(op for op in engine.manifest.plan if op.op == "embedding")
        assert engine.weights[embed.inputs["weight"]].shape == (512, 64)
    want = tp_worker.run_scenario(whole_engine)
    got = run_tp(engines[2], 2, tmp_path)[0]
    for step, (a, b) in enumerate(zip(got["logits"], want["logits"])):
        assert _rel_diff(a, b) <= TOL, f"step {step}: max |diff| / max |ref| = {_rel_diff(a, b):.3g}"
    assert got["tokens"] == want["tokens"]
