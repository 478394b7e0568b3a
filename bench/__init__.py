"""`bench-engine`: how fast a Kiln engine runs, and how far that is from what the hardware allows.

Every figure (decode tokens/s, offline throughput, time to first token, inter-token latency)
is printed beside its limit (the bytes one step must move over the copy bandwidth measured in
the same run, or its FLOPs over the GEMM rate measured in the same run, whichever is slower)
and beside the same model run eagerly in PyTorch in the same run.

    cli.py       the command: phases in order, progress, errors
    options.py   its list-valued option types (batch sizes, IN/OUT pairs, phases)
    model.py     the random Llama-3-8B-shape checkpoint and its engine, made once and reused
    hardware.py  copy bandwidth and GEMM rate, measured here and now
    limits.py    the cost model of one engine step (bytes that must move, FLOPs)
    driver.py    driving an EngineCore for a measurement: KV sizing, prompts, step recording
    decode.py    decode tokens/s at fixed batch sizes
    offline.py   offline throughput for input/output length pairs
    latency.py   TTFT and ITL percentiles under a steady arrival rate
    eager.py     the eager PyTorch baseline (Kiln's model weights, scaled_dot_product_attention)
    figures.py   one figure beside its limit and its eager baseline
    report.py    the table on stdout and the JSON file
"""
