"""linear_scan: x[t] = gates[t] * x[t-1] + tokens[t].

api.py         the public function and its autograd.Function
ops.py         the torch.library ops (fake kernels, vmap rules) and the backward identity
reference.py   the sequential loop: the ``loop`` backend and the oracle
chunked.py     the ``torch`` backend: a parallel chunked scan in pure PyTorch
cpu.py         the ``cpu`` backend: ctypes bindings to first_order/scan.c
"""

from parascan.linear.api import linear_scan

__all__ = ["linear_scan"]
