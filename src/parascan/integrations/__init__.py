"""Integrations with other libraries' models: monkeypatches that make them compute their
scans with parascan, applied and undone by the caller.

transformers  ``patch()`` / ``unpatch()``: the recurrent models of Hugging Face
              transformers (Mamba-1 and -2, the gated delta rule, KDA, short
              convolutions, Griffin, RWKV-4, MiniMax, and the hybrids that reuse their
              layers) run their scans and decoding steps with parascan, on any device.

_patching holds the engine they share (families of functions found by their modules'
source, checked, replaced idempotently, restored). Each submodule imports its library
only when called, so importing one costs nothing and the library stays an optional
dependency.
"""
