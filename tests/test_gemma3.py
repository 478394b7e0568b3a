"""Gemma 3 text models (issue 17, item 2): engines built from random `Gemma3ForCausalLM`
checkpoints match `transformers` on the CPU, in float32 (teacher-forced logits within 1e-4,
identical greedy tokens) and in bfloat16 (within bf16's own noise), with local and global
layers, a sliding window shorter than prompt plus generated tokens, and soft-capped logits;
the fusion passes still take the attention input and the GeGLU MLP; the config reader takes
every published layout and refuses what it cannot build."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kiln.models.config import CheckpointError, parse_config
from kiln.models.random_families import GEMMA3_SLIDING_WINDOW, GEMMA3_SOFTCAP
from kiln.runtime.engine import load_engine
from parity_tools import relative_errors
from test_parity import DECODE_STEPS, check_against_transformers, rel_err, run_engine

# Four layers, local and global alternating; 11 + 8 and 6 + 8 tokens against a window of 8.
GEMMA3 = dict(num_layers=4)


@pytest.fixture(scope="module")
def checkpoint(factory):
    return factory.checkpoint("gemma3", **GEMMA3)


def test_window_is_shorter_than_the_sequences():
    assert GEMMA3_SLIDING_WINDOW < 11 + DECODE_STEPS and GEMMA3_SLIDING_WINDOW < 6 + DECODE_STEPS


def test_float32_engine_matches_transformers(factory, checkpoint):
    check_against_transformers(checkpoint, factory.engine(checkpoint, dtype="float32"))


def test_plan_fuses_norms_and_geglu_and_keeps_the_window_per_layer(factory, checkpoint):
    engine = load_engine(factory.engine(checkpoint, dtype="float32"))
    ops = [op.spec.name for op in engine.plan]
    assert ops.count("norm_qkv_rope") == ops.count("norm_swiglu") == ops.count("attention") == 4
    assert "gelu_mul" not in ops and "head_rms_norm" not in ops and "rope" not in ops
    assert {op.attrs["activation"] for op in engine.plan if op.spec.name == "norm_swiglu"} == {"gelu_tanh"}
    # Post-norms: two per layer, plus the final norm; each followed by its residual add.
    assert ops.count("rms_norm") == 2 * 4 + 1 and ops.count("add") == 2 * 4
    windows = [op.attrs["window"] for op in engine.plan if op.spec.name == "attention"]
    assert windows == [GEMMA3_SLIDING_WINDOW, 0, GEMMA3_SLIDING_WINDOW, 0]
    assert [op.attrs["scale"] for op in engine.plan if op.spec.name == "attention"] == [24 ** -0.5] * 4
    (embedding,) = [op for op in engine.plan if op.spec.name == "embedding"]
    assert embedding.attrs["scale"] == 8.0  # sqrt(64), exact in every dtype
    (cap,) = [op for op in engine.plan if op.spec.name == "softcap"]
    assert cap.attrs["cap"] == GEMMA3_SOFTCAP and engine.plan[-1] is cap
    # Local and global layers read their own RoPE tables.
    tables = [op.inputs["rope_cache"] for op in engine.plan if op.spec.name == "norm_qkv_rope"]
    assert tables[0] == tables[2] != tables[1] == tables[3]


def with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_every_variant_shows_in_the_logits(factory, checkpoint, tmp_path):
    """Each of the window, the soft cap and the (1 + w) norm changes the engine's logits, so the
    parity above checks each of them."""
    prompts = [list(range(3, 3 + 14))]
    _, (base,) = run_engine(factory.engine(checkpoint, dtype="float32"), prompts)
    for name, change in [("window", {"sliding_window": 64}), ("softcap", {"final_logit_softcapping": None}),
                         ("local rope", {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                                "rope_theta": 1e6},
                                                             "sliding_attention": {"rope_type": "default",
                                                                                   "rope_theta": 1e6}}})]:
        other = with_config(checkpoint, tmp_path / name.replace(" ", "-"), **change)
        _, (logits,) = run_engine(factory.engine(other, dtype="float32"), prompts)
        assert rel_err(logits, base) > 1e-3, name


def test_bfloat16_engine_matches_transformers_within_bf16_noise(factory, checkpoint):
    """Kiln bf16 and transformers bf16, both teacher-forced on Kiln's greedy tokens, against
    transformers float32 on the same weights: per sequence, Kiln's relative L2 error is within
    twice transformers bf16's own (about 3e-2 here), and the two bf16 runs are within 5e-2 of
    each other."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (11, 6)]
    tokens, logits = run_engine(factory.engine(checkpoint, dtype="bfloat16"), prompts)
    bf16 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for toks, got in zip(tokens, logits):
        with torch.no_grad():
            want = bf16(torch.tensor([toks])).logits[0].float()
            exact = fp32(torch.tensor([toks])).logits[0]
        (kiln_err, hf_err, between) = relative_errors([got, want, got], [exact, exact, want])
        assert kiln_err < 2 * hf_err and between < 5e-2, (kiln_err, hf_err, between)
        assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_multimodal_checkpoint_builds_the_same_text_engine(factory, checkpoint, tmp_path):
    """A Gemma3ForConditionalGeneration folder (transformers 5's names: model.language_model.*,
    with vision tensors beside them) gives the text checkpoint's engine, bit for bit."""
    multi = tmp_path / "multimodal"
    shutil.copytree(checkpoint, multi)
    (weights,) = multi.glob("*.safetensors")
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in load_file(weights).items()}
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.ones(4, 3)
    tensors["model.multi_modal_projector.mm_input_projection_weight"] = torch.ones(3, 4)
    save_file(tensors, weights)
    text = json.loads((multi / "config.json").read_text())
    (multi / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"}}))
    prompts = [list(range(3, 3 + 14))]
    _, (want,) = run_engine(factory.engine(checkpoint, dtype="float32"), prompts)
    _, (got,) = run_engine(factory.engine(multi, dtype="float32"), prompts)
    assert torch.equal(got, want)


# -- config.json layouts --------------------------------------------------------------------

TEXT = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 300,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 7, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16}


