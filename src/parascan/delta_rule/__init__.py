"""The delta rule: DeltaNet, Gated DeltaNet and Kimi Delta Attention.

api.py              delta_rule_scan: the public function and its validation
canonical.py        the backends' contract: operand forms, math, checkpoints
autograd.py         the op: its backend-table row, torch.library ops and autograd.Function
reference.py        the ``loop`` backend: the recurrence a step at a time
chunked.py          the ``torch`` backend: the chunked WY (UT transform) form in blocks
cpu.py              the ``cpu`` backend: ctypes bindings to cpu.c (cpu_kernel.h, cpu_instance.h)
"""

from parascan.delta_rule.api import delta_rule_scan

__all__ = ["delta_rule_scan"]
