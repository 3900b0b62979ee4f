"""The README's example: a tensor-parallel matmul that forgets one conversion, its error, and the fix.

Run: python examples/first_error.py
"""

import torch
import torch.nn.functional as F

import spmd_types as spmd
from spmd_types.testing import simulate

# 2 data-parallel x 4 tensor-parallel ranks, simulated in this process on the meta device
with simulate((2, 4), ("dp", "tp")), spmd.typecheck():
    w1 = torch.nn.Parameter(torch.empty(1024 // 4, 256))  # column-parallel: this rank's rows
    spmd.assert_type(w1, {"dp": spmd.R, "tp": spmd.V})
    x = spmd.assert_type(torch.empty(8, 256, requires_grad=True), {"dp": spmd.V, "tp": spmd.I})  # an activation
    try:
        h = F.linear(x, w1)  # forgot Megatron's copy_to_tensor_model_parallel_region
    except spmd.SpmdTypeError as err:
        print(err)
    h = F.linear(spmd.convert(x, "tp", src=spmd.I, dst=spmd.R), w1)  # the fix it names
    print(spmd.get_type(h))