def test_transformers4_keys_and_window_pattern():
    """Published checkpoints (transformers 4.5x): rope_theta, rope_scaling and
    rope_local_base_freq at the top level, and sliding_window_pattern instead of layer_types."""
    cfg = parse_config({**TEXT, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6,
                        "query_pre_attn_scalar": 256, "final_logit_softcapping": None})
    assert cfg.family == "gemma3" and cfg.hidden_activation == "gelu_tanh" and cfg.qk_norm
    assert cfg.sliding_layers == (True,) * 5 + (False, True)
    assert [cfg.layer_window(i) for i in range(7)] == [512] * 5 + [0, 512]
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.local_rope_theta) == (1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
    assert cfg.query_pre_attn_scalar == 256 and cfg.final_logit_softcapping is None and cfg.tie_word_embeddings


def test_multimodal_config_builds_its_text_config():
    """A `gemma3` (Gemma3ForConditionalGeneration) config: the text model from text_config,
    with Gemma3TextConfig's defaults for the keys published configs leave out."""
    cfg = parse_config({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                        "eos_token_id": [1, 106], "vision_config": {"model_type": "siglip_vision_model"},
                        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                                        "num_hidden_layers": 34, "sliding_window": 1024,
                                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}})
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.eos_token_ids == (1, 106)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262_208)
    assert cfg.sliding_layers.count(False) == 5 and cfg.local_rope_theta == 1e4


@pytest.mark.parametrize("change,message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is set, but transformers' Gemma 3 never applies it"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must name sliding_attention or full_attention for each of "
                                             "the 7 layers"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope scaling on the sliding-window layers"),
])
def test_configs_kiln_cannot_build_are_refused(change, message):
    with pytest.raises(CheckpointError, match=message):
        parse_config({**TEXT, **change})


def test_multimodal_checkpoint_without_text_config_is_refused():
    with pytest.raises(CheckpointError, match="needs a text_config object"):
        parse_config({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
