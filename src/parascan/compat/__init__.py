"""Drop-in replacements for functions of other projects: the same call signatures
and results, computed by parascan, so switching is an import.

accelerated_scan     scan(gates, tokens) over (B, C, T), any T
torch_parallel_scan  prefix_scan(x, prefix_func, dim, pad_value=0), reduce_scan(x, reduce_func, dim)
heinsen_sequence     compute_in_parallel, compute_in_parallel_special_case
                     (Heinsen 2023, arXiv 2311.06281, as in the paper's README)
"""
