"""Start-up latency: a fresh process's time from its start to the engine loaded (weights
uploaded, kernels loaded, graphs captured) and to its first token.

bench-engine's own process has imported everything, built or read the engine and measured the
hardware before it gets here, so its clock would tell nothing. The figures come from a child
process that does only this (`python -m kiln.bench.startup ENGINE DEVICE KV_TOKENS VOCAB`): it opens a
Session with the KV pool a serving run would have, generates one token for one short prompt,
and prints the two times of its stats (runtime/startup.py's clock) as one line of JSON.
"""
from __future__ import annotations

import json
import subprocess
import sys

from kiln.bench.driver import EngineInfo, pool_tokens, random_prompts
from kiln.bench.figures import Figure
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

PROMPT_TOKENS = 8
TIMEOUT_S = 900.0


def kv_tokens_wanted(info: EngineInfo) -> int:
    """A full batch at full length: the most a Session's default pool takes (runtime/kv_pool.py)."""
    return info.manifest.max_batch_size * info.kv_tokens(info.manifest.max_seq_len)


def measure_startup(info: EngineInfo, device: str, kv_tokens: int) -> list[Figure]:
    """Seconds from a fresh process's start to the engine loaded and to its first token."""
    kv_tokens = pool_tokens(info, kv_tokens)
    child = subprocess.run([sys.executable, "-m", "kiln.bench.startup", str(info.path), device, str(kv_tokens),
                            str(info.manifest.vocab_size)],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    if child.returncode != 0:
        raise RuntimeError(f"the start-up process failed (exit code {child.returncode}):\n{child.stderr[-4000:]}")
    times = json.loads(child.stdout.splitlines()[-1])
    params = {"device": device, "kv_tokens": kv_tokens, "prompt_tokens": PROMPT_TOKENS}
    return [Figure("startup", f"start-up to {what}", "s", times[key], higher_is_better=False, key=("startup", key),
                   params=params)
            for what, key in (("engine loaded", "loaded_s"), ("first token", "first_token_s"))]


def _main(engine_dir: str, device: str, kv_tokens: str, vocab_size: str) -> None:
    with Session(engine_dir, device=device, max_kv_tokens=int(kv_tokens)) as session:
        prompt = random_prompts(1, PROMPT_TOKENS, int(vocab_size), 0)[0]
        session.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1, temperature=0.0,
                                                                                   ignore_eos=True))
        stats = session.stats
    print(json.dumps({"loaded_s": stats["loaded_s"], "first_token_s": stats["first_token_s"]}))


if __name__ == "__main__":
    _main(*sys.argv[1:])
