"""Generic associative scans: any associative combine function over tensors or pytrees.

api.py         associative_scan and associative_reduce (validation, pytrees, reverse)
chunked.py     the batched algorithms: a pairwise tree and a chunked scan
reference.py   the sequential folds: the oracle
cpu.py         the matrix-product fast path: bindings to cpu.c
"""

from parascan.generic.api import associative_reduce, associative_scan

__all__ = ["associative_reduce", "associative_scan"]
