"""A decode step of one sequence on sm_90 and later: the EARLY attention kernels (`kernels.EARLY_ROLES`) through
the driver launcher, run in Triton's interpreter against the reference, at contexts and windows that put the
newest key in each place it can be; and, built for the FP8 handoff, the row they stage for o_proj's GEMV. What
they read before the PDL wait is test_attention_pdl.py's."""
from __future__ import annotations

import pytest
import torch

from interpreted_launch import Running, interpretable, interpreted_only, targeted
from kiln.plugins.attention import SPEC as ATTENTION
from kiln.plugins.attention import kernels as attention_kernels
from kiln.plugins.attention import launch as attention_launch
from kiln.plugins.fp8 import to_e4m3
from kiln.plugins.linear.fp8 import HANDOFF
from kiln.runtime.cuda_executor import op_scratch
from test_kernels_attention import (BLOCK_SIZE, HEAD_DIM, KV_HEADS, attention_attrs, attention_inputs, close,
                                    make_step, prepared_cache, reference_attention)

pytestmark = interpreted_only()


class Recording:
    """A stand-in's launches by role, beside the stand-in (`interpreted_launch.Running`) that runs them."""

    def __init__(self, running, roles: list) -> None:
        self.running, self.roles = running, roles

    def launch(self, grid: tuple[int, int, int], args: list, stream: int) -> None:
        self.roles.append(self.running.kernel.meta["role"])
        self.running.launch(grid, args, stream)


@pytest.mark.parametrize("table_blocks,context,window", [
    (70, 150, 0),   # two parts of 128 and 22 keys: the newest key in the second part's preloaded tile
    (70, 100, 0),   # two parts of 64 and 36 keys
    (70, 3, 0),     # the first part's 3 keys, the second part empty
    (40, 100, 0),   # one part: the newest key after the preloaded tile, in the masked loop
    (40, 10, 0),
    (70, 150, 5)])  # a sliding window: the part's keys start past 0
def test_one_sequence_decode_reads_its_first_tile_early_on_sm90(table_blocks, context, window):
    """A step of one sequence on sm_90 takes the EARLY kernels (`kernels.EARLY_ROLES`), which read their
    first tile of earlier keys before the PDL wait, and the newest key (the qkv kernel's) after it."""
    blocks = list(range(-(-(context + 1) // BLOCK_SIZE)))
    data = make_step([(context, 1, blocks)], 4, torch.float32, seed=context, table_blocks=table_blocks)
    data["cache"] = torch.randn(2, 2, 64, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    attrs = attention_attrs(4, window)
    ref, _ = reference_attention(data, attrs, with_kv=False)
    cache = prepared_cache(data, attrs, with_kv=False)
    shapes = {"heads": 4, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE}
    kernels = targeted(attention_kernels.aot_kernels("float32", shapes), "sm_90")
    limits = {"T": 8, "S": 8, "B": table_blocks, "block_size": BLOCK_SIZE, "element_bytes": 4}
    scratch = {name: torch.zeros(nbytes, dtype=torch.uint8)
               for name, nbytes in op_scratch(attention_launch, attrs, [k.meta for k in kernels], limits).items()}
    inputs = attention_inputs(data, cache, with_kv=False)
    out, log, roles = torch.full_like(ref, float("nan")), [], []
    tensors = [t for t in [*inputs, out, cache[1, 0], cache[1, 1], *scratch.values()] if t is not None]
    attention_launch.launch([Recording(Running(k, tensors, log), roles) for k in kernels], [k.meta for k in kernels],
                            inputs, attrs, out, {"T": 1}, 0, scratch)
    splits = attention_kernels.choose_num_splits(1, 1, KV_HEADS, table_blocks * BLOCK_SIZE)
    assert roles == ["decode_one_split" if splits > 1 else "decode_one"]
    assert close(out, ref)
    assert not scratch["attention_arrivals"].any()


@pytest.mark.parametrize("table_blocks", [70, 40])   # split (the merging part hands off) and not
def test_one_sequence_decode_stages_its_output_for_o_proj(table_blocks):
    """Built to hand o_proj its input (a static FP8 o_proj: `linear.fp8`'s handoff), the EARLY kernels write
    their one row into the handoff's scratch as o_proj's one-row GEMV would stage it: the output's e4m3 values
    as f16, each unit of 8 as (0, 2, 1, 3, 4, 6, 5, 7), the even units first (`gemv_fp8.cu`'s header)."""
    context, heads = 100, 16   # K = 16 * 16 = 256: 32 units
    data = make_step([(context, 1, list(range(26)))], heads, torch.float32, seed=3, table_blocks=table_blocks)
    data["cache"] = torch.randn(2, 2, 32, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    attrs = attention_attrs(heads, 0)
    cache = prepared_cache(data, attrs, with_kv=False)
    ref = ATTENTION.call_reference(attention_inputs(data, cache, False), attrs)
    shapes = {"heads": heads, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "handoff": True}
    kernels = [interpretable(k) for k in targeted(attention_kernels.aot_kernels("float32", shapes), "sm_90")]
    limits = {"T": 8, "S": 8, "B": table_blocks, "block_size": BLOCK_SIZE, "element_bytes": 4}
    metas = [k.meta for k in kernels]
    scratch = {name: torch.zeros(nbytes, dtype=torch.uint8)
               for name, nbytes in op_scratch(attention_launch, attrs, metas, limits).items()}
    inputs = attention_inputs(data, cache, with_kv=False)
    out, roles = torch.full_like(ref, float("nan")), []
    scale = (ref.abs().max() / 448 / 1.5).reshape(1)   # the largest values saturate
    tensors = [t for t in [*inputs, out, scale, cache[1, 0], cache[1, 1], *scratch.values()] if t is not None]
    attention_launch.launch([Recording(Running(k, tensors, []), roles) for k in kernels], metas, inputs, attrs, out,
                            {"T": 1}, 0, scratch, scale)
    assert roles[0].startswith("decode_one") and close(out, ref)
    units = to_e4m3(out[0], scale).to(torch.float16).view(-1, 8)[:, [0, 2, 1, 3, 4, 6, 5, 7]]
    want = torch.cat([units[0::2], units[1::2]]).flatten()
    got = scratch[HANDOFF[0]][:2 * want.numel()].view(torch.float16)
    assert torch.equal(got, want)
