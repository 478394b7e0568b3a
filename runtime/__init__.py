"""Kiln runtime: loads engines and serves requests.

`Session(engine_dir)` is the public API; `SamplingParams` configures a request.
"""
from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

__all__ = ["Session", "SamplingParams", "RequestOutput", "CompletionOutput"]
