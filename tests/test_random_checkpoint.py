"""Tests for the random checkpoint generator used by `make demo` and the test-suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from kiln.models.random_checkpoint import FAMILIES, main, write_random_checkpoint  # noqa: E402
from kiln.models.random_tokenizer import train_tokenizer  # noqa: E402

ROUND_TRIP_TEXT = "Hello world, café 日本 123"

EXPECTED = {
    "llama2": ("LlamaForCausalLM", "default", 10000.0, False),
    "llama3": ("LlamaForCausalLM", "llama3", 500000.0, False),
    "llama3.2": ("LlamaForCausalLM", "llama3", 500000.0, True),
    "llama-linear-rope": ("LlamaForCausalLM", "linear", 10000.0, False),
    "mistral": ("MistralForCausalLM", "default", 1e6, False),
    "qwen2": ("Qwen2ForCausalLM", "default", 1e6, False),
    "qwen3": ("Qwen3ForCausalLM", "default", 1e6, False),
    "gemma3": ("Gemma3ForCausalLM", "linear", 1e6, True),  # its global layers' RoPE
}


def _rope(config: dict) -> tuple[str, float, dict]:
    """(rope_type, rope_theta, full params) from either config.json layout."""
    params = config.get("rope_parameters") or dict(config.get("rope_scaling") or {})
    params = params.get("full_attention", params)  # Gemma 3's, keyed by layer type
    theta = params.get("rope_theta", config.get("rope_theta"))
    return params.get("rope_type", params.get("type", "default")), theta, params


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        family: write_random_checkpoint(root / family, family, hidden_size=32, num_heads=4,
                                        num_kv_heads=2, intermediate_size=64, seed=1)
        for family in FAMILIES
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_runs(family: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer(ROUND_TRIP_TEXT, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id == model.config.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()
    # The re-initialisation must give logits that actually depend on the input.
    assert logits.std() > 0.1

    config = json.loads((path / "config.json").read_text())
    arch, rope_type, theta, tied = EXPECTED[family]
    assert config["architectures"] == [arch]
    assert _rope(config)[:2] == (rope_type, theta)
    assert config["tie_word_embeddings"] is tied
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    shared = (model.get_output_embeddings().weight.data_ptr()
              == model.get_input_embeddings().weight.data_ptr())
    assert shared is tied


def test_family_specifics(checkpoints: dict[str, Path]) -> None:
    cfg = {f: json.loads((p / "config.json").read_text()) for f, p in checkpoints.items()}
    _, _, llama3 = _rope(cfg["llama3"])
    assert llama3["factor"] == 8.0 and llama3["low_freq_factor"] == 1.0
    assert llama3["high_freq_factor"] == 4.0
    assert llama3["original_max_position_embeddings"] < cfg["llama3"]["max_position_embeddings"]
    assert _rope(cfg["llama-linear-rope"])[2]["factor"] == 2.0
    assert cfg["mistral"]["sliding_window"] is None and cfg["mistral"]["head_dim"] == 8
    assert cfg["qwen2"]["use_sliding_window"] is False
    assert cfg["qwen3"]["head_dim"] == 8 and cfg["qwen3"]["attention_bias"] is False

    from safetensors.torch import load_file

    qwen2 = load_file(checkpoints["qwen2"] / "model.safetensors")
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    qwen3 = load_file(checkpoints["qwen3"] / "model.safetensors")
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3
    norm = qwen3["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm))
    llama32 = load_file(checkpoints["llama3.2"] / "model.safetensors")
    lm_head = llama32.get("lm_head.weight", llama32["model.embed_tokens.weight"])
    assert torch.equal(lm_head, llama32["model.embed_tokens.weight"])


def test_tied_override_and_dtype(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "t", "qwen3", hidden_size=32, dtype="bfloat16",
                                   tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    from safetensors.torch import load_file

    weights = load_file(path / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    # The lm_head is either left out (transformers 5) or stored equal to the embedding.
    if "lm_head.weight" in weights:
        assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_sharded_save(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "s", "llama2", max_shard_size="40KB")
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert torch.isfinite(model(torch.tensor([[0, 5, 9]])).logits).all()


def test_deterministic(tmp_path: Path) -> None:
    a = write_random_checkpoint(tmp_path / "a", "llama2", hidden_size=16, seed=3)
    b = write_random_checkpoint(tmp_path / "b", "llama2", hidden_size=16, seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_tokenizer_round_trip() -> None:
    tokenizer = train_tokenizer()
    assert tokenizer.get_vocab_size() == 384
    assert tokenizer.to_str() == train_tokenizer().to_str()
    for text in (ROUND_TRIP_TEXT, "naïve ✓ 🙂\n\ttabs  and  spaces"):
        encoding = tokenizer.encode(text)
        assert len(encoding.ids) < len(text.encode())  # merges were learned
        assert tokenizer.decode(encoding.ids) == text


def test_hf_tokenizer_round_trip(checkpoints: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["llama3"],
                                                           local_files_only=True)
    ids = tokenizer(ROUND_TRIP_TEXT).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == ROUND_TRIP_TEXT
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        write_random_checkpoint(tmp_path / "v", vocab_size=100)
    with pytest.raises(ValueError, match="family"):
        write_random_checkpoint(tmp_path / "f", "gpt2")
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "cli"
    args = ["--family", "mistral", "--output", str(out), "--hidden-size", "32",
            "--intermediate-size", "64", "--dtype", "float16"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "mistral" in result.output and "float16" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"

    result = runner.invoke(main, args)
    assert result.exit_code == 2
    assert "--force" in result.output
    result = runner.invoke(main, [*args, "--family", "qwen2", "--force"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert [p.name for p in tmp_path.iterdir()] == ["cli"]  # no staging dirs left

    help_text = runner.invoke(main, ["--help"]).output
    assert "random" in help_text and "--max-shard-size" in help_text


def _float32_then_cast(family: str, dtype: str, seed: int, **size) -> dict[str, torch.Tensor]:
    """The weights as they were made before the `device` keyword: built in float32 with
    transformers' init, randomized, then cast."""
    from kiln.models.random_checkpoint import _randomize
    from kiln.models.random_families import family_config

    config = family_config(family, size, None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomize(model)
    return model.to(getattr(torch, dtype)).state_dict()


@pytest.mark.parametrize("family,dtype", [("qwen2", "bfloat16"), ("llama3.2", "float16"), ("qwen3", "float32")])
def test_device_keyword_builds_in_dtype_with_the_same_bytes(tmp_path: Path, family: str, dtype: str) -> None:
    """device="cpu" builds the model directly in `dtype`, and still writes what the float32
    build cast to `dtype` wrote (q/k/v biases, tied embeddings and q/k norms included)."""
    from safetensors.torch import load_file

    size = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=512, max_position_embeddings=256, bos_token_id=0,
                eos_token_id=1)
    path = write_random_checkpoint(tmp_path / "d", family, hidden_size=32, num_heads=4, num_kv_heads=2,
                                   intermediate_size=64, dtype=dtype, seed=7, device="cpu")
    weights = load_file(path / "model.safetensors")
    want = _float32_then_cast(family, dtype, 7, **size)
    assert {t.dtype for t in weights.values()} == {getattr(torch, dtype)}
    assert weights.keys() <= want.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, want[name]), name
    assert json.loads((path / "config.json").read_text())["dtype"] == dtype
    default = write_random_checkpoint(tmp_path / "default", family, hidden_size=32, num_heads=4, num_kv_heads=2,
                                      intermediate_size=64, dtype=dtype, seed=7)
    assert (default / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()


def test_bad_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        write_random_checkpoint(tmp_path / "x", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            write_random_checkpoint(tmp_path / "x", device="cuda")
    assert not any(tmp_path.iterdir())
    result = CliRunner().invoke(main, ["--output", str(tmp_path / "cli"), "--device", "gpu0"])
    assert result.exit_code == 2 and "unknown device 'gpu0'" in result.output


def test_cli_device(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["--family", "qwen3", "--hidden-size", "32", "--intermediate-size", "64", "--dtype", "bfloat16"]
    result = runner.invoke(main, [*args, "--output", str(tmp_path / "a"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, [*args, "--output", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert "--device" in runner.invoke(main, ["--help"]).output


@pytest.mark.gpu
def test_cuda_device_builds_on_the_gpu(tmp_path: Path) -> None:
    """device="cuda": a bf16 model made on the GPU loads in transformers and gives logits that
    depend on the input, with the CPU build's distributions (not its bytes: another RNG)."""
    from safetensors.torch import load_file

    allocated = torch.cuda.memory_allocated()
    gpu = write_random_checkpoint(tmp_path / "gpu", "qwen2", hidden_size=64, dtype="bfloat16", seed=1, device="cuda")
    cpu = write_random_checkpoint(tmp_path / "cpu", "qwen2", hidden_size=64, dtype="bfloat16", seed=1)
    got, want = load_file(gpu / "model.safetensors"), load_file(cpu / "model.safetensors")
    assert got.keys() == want.keys()
    for name in got:
        assert got[name].dtype == torch.bfloat16 and got[name].shape == want[name].shape, name
        assert not torch.equal(got[name], want[name]), name
        g, w = got[name].float(), want[name].float()
        if g.numel() >= 4096:  # enough samples for 10% to be several standard errors
            assert abs(g.mean() - w.mean()) < 0.1 * w.std() and abs(g.std() / w.std() - 1) < 0.1, name
    model = transformers.AutoModelForCausalLM.from_pretrained(gpu, local_files_only=True)
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 9, 200, 17]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert torch.cuda.memory_allocated() <= allocated  # the model made on the GPU was freed
