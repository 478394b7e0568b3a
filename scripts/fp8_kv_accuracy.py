"""The FP8 KV-cache accuracy check of tests/test_fp8_kv_accuracy.py, on a GPU: builds the
checkpoint twice in bfloat16 for this GPU (a bfloat16 cache, then --kv-cache-dtype fp8 with its scales
calibrated on the test's calibration prompts), then writes to one JSON file the perplexity of each on the
fixed passages, the change (the gate: within 1%) and its standard error, and how often their greedy chat
completions agree.

    .venv/bin/python scripts/fp8_kv_accuracy.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out $OUT/fp8_kv_accuracy.json

On the GPU machine, `bash scripts/real_model_gpu.sh fp8kv` joins the carried GGUF and runs this
(see the top of that script); any Hugging Face folder or GGUF of a supported family works.
--device cpu runs the same on the CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import click  # noqa: E402

from kiln.builder.build import build_engine  # noqa: E402
from kiln.builder.config import BuildConfig, default_targets  # noqa: E402
from fp8_accuracy_check import CALIBRATION  # noqa: E402
from fp8_kv_accuracy import measure  # noqa: E402
from real_models import CHAT_QUESTIONS, chat_prompts  # noqa: E402


@click.command()
@click.option("--checkpoint", required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="The JSON file to write.")
@click.option("--device", type=click.Choice(("cuda", "cpu")), default="cuda", show_default=True)
@click.option("--prompts", type=int, default=16, show_default=True, help="Greedy chat completions compared.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
def main(checkpoint: Path, out: Path, device: str, prompts: int, max_tokens: int) -> None:
    targets = default_targets() if device == "cuda" else ("cpu",)
    build = dict(dtype="bfloat16", targets=targets, max_batch_size=16, max_seq_len=512, max_num_tokens=512)
    with tempfile.TemporaryDirectory(prefix="kiln-fp8kv-") as tmp:
        calibration = Path(tmp) / "calibration.txt"
        calibration.write_text("\n".join(CALIBRATION) + "\n", encoding="utf-8")
        engines = [Path(tmp) / "auto", Path(tmp) / "fp8"]
        build_engine(checkpoint, engines[0], BuildConfig(**build))
        build_engine(checkpoint, engines[1], BuildConfig(**build, kv_cache_dtype="fp8",
                                                         calibration_prompts=str(calibration)))
        chat = chat_prompts(engines[0], CHAT_QUESTIONS[:prompts])
        result = measure(engines[0], engines[1], device, chat, max_tokens)
    # The GPU machine's copy has no usable .git: there KILN_COMMIT names it (scripts/real_model_gpu.sh).
    commit = os.environ.get("KILN_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                             capture_output=True, text=True).stdout.strip()
    device_name = "cpu"
    if device == "cuda":
        import torch
        device_name = torch.cuda.get_device_name()
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit or None,
              "device": device_name, "targets": list(targets), "checkpoint": str(checkpoint),
              "command": " ".join(sys.argv), **result.to_json(),
              "pass": abs(result.perplexity_change) <= 0.01}
    out.write_text(json.dumps(record, indent=2) + "\n")
    click.echo(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
