"""What the GPU parity tests compare and how (tests/test_gpu_parity.py): prompts, Kiln's greedy
generation through a Session, teacher-forced logits from Kiln's executor and from transformers,
argmax agreement, relative error, and the checkpoints and engines kept in KILN_GPU_WORKDIR."""
from __future__ import annotations

import gc
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch
from transformers import AutoModelForCausalLM

from gpu_build import build_cli
from kiln.models.random_checkpoint import write_random_checkpoint
from kiln.runtime import SamplingParams, Session
from kiln.runtime.engine import load_engine
from kiln.runtime.executor import CpuExecutor
from kiln.runtime.step import SequenceChunk, pack_step

ROOT = Path(__file__).resolve().parents[1]
NUM_PROMPTS, MAX_TOKENS, PROMPT_LENS = 16, 64, (8, 100)

# -- what is compared, and how ----------------------------------------------------------------

def make_prompts(vocab_size: int, n: int = NUM_PROMPTS, lengths: tuple[int, int] = PROMPT_LENS,
                 seed: int = 0) -> list[list[int]]:
    """`n` prompts of random ids from 3 up (0-2 are the tokenizer's specials), their lengths
    spread evenly over `lengths` (both ends included) in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    lens = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]
    lens = [lens[i] for i in torch.randperm(n, generator=g).tolist()]
    return [torch.randint(3, vocab_size, (k,), generator=g).tolist() for k in lens]


def kiln_generate(engine_dir, device: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy tokens of every prompt, all submitted to one Session at once (in-flight batching)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Session(engine_dir, device=device) as session:
        outputs = session.generate(prompt_token_ids=prompts, sampling_params=params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert [len(t) for t in tokens] == [max_tokens] * len(prompts)
    return tokens


def open_executor(engine_dir, device: str):
    """The engine's executor for `device`, with KV blocks for one sequence of max_seq_len."""
    if device == "cuda":
        from kiln.runtime.cuda_driver import device_arch
        from kiln.runtime.cuda_executor import CudaExecutor

        engine = load_engine(engine_dir, target=device_arch())
        return CudaExecutor(engine, engine.manifest.blocks_per_sequence)
    engine = load_engine(engine_dir)
    return CpuExecutor(engine, engine.manifest.blocks_per_sequence)


def teacher_forced_tokens(prompt: list[int], generated: list[int]) -> tuple[list[int], int]:
    """The tokens to feed (the prompt, then every generated token but the last) and the first
    position whose logits predicted a generated token (the prompt's last)."""
    return list(prompt) + list(generated[:-1]), len(prompt) - 1


def kiln_teacher_forced(executor, prompt: list[int], generated: list[int],
                        max_chunk: int | None = None) -> torch.Tensor:
    """Kiln's logits at the len(generated) positions that predicted `generated`, [n, vocab]
    float32 on the CPU. The sequence runs as prefill chunks within the engine's bounds (the
    ones holding those positions ask for every logit), in blocks 0.. of the executor's pool,
    which each call overwrites from position 0."""
    m = executor.engine.manifest
    block_size = m.kv.block_size
    tokens, first = teacher_forced_tokens(prompt, generated)
    table = list(range(m.blocks_per_sequence))
    rows, pos = [], 0
    while pos < len(tokens):
        wanted = pos >= first
        limit = min(m.max_num_tokens, m.max_batch_size) if wanted else m.max_num_tokens
        limit = min(limit, max_chunk or limit)
        end = min(pos + limit, len(tokens) if wanted else first)
        step = pack_step([SequenceChunk(tokens[pos:end], pos, table, all_logits=wanted)], block_size, m.blocks_per_sequence)
        logits = executor.run(step)
        if wanted:
            rows.append(logits.float().cpu())
        pos = end
    return torch.cat(rows)


