"""Without the compiled kernels (no C compiler at install time; macOS's compiler once had
no -fopenmp), every public function still runs, on its torch backend, and gives the
results it gives with them. ``PARASCAN_KERNEL_LIBRARY`` pointed at a missing file is
such an install: each call below runs in a subprocess with and without it, inference
calls and a decoding step included (the fast paths that call a C kernel directly
once assumed the library: ``delta_rule_scan`` and ``selective_state_update`` raised
"the compiled kernels ... are not in ...").

CI also runs a leg of the suite that way (.ci/run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

F64 = torch.float64


def _calls() -> dict[str, torch.Tensor]:
    """The outputs of one call of each public function with no gradient (the fast
    paths), float64, seeded."""
    import parascan as ps
    from parascan.compat import fla, mamba_ssm

    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=F64)

    def u(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=g, dtype=F64)

    out: dict[str, torch.Tensor] = {}
    a, b = 0.5 + 0.5 * u(2, 30, 3), r(2, 30, 3)
    out["linear_scan"] = ps.linear_scan(a, b, 1)
    out["linear_scan_packed"] = ps.linear_scan(a[:1], b[:1], 1, cu_seqlens=torch.tensor([0, 7, 30]))
    out["log_linear_scan"] = ps.log_linear_scan(a.log(), b, 1)
    w, c = 0.4 * r(2, 30, 3, 3), r(2, 30, 3)
    out["matrix_linear_scan"] = ps.matrix_linear_scan(w, c)
    out["associative_scan"] = ps.associative_scan(
        lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1]), (a, b), 1
    )[1]
    out["associative_reduce"] = ps.associative_reduce(torch.matmul, w, 1)
    sel = {"u": r(2, 3, 30), "delta": u(2, 3, 30), "A": -u(3, 4), "B": r(2, 4, 30),
           "C": r(2, 4, 30), "D": r(3), "z": r(2, 3, 30)}  # fmt: skip
    out["selective_scan"], out["selective_final"] = ps.selective_scan(
        **sel, delta_softplus=True, return_final=True
    )
    state = r(2, 3, 4)
    out["selective_state_update"] = ps.selective_state_update(
        state, r(2, 3), u(2, 3), -u(3, 4), r(2, 4), r(2, 4), dt_softplus=True
    )
    out["selective_state_update_state"] = state
    ssd = {"x": r(1, 30, 2, 3), "dt": u(1, 30, 2), "A": -u(2), "B": r(1, 30, 1, 4),
           "C": r(1, 30, 1, 4), "D": r(2)}  # fmt: skip
    out["ssd_scan"], out["ssd_final"] = ps.ssd_scan(**ssd, dt_softplus=True, return_final=True)
    delta = {"q": r(2, 30, 1, 4), "k": r(2, 30, 1, 4), "v": r(2, 30, 2, 3), "beta": u(2, 30, 2),
             "g": -u(2, 30, 2)}  # fmt: skip
    out["delta_rule_scan"], final = ps.delta_rule_scan(**delta, qk_l2norm=True, return_final=True)
    step = {k: v[:, :1] for k, v in delta.items()}
    out["delta_rule_step"] = ps.delta_rule_scan(**step, qk_l2norm=True, initial=final)  # type: ignore[assignment]
    q, k, v = r(1, 30, 2, 4), r(1, 30, 2, 4), r(1, 30, 2, 3)
    out["fla_fused_recurrent_gated_delta_rule"] = fla.fused_recurrent_gated_delta_rule(
        q, k, v, g=-u(1, 30, 2), beta=u(1, 30, 2), use_qk_l2norm_in_kernel=True
    )[0]
    out["fla_chunk_kda"] = fla.chunk_kda(
        q, k, v, -u(1, 30, 2, 4), u(1, 30, 2), use_qk_l2norm_in_kernel=True
    )[0]
    out["fla_fused_recurrent_hgrn"] = fla.fused_recurrent_hgrn(r(2, 30, 3), -u(2, 30, 3))[0]
    mstate = r(2, 2, 3, 4)
    out["mamba_ssm_selective_state_update"] = mamba_ssm.selective_state_update(
        mstate, r(2, 2, 3), u(2, 2, 3), -u(2, 3, 4), r(2, 1, 4), r(2, 1, 4), dt_softplus=True
    )
    out["mamba_chunk_scan_combined"] = mamba_ssm.mamba_chunk_scan_combined(
        r(1, 30, 2, 3), u(1, 30, 2), -u(2), r(1, 30, 1, 4), r(1, 30, 1, 4), chunk_size=8
    )
    return out


def _run(path: Path, library: bool) -> dict[str, torch.Tensor]:
    env = dict(os.environ)
    if not library:
        env["PARASCAN_KERNEL_LIBRARY"] = str(path.parent / "no-such-library.so")
    here = Path(__file__).resolve().parent
    code = (
        f"import sys, torch; sys.path.insert(0, {str(here)!r}); import test_without_kernels as t; "
        f"import parascan as ps; print(ps.backends('cpu')); torch.save(t._calls(), {str(path)!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("'cpu'" in done.stdout) == library, done.stdout
    return torch.load(path)  # type: ignore[no-any-return]


def test_every_public_function_runs_without_the_compiled_kernels(tmp_path: Path) -> None:
    without = _run(tmp_path / "without.pt", library=False)
    with_ = _run(tmp_path / "with.pt", library=True)
    assert without.keys() == with_.keys()
    for name, got in without.items():
        torch.testing.assert_close(got, with_[name], msg=lambda m, n=name: f"{n}: {m}")
