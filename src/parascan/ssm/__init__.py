"""The state-space scans: Mamba-1's selective scan and its decoding step.

api.py          the public functions (selective_scan, selective_state_update)
canonical.py    the contract every backend implements: operand forms, math, checkpoints
ops.py          the torch.library ops, their backend-table row, the autograd.Function
reference.py    the ``torch`` (chunked, any device) and ``loop`` backends
"""

from parascan.ssm.api import selective_scan, selective_state_update

__all__ = ["selective_scan", "selective_state_update"]
