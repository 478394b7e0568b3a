"""Issue 14's FP8 accuracy check on the GPU, outside pytest (tests/fp8_accuracy_check.py): a
real model's FP8 engine against its bf16 engine on this GPU (32 chat prompts x 64 tokens,
teacher-forced agreement, bar 0.90; perplexity over fixed passages within 2%). Needs the FP8 GPU
kernels (plugins declaring FP8_TARGETS) and the model carried as for scripts/real_model_gpu.sh.
Writes date, commit, device, the figures and PASS/FAIL to --out; exits 1 when a bar is missed
and 2 when the model is not on the machine."""
from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import click  # noqa: E402

from fp8_accuracy_check import MODELS, engines, greedy_agreement, passed, perplexities, report  # noqa: E402


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=ROOT / "engines" / "gpu-work", show_default=True,
              help="Keeps the engines and compiled kernels between runs.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Results file (appended to).")
@click.option("--device", type=click.Choice(("cuda", "cpu")), default="cuda", show_default=True,
              help="cpu: the same comparison with CPU engines (what tests/test_fp8_accuracy.py runs).")
@click.option("--model", type=click.Choice(MODELS), default="smollm2-135m", show_default=True,
              help="Which real model (tests/real_models.py) to check; scripts/real_model_gpu.sh carries smollm2-135m.")
@click.option("--gptq", is_flag=True, help="Round the FP8 engine's weights by GPTQ over tests/calibration_prompts.txt "
              "(build-engine --gptq), as tests/test_fp8_accuracy.py's second engine.")
def main(workdir: Path, out: Path, device: str, model: str, gptq: bool) -> None:
    import torch

    workdir.mkdir(parents=True, exist_ok=True)
    if device == "cuda":
        from kiln.runtime.cuda_driver import device_arch
        targets = [device_arch()]
    else:
        targets = ["cpu"]
    built = engines(workdir, targets, model, gptq)
    if built is None:
        click.echo(f"{model} is not in KILN_MODEL_CACHE: carry it as scripts/real_model_gpu.sh does", err=True)
        sys.exit(2)
    agreement, ppl = greedy_agreement(built, device), perplexities(built, device)
    ok = passed(agreement, ppl)
    lines = [f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}",
             f"commit {os.environ.get('KILN_COMMIT', 'unknown')}",
             f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}",
             f"command python3 scripts/fp8_accuracy_gpu.py --out {out} --device {device} --model {model}"
             + (" --gptq" if gptq else ""),
             report(model, agreement, ppl, targets), "PASS" if ok else "FAIL", ""]
    with open(out, "a", encoding="utf-8") as f:
        f.write("\n".join(lines))
    click.echo("\n".join(lines))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
