"""The pieces of a Mamba mixer around its scan, shared by Mamba-1 and Mamba-2.

step.py             selective_state_update: one decoding step on a cached state
                    (its C kernel: selective/cpu_step.h)
conv.py             causal_conv1d: the depthwise causal convolution (torch, and the C
                    kernels of ssd/cpu_layer.h)
"""

from parascan.mixer.step import selective_state_update

__all__ = ["selective_state_update"]
