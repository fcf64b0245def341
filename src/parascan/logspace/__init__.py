"""log_linear_scan: h[t] = logaddexp(log_gates[t] + h[t-1], log_tokens[t]).

api.py holds the public function and its autograd, ops.py the torch.library ops,
and one module per backend: reference.py (loop), chunked.py (torch), cpu.py (cpu: the C kernels
of first_order/scan.c).
"""

from parascan.logspace.api import log_linear_scan

__all__ = ["log_linear_scan"]
