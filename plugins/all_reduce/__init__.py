"""`all_reduce`: the one-shot all-reduce over peer memory that a tensor-parallel engine's
row-parallel ops use for decode-sized messages on GPUs.

A collective, not a plan op: the plan marks row-parallel ops with the attr `all_reduce`, and
the runtime sums their outputs over the ranks after their kernels (`runtime.all_reduce`).
So this folder is not registered in the op registry; it keeps the plugin layout all the same:
the PyTorch reference (`reference.py`, the plain sum), the Triton kernel that `build-engine`
compiles ahead of time into every tensor-parallel engine (`kernels.py`) and its driver launch
(`launch.py`).
"""
