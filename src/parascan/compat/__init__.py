"""Drop-in replacements for functions of other projects: the same call signatures
and results, computed by parascan, so switching is an import.

accelerated_scan     scan(gates, tokens) over (B, C, T), any T
torch_parallel_scan  prefix_scan(x, prefix_func, dim, pad_value=0), reduce_scan(x, reduce_func, dim)
heinsen_sequence     compute_in_parallel, compute_in_parallel_special_case
                     (Heinsen 2023, arXiv 2311.06281, as in the paper's README)
fla                  flash-linear-attention 0.6's ops, a module per fla.ops folder
                     (fla.ops.X.f is parascan.compat.fla.X.f; all exported by fla):
  fla.hgrn             chunk_hgrn, fused_recurrent_hgrn
  fla.delta_rule       chunk_delta_rule, fused_recurrent_delta_rule
  fla.gated_delta_rule chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
  fla.kda              chunk_kda, fused_recurrent_kda
  fla.gla              chunk_gla, fused_recurrent_gla
  fla.simple_gla       chunk_simple_gla, fused_recurrent_simple_gla
  fla.linear_attn      chunk_linear_attn, fused_recurrent_linear_attn, fused_chunk_linear_attn
  fla.retention        chunk_retention, fused_recurrent_retention
  fla.lightning_attn   chunk_lightning_attn, fused_recurrent_lightning_attn
  fla.generalized_delta_rule
                       chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule
  fla.rwkv7            chunk_rwkv7, fused_recurrent_rwkv7
mamba_ssm            selective_scan_fn, selective_scan_ref, selective_state_update
                     (mamba_ssm 2.x's Mamba-1 scan and decoding step),
                     mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
                     (Mamba-2's chunked scan, and its whole layer after the input projection)
"""
