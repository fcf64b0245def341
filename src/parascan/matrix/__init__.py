"""matrix_linear_scan: x[t] = W[t] @ x[t-1] + b[t] with d x d matrices.

api.py         the public function, its autograd.Function and the choice of strategy
ops.py         the torch.library op (fake kernel, vmap rule)
reference.py   the sequential loop: the ``loop`` backend
parallel.py    the ``torch`` backend: a parallel scan of affine maps
cpu.py         the ``cpu`` backend: ctypes bindings to recurrence.c
"""

from parascan.matrix.api import matrix_linear_scan

__all__ = ["matrix_linear_scan"]
