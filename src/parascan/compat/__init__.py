"""Drop-in replacements for functions of other projects: the same call signatures
and results, computed by parascan, so switching is an import.

accelerated_scan     scan(gates, tokens) over (B, C, T), any T
torch_parallel_scan  prefix_scan(x, prefix_func, dim, pad_value=0), reduce_scan(x, reduce_func, dim)
heinsen_sequence     compute_in_parallel, compute_in_parallel_special_case
                     (Heinsen 2023, arXiv 2311.06281, as in the paper's README)
fla                  fused_recurrent_hgrn, chunk_hgrn (flash-linear-attention's HGRN ops)
mamba_ssm            selective_scan_fn, selective_scan_ref, selective_state_update
                     (mamba_ssm 2.x's Mamba-1 scan and decoding step)
"""
