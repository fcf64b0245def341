"""Mamba-2's SSD scan and its fused layer.

api.py              ssd_scan: the public function and its validation
canonical.py        the backends' contract: operand forms, math, checkpoints
autograd.py         the op: its backend-table row, torch.library ops and autograd.Function
reference.py        the ``loop`` backend: the recurrence a step at a time
chunked.py          the ``torch`` backend (the state-space dual form in blocks) and the
                    checkpointed driver both share
cpu.py              the ``cpu`` backend: bindings to cpu.c (cpu_kernel.h)
triton.py           the ``triton`` backend: launches of triton_kernels.py
layer.py            Mamba-2's fused training layer on the CPU (split, convolution, scan,
                    gated norm): bindings to cpu_layer.h
"""

from parascan.ssd.api import ssd_scan

__all__ = ["ssd_scan"]
