"""parascan.cli.linear_floor (what tools/matmul_floor.py and `parascan bench --models`
time as a model's linear layers) finds every linear projection a run makes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from parascan.cli import linear_floor as floor

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "matmul_floor.py"


def test_the_tool_loads_and_uses_the_package_timing():
    spec = importlib.util.spec_from_file_location("matmul_floor", _TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.linear_time is floor.linear_time and module.linear_calls is floor.linear_calls


def test_linear_shapes_sees_modules_and_functional_calls():
    # A fused layer applies a projection to the weight it is handed (Mamba-2's out
    # projection): a hook on nn.Linear modules misses it, the tool must not.
    layer = torch.nn.Linear(6, 5)
    handed = torch.randn(3, 5)

    def run():
        y = layer(torch.randn(2, 4, 6))
        return torch.nn.functional.linear(y, handed)

    seen = floor.linear_calls(run)
    linear = torch.nn.functional.linear
    assert [(f, tuple(shape), w.shape, b is not None) for f, shape, w, b in seen] == [
        (linear, (2, 4, 6), (5, 6), True),
        (linear, (2, 4, 5), (3, 5), False),
    ]
    assert seen[0][2] is layer.weight and seen[1][2] is handed
    # the timing runs the recorded projections, forward and backward
    assert floor.linear_time(seen, train=True, repeat=1) > 0


def test_experts_and_block_diagonal_projections_count_too():
    # a mixture of experts runs its experts by grouped_mm (MiniMax), RecurrentGemma its
    # gates by baddbmm: projections of the model, which patching leaves alone
    experts, offs = torch.randn(2, 8, 4), torch.tensor([3, 7], dtype=torch.int32)
    blocks, bias = torch.randn(4, 3, 2), torch.randn(4, 1, 2)

    def run():
        torch.nn.functional.grouped_mm(torch.randn(7, 8), experts, offs=offs)
        return torch.baddbmm(bias, torch.randn(4, 5, 3), blocks)

    seen = floor.linear_calls(run)
    assert [(f.__name__, tuple(shape), w is weight) for (f, shape, w, _), weight
            in zip(seen, (experts, blocks), strict=True)] == [
        ("_grouped_mm", (7, 8), True), ("baddbmm", (4, 5, 3), True)
    ]  # fmt: skip
    assert torch.equal(seen[0][3], offs) and seen[1][3] is bias
    for train in (False, True):
        assert floor.linear_time(seen, train=train, repeat=1) > 0
