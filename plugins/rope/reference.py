"""PyTorch reference for `rope`: rotary position embedding, rotate-half layout (as in Llama).

`rope_cache` is [max_positions, head_dim] float32 with cos in the first half of each row and
sin in the second half; the model definition computes it, so any frequency scheme works.
"""
import torch


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    t = x.shape[0]
    half = head_dim // 2
    table = rope_cache.index_select(0, positions.long())
    cos = table[:, None, :half].to(x.dtype)
    sin = table[:, None, half:].to(x.dtype)
    xh = x.view(t, -1, head_dim)
    x1, x2 = xh[..., :half], xh[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(t, -1)


def rope(x: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    return apply_rope(x, positions, rope_cache, head_dim)
