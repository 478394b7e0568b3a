"""The eager PyTorch baseline: the same model, run the way a plain PyTorch script would.

Weights come from Kiln's own model definition (`models.load`), so the baseline is exactly the
model the engine was built from; the forward pass is written out layer by layer with plain
torch ops (F.linear, RMSNorm and rotary math as in Kiln's plugin references) and
`torch.nn.functional.scaled_dot_product_attention` over a contiguous KV cache
[batch, kv_heads, positions, head_dim] per layer. No CUDA graphs, no torch.compile, no
fusion: "eager". Sequences in a batch have equal lengths, so no padding or masks are needed.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kiln import models
from kiln.bench.driver import EngineInfo, random_prompts, release
from kiln.bench.figures import Figure
from kiln.bench.hardware import Clock, synchronize
from kiln.models.llama import LlamaForCausalLM

# scaled_dot_product_attention learnt grouped-query heads (enable_gqa) in torch 2.5; before it,
# k and v are repeated per query head, as Hugging Face's eager attention does.
_NATIVE_GQA = torch.__version__ >= "2.5"
WARMUP_STEPS = 3
EAGER_MEMORY_FRACTION = 0.5  # of free memory, for one static batch's KV cache and activations


# The families whose layers `EagerModel.forward` writes out; Gemma 3's post-norms, GeGLU,
# scaled embedding, per-layer windows and soft cap are not among them.
EAGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def eager_unsupported(checkpoint: str | Path) -> str | None:
    """Why the eager baseline cannot run this checkpoint's model, or None when it can."""
    family = models.read_config(checkpoint).family
    if family in EAGER_FAMILIES:
        return None
    return f"the eager baseline writes out the layers of {', '.join(EAGER_FAMILIES)}, not {family}'s"


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # Norm weights are float32 in Kiln's models: the product is rounded back, as the plugin does.
    return (y * weight).to(x.dtype) if weight is not None else y


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [b, n, heads, head_dim]; cos, sin [n, 1, head_dim/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class EagerModel:
    """Kiln's model definition run eagerly with SDPA; `forward` fills a contiguous KV cache."""

    def __init__(self, model: LlamaForCausalLM, device: str):
        self.model = model.to(device)
        self.cfg = model.config
        self.device = device
        self.dtype = model.model.embed_tokens.weight.dtype

    @classmethod
    def load(cls, checkpoint: str | Path, dtype: str, max_positions: int, device: str) -> EagerModel:
        model, _ = models.load(checkpoint, dtype, max_positions=max_positions)
        return cls(model, device)

    def new_cache(self, batch: int, positions: int) -> torch.Tensor:
        c = self.cfg
        return torch.empty(c.num_layers, 2, batch, c.num_kv_heads, positions, c.head_dim,
                           dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, cache: torch.Tensor) -> torch.Tensor:
        """Logits [b, vocab] (float32) of the last of `ids` [b, n], which sit at positions
        start..start+n-1; either a prefill (start 0) or one decode token (n 1)."""
        b, n = ids.shape
        if start and n > 1:
            raise ValueError("the eager baseline runs a whole prefill or one decode token per call")
        c, m = self.cfg, self.model
        end = start + n
        table = m.rope_cache[start:end]
        cos, sin = (t[:, None, :].to(self.dtype) for t in table.chunk(2, dim=-1))
        window = c.sliding_window or 0
        first = max(0, end - window) if window and n == 1 else 0
        mask = None
        if n > 1 and window and window < n:
            q_pos, k_pos = torch.arange(n, device=self.device)[:, None], torch.arange(n, device=self.device)[None]
            mask = (k_pos <= q_pos) & (q_pos - k_pos < window)
        x = F.embedding(ids, m.model.embed_tokens.weight)
        for i, layer in enumerate(m.model.layers):
            a = layer.self_attn
            y = _rms(x, layer.input_layernorm.weight, c.rms_norm_eps)
            q = F.linear(y, a.q_proj.weight, a.q_proj.bias).view(b, n, c.num_heads, c.head_dim)
            k = F.linear(y, a.k_proj.weight, a.k_proj.bias).view(b, n, c.num_kv_heads, c.head_dim)
            v = F.linear(y, a.v_proj.weight, a.v_proj.bias).view(b, n, c.num_kv_heads, c.head_dim)
            if a.q_norm is not None:
                q, k = _rms(q, a.q_norm.weight, c.rms_norm_eps), _rms(k, a.k_norm.weight, c.rms_norm_eps)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            cache[i, 0, :, :, start:end] = k.transpose(1, 2)
            cache[i, 1, :, :, start:end] = v.transpose(1, 2)
            keys, values = cache[i, 0, :, :, first:end], cache[i, 1, :, :, first:end]
            if not _NATIVE_GQA:
                group = c.num_heads // c.num_kv_heads
                keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            extra = {"enable_gqa": True} if _NATIVE_GQA else {}
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                               is_causal=n > 1 and mask is None, **extra)
            x = x + F.linear(o.transpose(1, 2).reshape(b, n, -1), a.o_proj.weight, a.o_proj.bias)
            y = _rms(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            mlp = layer.mlp
            h = F.silu(F.linear(y, mlp.gate_proj.weight, mlp.gate_proj.bias)) * \
                F.linear(y, mlp.up_proj.weight, mlp.up_proj.bias)
            x = x + F.linear(h, mlp.down_proj.weight, mlp.down_proj.bias)
        last = _rms(x[:, -1], m.model.norm.weight, c.rms_norm_eps)
        return F.linear(last, m.lm_head.weight).float()

    def greedy(self, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation [b, new_tokens] of equal-length prompts [b, n]."""
        b, n = prompts.shape
        cache = self.new_cache(b, n + new_tokens)
        token = self.forward(prompts.to(self.device), 0, cache).argmax(-1)
        out = [token]
        for i in range(new_tokens - 1):
            token = self.forward(token[:, None], n + i, cache).argmax(-1)
            out.append(token)
        return torch.stack(out, dim=1)

    def bytes_per_sequence(self, prompt_len: int, total_len: int) -> int:
        """KV cache of one sequence plus its share of the prefill's largest activations."""
        c, item = self.cfg, self.dtype.itemsize
        kv = c.num_layers * 2 * c.num_kv_heads * total_len * c.head_dim * item
        return kv + prompt_len * (4 * c.hidden_size + 3 * c.intermediate_size) * item

    def max_batch(self, prompt_len: int, total_len: int) -> int:
        if self.device == "cuda":
            free = torch.cuda.mem_get_info()[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(1, int(free * EAGER_MEMORY_FRACTION) // self.bytes_per_sequence(prompt_len, total_len))


def eager_decode(model: EagerModel, prompts: list[list[int]], steps: int) -> float:
    """Decode tokens/s of the batch of `prompts` over `steps` steps after the prefill and a warm-up.
    Tokens stay on the device between steps (no host round trip): the baseline at its best."""
    ids = torch.tensor(prompts, device=model.device)
    b, n = ids.shape
    cache = model.new_cache(b, n + 1 + WARMUP_STEPS + steps)
    token = model.forward(ids, 0, cache).argmax(-1)
    pos = n
    for _ in range(WARMUP_STEPS):
        token = model.forward(token[:, None], pos, cache).argmax(-1)
        pos += 1
    clock = Clock(model.device)
    clock.start()
    for _ in range(steps):
        token = model.forward(token[:, None], pos, cache).argmax(-1)
        pos += 1
    return b * steps / clock.stop()


def eager_offline(model: EagerModel, prompts: list[list[int]], output_len: int) -> float:
    """Seconds to generate `output_len` tokens for every prompt, in static batches as large as
    memory allows (all prompts have one length, so static batching wastes nothing)."""
    input_len = len(prompts[0])
    batch = model.max_batch(input_len, input_len + output_len)
    synchronize(model.device)
    clock = Clock(model.device)
    clock.start()
    for i in range(0, len(prompts), batch):
        model.greedy(torch.tensor(prompts[i:i + batch]), output_len)
    return clock.stop()


def fill_baseline(figures: list[Figure], checkpoint: Path, info: EngineInfo, device: str, context: int,
                  steps: int, seed: int, status: Callable[[str], None]) -> None:
    """Fill in `eager` on every decode and offline figure that has a value (bench-engine's last
    phase; `status` reports progress)."""
    status(f"eager baseline: loading {checkpoint}")
    model = EagerModel.load(checkpoint, info.manifest.dtype, info.manifest.max_seq_len, device)
    try:
        by_key = {f.key: f for f in figures}
        for f in figures:
            if f.value is None or f.section != "decode":
                continue
            status(f"eager decode b={f.params['batch']}")
            prompts = random_prompts(f.params["batch"], context, info.manifest.vocab_size, seed)
            f.eager = eager_decode(model, prompts, steps)
        for f in figures:
            if f.value is None or f.section != "offline" or f.key[-1] != "output":
                continue
            p = f.params
            status(f"eager offline {p['input_len']}/{p['output_len']} x {p['requests']}")
            prompts = random_prompts(p["requests"], p["input_len"], info.manifest.vocab_size, seed)
            seconds = eager_offline(model, prompts, p["output_len"])
            f.eager = p["requests"] * p["output_len"] / seconds
            total = by_key[f.key[:-1] + ("total",)]
            total.eager = p["requests"] * (p["input_len"] + p["output_len"]) / seconds
    finally:
        del model
        release(device)
