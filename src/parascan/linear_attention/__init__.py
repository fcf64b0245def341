"""Gated linear attention: plain linear attention, simple GLA, RetNet's retention,
Lightning attention, GLA and HGRN2.

api.py              linear_attention_scan: the public function and its validation
canonical.py        the backends' contract: operand forms, math, checkpoints
autograd.py         the op: its backend-table row, torch.library ops and autograd.Function
reference.py        the ``loop`` backend: the recurrence a step at a time
chunked.py          the ``torch`` backend: blocks of matrix products (and the gated
                    products the delta rule's torch backend shares)
"""

from parascan.linear_attention.api import linear_attention_scan

__all__ = ["linear_attention_scan"]
