"""The first-order scans: one algorithm, x[t] = a[t] (x) x[t-1] (+) b[t], over two
semirings (linear_scan: * and +; log_linear_scan: + and logaddexp).

linear.py, logspace.py   the public functions (linear_scan, log_linear_scan) and their docstrings
semiring.py        the two semirings, defined once: every backend reads them
arguments.py       validation, broadcasting, the final state, the eager C fast path
autograd.py        the one autograd.Function (gradients from the semiring's partials)
ops.py             the torch.library ops and their rows of the backend table
reference.py       the sequential loop: the ``loop`` backend
chunked.py         the ``torch`` backend: a parallel chunked scan in pure PyTorch
cpu.py             the ``cpu`` backend: bindings to the C kernels in this folder
triton.py          the ``triton`` backend: triton_kernels.py
"""

from parascan.first_order.linear import linear_scan
from parascan.first_order.logspace import log_linear_scan

__all__ = ["linear_scan", "log_linear_scan"]