def hf_teacher_forced(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits at the same positions as `kiln_teacher_forced`, float32 on the CPU."""
    tokens, first = teacher_forced_tokens(prompt, generated)
    ids = torch.tensor([tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        return model(ids).logits[0, first:].float().cpu()


def argmax_agreement(tokens: list[list[int]], ref_logits: list[torch.Tensor]) -> tuple[float, float]:
    """Over every position: (share where the token is an argmax of the reference's logits, exact
    ties included; share where it is the reference's first argmax)."""
    hits = first = total = 0
    for toks, logits in zip(tokens, ref_logits, strict=True):
        assert logits.shape[0] == len(toks), (logits.shape, len(toks))
        t = torch.tensor(toks)
        hits += int((logits.gather(1, t[:, None])[:, 0] == logits.max(dim=1).values).sum())
        first += int((logits.argmax(dim=1) == t).sum())
        total += len(toks)
    return hits / total, first / total


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """Per sequence, ||got - want||_2 / ||want||_2 over all its positions and the vocabulary,
    in float32."""
    errors = []
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape, (g.shape, w.shape)
        g, w = g.float(), w.float()
        errors.append(float(torch.linalg.vector_norm(g - w) / torch.linalg.vector_norm(w)))
    return errors


def report(name: str, tokens: list[list[int]], agreement: tuple[float, float], errors: list[float],
           extra: str = "") -> str:
    n = sum(len(t) for t in tokens)
    return (f"{name}: agreement {agreement[0]:.4f} (first argmax {agreement[1]:.4f}) over {n} tokens; "
            f"logits rel err max {max(errors):.2e} median {median(errors):.2e}{extra}")


def publish(line: str, record_property) -> None:
    print(line)
    record_property("parity", line)  # in the JUnit XML of a GPU run
    path = os.environ.get("KILN_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# -- checkpoints and engines, kept between runs in KILN_GPU_WORKDIR ------------------------------

def _sources_hash() -> str:
    """Content hash of what an engine's bytes come from: the builder, models, plugins, the
    engine contract (format and manifest) and the shared helpers in kiln/."""
    h = hashlib.sha256()
    files = [p for pkg in ("builder", "models", "plugins", "engines", "kiln") for p in (ROOT / pkg).rglob("*.py")]
    for f in sorted(files):
        h.update(f.relative_to(ROOT).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _key(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:8]


def cached_checkpoint(workdir: Path, family: str, **kwargs) -> Path:
    """A random checkpoint, made once per family and arguments (its writer renames a finished
    folder into place, so one that exists is complete)."""
    path = workdir / f"ckpt-{family}-{_key(family, sorted(kwargs.items()))}"
    if not path.is_dir():
        write_random_checkpoint(path, family, **kwargs)
    return path


def cached_engine(workdir: Path, checkpoint: Path, targets: list[str], dtype: str, **build) -> Path:
    """An engine of `checkpoint`, built in a fresh process once per build and sources; an
    engine of the same build from older sources is deleted first (the 8B one is 16 GB)."""
    prefix = f"engine-{checkpoint.name}-{dtype}-{'-'.join(targets)}-{_key(sorted(build.items()))}-"
    path = workdir / (prefix + _sources_hash())
    if not (path / "rank0.engine").is_file():
        for stale in [*workdir.glob(prefix + "*"), *workdir.glob(f".{prefix}*")]:
            shutil.rmtree(stale, ignore_errors=True)
        result = build_cli(checkpoint, path, targets, workdir / "kernel-cache", dtype=dtype, timeout=1800, **build)
        assert result.returncode == 0, result.stderr + result.stdout
    return path


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_and_cpu_runs(engine_dir, prompts: list[list[int]]) -> tuple[dict, dict]:
    """An engine built for the CPU and this GPU, run on both: each device's greedy tokens, and
    each executor's logits teacher-forced on the CPU's tokens (so both see the same inputs)."""
    tokens = {device: kiln_generate(engine_dir, device, prompts) for device in ("cpu", "cuda")}
    logits = {}
    for device in ("cpu", "cuda"):
        executor = open_executor(engine_dir, device)
        try:
            logits[device] = [kiln_teacher_forced(executor, p, t) for p, t in zip(prompts, tokens["cpu"])]
        finally:
            executor.close()
    free_gpu()
    return tokens, logits


# -- GPU: bf16 engine against transformers ------------------------------------------------------

@dataclass(frozen=True)
class Bf16Parity:
    """Figures of one bf16 comparison, each (agreement, per-sequence relative errors)."""

    kiln_vs_hf: tuple[tuple[float, float], list[float]]      # the criterion
    kiln_vs_fp32: tuple[tuple[float, float], list[float]]    # Kiln against exact-ish math
    hf_vs_fp32: tuple[tuple[float, float], list[float]]      # transformers' own bf16 noise
    # transformers bf16 with eager attention against itself with SDPA: how far apart two bf16
    # implementations of the same model land when they differ only in one op's rounding order
    hf_floor: tuple[tuple[float, float], list[float]]
    line: str


def measure_bf16_parity(name: str, checkpoint: Path, engine_dir: Path, prompts: list[list[int]], device: str = "cuda",
                        max_tokens: int = MAX_TOKENS) -> Bf16Parity:
    """Kiln's greedy tokens on `device` against transformers on the same weights, teacher-forced,
    in bf16 and in float32 (the bf16 weights computed in float32); and transformers bf16 with
    eager attention against its SDPA, the floor the first comparison sits on."""
    tokens = kiln_generate(engine_dir, device, prompts, max_tokens)
    free_gpu()
    executor = open_executor(engine_dir, device)
    try:
        kiln = [kiln_teacher_forced(executor, p, t) for p, t in zip(prompts, tokens)]
    finally:
        executor.close()
    del executor
    free_gpu()

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device).eval()
    try:
        hf = [hf_teacher_forced(model, p, t) for p, t in zip(prompts, tokens)]
        attention = model.config._attn_implementation
        model.set_attn_implementation("eager")
        hf_eager = [hf_teacher_forced(model, p, t) for p, t in zip(prompts, tokens)]
        model.set_attn_implementation(attention)
        model.float()  # the same bf16 weights, exactly, computed in float32
        hf32 = [hf_teacher_forced(model, p, t) for p, t in zip(prompts, tokens)]
    finally:
        del model
        free_gpu()

    hf_greedy = [logits.argmax(dim=1).tolist() for logits in hf]
    figures = ((argmax_agreement(tokens, hf), relative_errors(kiln, hf)),
               (argmax_agreement(tokens, hf32), relative_errors(kiln, hf32)),
               (argmax_agreement(hf_greedy, hf32), relative_errors(hf, hf32)),
               (argmax_agreement(hf_greedy, hf_eager), relative_errors(hf, hf_eager)))
    (agreement, errors), (k32, k32_err), (h32, h32_err), (floor, floor_err) = figures
    line = report(name, tokens, agreement, errors, (
        f"; kiln vs fp32: agreement {k32[0]:.4f}, rel err median {median(k32_err):.2e}"
        f"; hf bf16 vs fp32: agreement {h32[0]:.4f}, rel err median {median(h32_err):.2e}"
        f"; hf bf16 sdpa vs eager attention: agreement {floor[0]:.4f}, rel err median {median(floor_err):.2e}"
        f" max {max(floor_err):.2e}"
        f"; kiln prefill vs its decode: agreement {argmax_agreement(tokens, kiln)[0]:.4f}"))
    return Bf16Parity(*figures, line)
