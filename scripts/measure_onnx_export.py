"""Measures the ONNX export of a 1B-parameter-class engine: a Llama-3.2-1B-shaped model (1.24B
parameters, tied embeddings) with random bf16 weights is built for the CPU, then exported in a
fresh process with the default external-data threshold, while a thread samples the process's
anonymous memory every 2 ms. Streaming the weights from the engine's memory map shows as a peak
growth of a few MiB, against the 2.3 GiB a copy would add. Needs about 8 GB of memory and 5 GB
of disk under --work-dir.

    python scripts/measure_onnx_export.py --work-dir /tmp/onnx-1b
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import click

LLAMA_3_2_1B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
                "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": True, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}


def build(engine: Path) -> None:
    import torch

    from kiln.builder.build import build_from_model
    from kiln.builder.config import BuildConfig
    from kiln.models.config import parse_config
    from kiln.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(parse_config(LLAMA_3_2_1B), torch.bfloat16, max_positions=256)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    start = time.time()
    summary = build_from_model(model, engine, BuildConfig(dtype="bfloat16", max_seq_len=256, max_num_tokens=256),
                               {"architecture": "LlamaForCausalLM"})
    click.echo(f"built {engine} in {time.time() - start:.1f} s: {summary.weight_bytes[0] / 2**30:.2f} GiB of weights")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def export(engine: Path, output: Path) -> None:
    import onnx

    from kiln.builder.onnx_export import export_onnx

    peak, done = [_status("RssAnon")], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.002)

    base = peak[0]
    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.time()
    try:
        (result,) = export_onnx(engine, output)
    finally:
        done.set()
        sampler.join()
    click.echo(result.render())
    click.echo(f"export {time.time() - start:.1f} s; anonymous memory {base / 2**20:.0f} MiB before, peak growth "
               f"{(peak[0] - base) / 2**20:.1f} MiB; weights {result.weight_bytes / 2**30:.2f} GiB")
    onnx.checker.check_model(str(result.path), full_check=True)
    click.echo("onnx.checker.check_model(full_check=True): passed")


@click.command()
@click.option("--work-dir", type=click.Path(path_type=Path), required=True,
              help="Where the engine (kept for a second run) and the ONNX files go.")
@click.option("--export-only", is_flag=True, hidden=True)
def main(work_dir: Path, export_only: bool) -> None:
    engine = work_dir / "engine"
    if export_only:
        export(engine, work_dir / "llama-1b.onnx")
        return
    if not (engine / "rank0.engine").is_file():
        build(engine)
    # A fresh process, so the build's memory is not in the measurement's baseline.
    sys.exit(subprocess.run([sys.executable, __file__, "--work-dir", str(work_dir), "--export-only"]).returncode)


if __name__ == "__main__":
    main()
