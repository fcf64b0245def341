"""The examples in the docstrings are exact: run them."""

from __future__ import annotations

import doctest

import pytest

import parascan._core
import parascan.compat.accelerated_scan
import parascan.compat.fla
import parascan.compat.mamba_ssm
import parascan.compat.torch_parallel_scan
import parascan.delta_rule.api
import parascan.first_order.api
import parascan.generic.api
import parascan.matrix.api


@pytest.mark.parametrize(
    "module",
    [
        parascan.first_order.api,
        parascan.generic.api,
        parascan.matrix.api,
        parascan.compat.accelerated_scan,
        parascan.compat.fla,
        parascan.compat.mamba_ssm,
        parascan.compat.torch_parallel_scan,
        parascan.delta_rule.api,
        parascan._core,
    ],
)
def test_docstring_examples(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0
