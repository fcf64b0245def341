"""The state-space scans: Mamba-1's selective scan, Mamba-2's SSD scan, and their
decoding step.

api.py              the public selective-scan functions (selective_scan, selective_state_update)
canonical.py        the selective scan's backend contract: operand forms, math, checkpoints
ops.py              its torch.library ops, backend-table row, autograd.Function
reference.py        its ``torch`` (chunked, any device) and ``loop`` backends
ssd_api.py          the public SSD scan (ssd_scan)
ssd_canonical.py    the SSD scan's backend contract
ssd_ops.py          its torch.library ops, backend-table row, autograd.Function
ssd_reference.py    its ``torch`` (the dual, chunked form) and ``loop`` backends
"""

from parascan.ssm.api import selective_scan, selective_state_update
from parascan.ssm.ssd_api import ssd_scan

__all__ = ["selective_scan", "selective_state_update", "ssd_scan"]
