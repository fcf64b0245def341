"""The first-order scans: one algorithm, x[t] = a[t] (x) x[t-1] (+) b[t], over two
semirings (linear_scan: * and +; log_linear_scan: + and logaddexp).

api.py             linear_scan and log_linear_scan: the public functions and their validation
semiring.py        the two semirings, defined once: every backend reads them
autograd.py        the one autograd.Function (gradients from the semiring's partials)
ops.py             the torch.library ops and their rows of the backend table
reference.py       the ``loop`` backend: the sequential loop
chunked.py         the ``torch`` backend: a parallel chunked scan in pure PyTorch
cpu.py             the ``cpu`` backend: bindings to cpu.c (cpu_*.h)
triton.py          the ``triton`` backend: launches of triton_kernels.py
packed.py          packed variable-length sequences (cu_seqlens) on every backend
"""

from parascan.first_order.api import linear_scan, log_linear_scan

__all__ = ["linear_scan", "log_linear_scan"]
