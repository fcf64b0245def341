"""Integrations with other libraries' models: monkeypatches that make them compute their
scans with parascan, applied and undone by the caller.

transformers  ``patch()`` / ``unpatch()``: the Mamba-family models of Hugging Face
              transformers (Mamba, FalconMamba and the hybrids that reuse their mixers)
              run their scans and decoding steps with parascan, on any device.

_patching holds the engine they share (families of functions found by their modules'
source, checked, replaced idempotently, restored). Each submodule imports its library
only when called, so importing one costs nothing and the library stays an optional
dependency.
"""
