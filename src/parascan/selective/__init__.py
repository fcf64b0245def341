"""Mamba-1's selective scan.

api.py              selective_scan: the public function and its validation
canonical.py        the backends' contract: operand forms, math, checkpoints
autograd.py         the op: its backend-table row, torch.library ops and autograd.Function
reference.py        the ``loop`` backend: the recurrence a step at a time
chunked.py          the ``torch`` backend (a chunk's states by linear_scan) and the
                    checkpointed driver both share
cpu.py              the ``cpu`` backend: bindings to cpu.c (cpu_kernel.h)
triton.py           the ``triton`` backend: launches of triton_kernels.py
"""

from parascan.selective.api import selective_scan

__all__ = ["selective_scan"]
