"""Sequence parallelism over torch.distributed: each rank holds one contiguous shard
of the time dimension.

    import parascan.distributed as psd
    x_shard = psd.linear_scan(gates_shard, tokens_shard, dim=1)

api.py    linear_scan, log_linear_scan: a local scan, one all-gather of O(state) bytes, a fix-up;
          the backward the same in reverse
packed.py ``cu_seqlens=``: packed sequences with global offsets, across ranks
bench.py  ``python -m parascan.distributed.bench``: time and bytes per call
"""

from parascan.distributed.api import linear_scan, log_linear_scan

__all__ = ["linear_scan", "log_linear_scan"]
