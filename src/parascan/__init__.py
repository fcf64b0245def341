"""parascan: parallel scans and linear recurrences for PyTorch.

    import parascan as ps
    x = ps.linear_scan(gates, tokens, dim=1)     # x[t] = gates[t] * x[t-1] + tokens[t]

The public API is listed in ``__all__``; see the README for the tour.
"""

import warnings as _warnings

with _warnings.catch_warnings():
    # torch without numpy (parascan's only dependency is torch) warns "Failed to initialize
    # NumPy" when it is first imported; parascan never uses numpy, so a fresh install stays
    # quiet (`parascan bench` opened with it). Only this import, only that message: the
    # program's own warning filters are restored as they were.
    _warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    from parascan._core import backends
    from parascan.delta_rule import delta_rule_scan
    from parascan.dplr import dplr_delta_rule_scan
    from parascan.first_order import linear_scan, log_linear_scan
    from parascan.generic import associative_reduce, associative_scan
    from parascan.linear_attention import linear_attention_scan
    from parascan.matrix import matrix_linear_scan
    from parascan.mixer import selective_state_update
    from parascan.selective import selective_scan
    from parascan.ssd import ssd_scan

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "associative_reduce",
    "associative_scan",
    "backends",
    "delta_rule_scan",
    "dplr_delta_rule_scan",
    "linear_attention_scan",
    "linear_scan",
    "log_linear_scan",
    "matrix_linear_scan",
    "selective_scan",
    "selective_state_update",
    "ssd_scan",
]
