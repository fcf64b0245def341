"""matrix_linear_scan: x[t] = W[t] @ x[t-1] + b[t] with d x d matrices.

api.py         the public function, its validation and the choice of strategy
autograd.py    the op: its backend-table row, torch.library op (fake kernel, vmap rule)
reference.py   the ``loop`` backend: the sequential loop
chunked.py     the ``torch`` backend: a parallel scan of affine maps
cpu.py         the ``cpu`` backend: ctypes bindings to cpu.c
"""

from parascan.matrix.api import matrix_linear_scan

__all__ = ["matrix_linear_scan"]
