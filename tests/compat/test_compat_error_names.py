"""Every drop-in's bad-input errors name the drop-in, the function its user called:
those that the parascan function it calls raises came out under that function's name
(``parascan.ssd_scan: ...`` from ``mamba_chunk_scan_combined``); they now start with the
drop-in's and end with the function that checked them. Errors that are not parascan's
(a user's combine function's) pass as they are."""

from __future__ import annotations

import re

import pytest
import torch

from parascan.compat import (
    accelerated_scan,
    fla,
    heinsen_sequence,
    mamba_ssm,
    torch_parallel_scan,
)


def _x(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(len(shape)))


CASES = {
    "selective_scan_fn": (
        "mamba_ssm.selective_scan_fn", "parascan.selective_scan",
        lambda: mamba_ssm.selective_scan_fn(
            _x(1, 2, 5), _x(1, 2, 5), -_x(2, 3), torch.ones(1, 3, 5, dtype=torch.long),
            _x(1, 3, 5)),
    ),
    "selective_state_update": (
        "mamba_ssm.selective_state_update", "parascan.selective_state_update",
        lambda: mamba_ssm.selective_state_update(
            _x(2, 3, 4), _x(2, 3), _x(2, 3), -_x(3, 4), _x(2, 5), _x(2, 4)),
    ),
    "selective_state_update with indices": (
        "mamba_ssm.selective_state_update", "parascan.selective_state_update",
        lambda: mamba_ssm.selective_state_update(
            _x(3, 3, 4), _x(2, 3), _x(2, 3), -_x(3, 4), _x(2, 5), _x(2, 4),
            state_batch_indices=torch.tensor([0, 2])),
    ),
    "mamba_chunk_scan_combined": (
        "mamba_ssm.mamba_chunk_scan_combined", "parascan.ssd_scan",
        lambda: mamba_ssm.mamba_chunk_scan_combined(
            _x(1, 4, 2, 2), _x(1, 3, 2), -_x(2), _x(1, 4, 1, 3), _x(1, 4, 1, 3), 4),
    ),
    "mamba_split_conv1d_scan_combined dt_limit": (
        "mamba_ssm.mamba_split_conv1d_scan_combined", "parascan.ssd_scan",
        lambda: mamba_ssm.mamba_split_conv1d_scan_combined(
            _x(2, 5, 14), _x(8, 3), None, _x(2), -_x(2), _x(2), 4, headdim=2,
            rmsnorm_weight=torch.ones(4), dt_limit=(1.0, 0.5)),
    ),
    "mamba_split_conv1d_scan_combined unfused": (  # through mamba_chunk_scan_combined
        "mamba_ssm.mamba_split_conv1d_scan_combined", "parascan.ssd_scan",
        lambda: mamba_ssm.mamba_split_conv1d_scan_combined(
            _x(2, 5, 14), _x(8, 3), None, _x(2), -_x(2), _x(2), 4, headdim=2,
            dt_limit=(1.0, 0.5)),
    ),
    "accelerated_scan": (
        "accelerated_scan.scan", "parascan.linear_scan",
        lambda: accelerated_scan.scan(_x(1, 2, 3), _x(1, 2, 3).to("meta")),
    ),
    "prefix_scan": (
        "torch_parallel_scan.prefix_scan", "parascan.associative_scan",
        lambda: torch_parallel_scan.prefix_scan(_x(2, 3), torch.add, 5),
    ),
    "reduce_scan": (
        "torch_parallel_scan.reduce_scan", "parascan.associative_reduce",
        lambda: torch_parallel_scan.reduce_scan(_x(2, 3), torch.add, 5),
    ),
    "chunk_gla": (  # K = 0
        "fla.chunk_gla", "parascan.linear_attention_scan",
        lambda: fla.chunk_gla(_x(1, 2, 1, 0), _x(1, 2, 1, 0), _x(1, 2, 1, 3), -_x(1, 2, 1, 0)),
    ),
    "chunk_linear_attn normalize": (  # K = 0, v widened by a column of ones
        "fla.chunk_linear_attn", "parascan.linear_attention_scan",
        lambda: fla.chunk_linear_attn(_x(1, 2, 1, 0), _x(1, 2, 1, 0), _x(1, 2, 1, 3)),
    ),
    "fused_recurrent_rwkv7": (  # K = 0
        "fla.fused_recurrent_rwkv7", "parascan.dplr_delta_rule_scan",
        lambda: fla.fused_recurrent_rwkv7(*(_x(1, 2, 1, 0),) * 3, _x(1, 2, 1, 3),
                                          *(_x(1, 2, 1, 0),) * 2),
    ),
    "compute_in_parallel": (
        "heinsen_sequence.compute_in_parallel", "parascan.log_linear_scan",
        lambda: heinsen_sequence.compute_in_parallel(
            torch.ones(2, 3, dtype=torch.long), _x(2, 4)),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_drop_ins_errors_carry_its_name(case: str) -> None:
    drop_in, checker, call = CASES[case]
    with pytest.raises((TypeError, ValueError, IndexError, RuntimeError)) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"parascan.compat.{drop_in}: "), message
    assert message.endswith(f"({checker} checked it)"), message


def test_a_users_own_error_passes_unchanged() -> None:
    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise ValueError("my own message")

    with pytest.raises(ValueError, match=re.escape("my own message")) as info:
        torch_parallel_scan.prefix_scan(_x(2, 3), combine, 1)
    assert str(info.value) == "my own message"


def test_a_drop_ins_errors_name_its_own_arguments() -> None:
    """heinsen_sequence's operands are log_coeffs and log_values: the checker's names
    (log_gates, log_tokens) would point its user at arguments they never passed."""
    bad_dtype = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match=r"expected log_coeffs to have a floating") as info:
        heinsen_sequence.compute_in_parallel(bad_dtype, _x(2, 4))
    assert "log_gates" not in str(info.value)
    shapes = re.escape("log_coeffs (5, 3), log_values[..., 1:] (2, 3)")
    with pytest.raises(ValueError, match=shapes):
        heinsen_sequence.compute_in_parallel(_x(5, 3), _x(2, 4))


def test_mamba_chunk_scan_combined_names_initial_states() -> None:
    """ssd_scan calls it initial; the drop-in's user passed initial_states."""
    from parascan.compat.mamba_ssm import mamba_chunk_scan_combined

    x, dt, B = torch.randn(1, 8, 2, 3), torch.rand(1, 8, 2), torch.randn(1, 8, 1, 4)
    bad = torch.zeros(1, 2, 3, 4, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"expected initial_states to have a real floating"):
        mamba_chunk_scan_combined(x, dt, -torch.rand(2), B, B, 4, initial_states=bad)


def test_torch_parallel_scan_names_its_function_argument() -> None:
    """Its users pass prefix_func and reduce_func; associative_scan calls it combine_fn."""
    with pytest.raises(ValueError, match=r"expected reduce_func to return") as info:
        torch_parallel_scan.reduce_scan(_x(2, 3), lambda a, b: 3, 1)
    assert "combine_fn" not in str(info.value)
    with pytest.raises(ValueError, match=r"expected prefix_func to return"):
        torch_parallel_scan.prefix_scan(_x(2, 3), lambda a, b: 3, 1)
