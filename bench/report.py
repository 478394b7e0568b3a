"""The report: a table on stdout and a JSON file with every figure and what it was measured on.

JSON is written to a temporary file in the same folder and renamed over the target, so a
reader never sees half a file and an interrupted run leaves the previous results intact.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

from kiln.atomic import write_bytes
from kiln.bench.figures import Figure
from kiln.bench.hardware import Hardware

SECTIONS = ("startup", "decode", "offline", "latency", "prefix")


def commit() -> str | None:
    """$KILN_COMMIT when set (a copied tree's .git, if any, may be stale), else the checked-out
    commit ("-dirty" when tracked files differ from it)."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def results(figures: list[Figure], hw: Hardware, command: str, context: dict, notes: list[str]) -> dict:
    """Everything the run measured, as one JSON-ready dict."""
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "device": hw.device_name, "torch": torch.__version__, "command": command,
           **context, "hardware": hw.to_dict()}
    for section in SECTIONS:
        out[section] = [f.to_dict() for f in figures if f.section == section]
    out["notes"] = notes
    return out


def write_json(data: dict, path: Path) -> None:
    write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if x < 10 else f"{x:.1f}"


def _ratio(x: float | None, percent: bool) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if percent else f"{x:.2f}x"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as lines: the first column left-aligned, the others right-aligned, a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _step_times(figures: list[Figure]) -> list[str]:
    """Each decode batch's step time beside its CUDA-graph replay's device time: the rest is
    the host's share of a step ("-" where no graph replayed: the CPU, tensor parallelism). On a
    tensor-parallel engine, the share of a step its collectives take, estimated from the
    step's all-reduces and all-gather timed apart from it."""
    decode = [f for f in figures if f.section == "decode" and f.value is not None]
    if not decode:
        return []
    collectives = any(f.params.get("collective_share") is not None for f in decode)
    header = ("decode step", "end to end (ms)", "graph replay (ms)", "host share")
    if collectives:
        header += ("collectives (ms, timed apart)", "collective share")
    rows = [header]
    for f in decode:
        replay, share = f.params["replay_ms_per_step"], f.params["host_share"]
        row = (f.name, f"{f.params['ms_per_step']:.3f}", "-" if replay is None else f"{replay:.3f}",
               "-" if share is None else f"{100 * share:.1f}%")
        if collectives:
            ms, part = f.params.get("collective_ms_per_step"), f.params.get("collective_share")
            row += ("-" if ms is None else f"{ms:.3f}", "-" if part is None else f"{100 * part:.1f}%")
        rows.append(row)
    lines = [""] + _table(rows)
    if collectives:
        lines.append("collectives: one step's all-reduces and the LM head's all-gather timed apart from it (each "
                     "alone, captured in a CUDA graph on the GPU), an estimate, over the measured step time")
    return lines


def render(figures: list[Figure], hw: Hardware, header: list[str], notes: list[str]) -> str:
    """The table: each figure, its limit (and which ceiling sets it), the share of the limit
    reached, the eager baseline, and how many times better than it Kiln is."""
    lines = list(header)
    lines.append(f"copy bandwidth {hw.copy_bytes_per_s / 1e9:,.1f} GB/s (read + write, "
                 f"{hw.copy_buffer_bytes / 2**20:,.0f} MiB buffer)   "
                 f"GEMM {hw.gemm_flops_per_s / 1e12:,.3g} TFLOP/s ({hw.gemm_dtype} {hw.gemm_n}^3)")
    quantized = any(f.quantization != "none" for f in figures)
    rows = [("figure", "kiln", "limit", "of limit", "eager", "vs eager") + (("vs bf16",) if quantized else ())]
    for f in figures:
        vs_bf16 = (_ratio(f.ratio_to_bf16, False),) if quantized else ()
        if f.value is None:
            rows.append((f"{f.name} ({f.unit})", "-", "-", "-", "-", "-") + vs_bf16)
            continue
        limit = f"{_num(f.limit)} ({f.bound})" if f.limit is not None else "-"
        rows.append((f"{f.name} ({f.unit})", _num(f.value), limit, _ratio(f.ratio_to_limit, True),
                     _num(f.eager), _ratio(f.ratio_to_eager, False)) + vs_bf16)
    lines.append("")
    lines += _table(rows)
    lines += _step_times(figures)
    by_note: dict[str, list[str]] = {}
    for f in figures:
        if f.note:
            by_note.setdefault(f.note, []).append(f.name)
    figure_notes = [f"{', '.join(names)}: {note}" for note, names in by_note.items()]
    if figure_notes or notes:
        lines.append("")
        lines += [f"note: {n}" for n in notes + figure_notes]
    return "\n".join(lines)
