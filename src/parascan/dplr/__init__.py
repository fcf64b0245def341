"""The generalized delta rule (diagonal plus rank one, DPLR): RWKV-7, and the delta
rule as its special case.

api.py              dplr_delta_rule_scan: the public function and its validation
canonical.py        the backends' contract: operand forms, math, checkpoints
autograd.py         the op: its backend-table row, torch.library ops and autograd.Function
reference.py        the ``loop`` backend: the recurrence a step at a time
chunked.py          the ``torch`` backend: blocks of matrix products and a triangular solve
cpu.py, cpu.c       the ``cpu`` backend: the C kernel (cpu_kernel.h) and its bindings
"""

from parascan.dplr.api import dplr_delta_rule_scan

__all__ = ["dplr_delta_rule_scan"]
