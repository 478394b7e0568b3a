"""Reading the serving metrics (kiln:..., runtime/metrics.py) from a Prometheus text page, as both
the OpenAI server's /metrics and Triton's metrics port show them."""
from __future__ import annotations

import re

# Every sample a page must show, counters and histograms by the names Prometheus gives their series.
SAMPLES = ("kiln:num_requests_running", "kiln:num_requests_waiting", "kiln:kv_cache_usage_perc",
           "kiln:prefix_cache_queries_total", "kiln:prefix_cache_hits_total", "kiln:prompt_tokens_total",
           "kiln:generation_tokens_total", "kiln:time_to_first_token_seconds_count",
           "kiln:inter_token_latency_seconds_count", "kiln:e2e_request_latency_seconds_count",
           "kiln:e2e_request_latency_seconds_sum")


def kiln_samples(page: str, model_name: str) -> dict[str, float]:
    """The model's kiln: samples without a bucket label, by name; each must carry model_name."""
    out = {}
    for name, labels, value in re.findall(r"^(kiln:[\w:]+)\{([^}]*)\} (\S+)$", page, re.M):
        if "le=" not in labels:
            assert f'model_name="{model_name}"' in labels, f"{name} lacks the model_name label: {labels}"
            out[name] = float(value)
    missing = [s for s in SAMPLES if s not in out]
    assert not missing, f"the page lacks {missing}:\n{page}"
    return out
