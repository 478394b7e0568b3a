"""Issue 17's GPU check on trained weights, outside pytest (tests/real_model_check.py): the real
model's bf16 engine against transformers bf16 on this GPU, 32 chat prompts x 64 tokens,
teacher-forced argmax agreement (bar 0.99) and logits relative error (bar 2e-2). Writes date,
commit, device, the figures and PASS/FAIL to --out; exits 1 when the bar is missed and 2 when the
model is not on the machine (scripts/real_model_gpu.sh carries it)."""
from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import click  # noqa: E402

from real_model_check import AGREEMENT, REL_ERR, measure_real_model, passed  # noqa: E402


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=ROOT / "engines" / "gpu-work", show_default=True,
              help="Keeps the engine and compiled kernels between runs.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Results file (appended to).")
@click.option("--device", type=click.Choice(("cuda", "cpu")), default="cuda", show_default=True,
              help="cpu: a slow dry run of the same comparison with a CPU engine.")
def main(workdir: Path, out: Path, device: str) -> None:
    import torch

    workdir.mkdir(parents=True, exist_ok=True)
    result = measure_real_model(workdir, device)
    if result is None:
        click.echo("the real model is not in KILN_MODEL_CACHE: carry it with scripts/real_model_gpu.sh", err=True)
        sys.exit(2)
    verdict = "PASS" if passed(result) else "FAIL"
    lines = [f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}",
             f"commit {os.environ.get('KILN_COMMIT', 'unknown')}",
             f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}",
             f"command python3 scripts/real_model_gpu.py --out {out} --device {device}",
             result.line,
             f"{verdict}: bar agreement >= {AGREEMENT}, logits rel err (max over sequences) <= {REL_ERR}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write("\n".join(lines) + "\n\n")
    click.echo("\n".join(lines))
    sys.exit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
