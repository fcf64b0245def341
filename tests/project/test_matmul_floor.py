"""tools/matmul_floor.py finds every linear projection a run makes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[2] / "tools" / "matmul_floor.py"


def _load():
    spec = importlib.util.spec_from_file_location("matmul_floor", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_linear_shapes_sees_modules_and_functional_calls():
    # A fused layer applies a projection to the weight it is handed (Mamba-2's out
    # projection): a hook on nn.Linear modules misses it, the tool must not.
    floor = _load()
    layer = torch.nn.Linear(6, 5)
    handed = torch.randn(3, 5)

    def run():
        y = layer(torch.randn(2, 4, 6))
        return torch.nn.functional.linear(y, handed)

    seen = floor._linear_shapes(run)
    assert [(tuple(shape), w.shape, b is not None) for shape, w, b in seen] == [
        ((2, 4, 6), (5, 6), True),
        ((2, 4, 5), (3, 5), False),
    ]
    assert seen[0][1] is layer.weight and seen[1][1] is handed
    # the timing runs the recorded projections, forward and backward
    assert floor._linear_time(seen, train=True, repeat=1) > 0
