"""The ``parascan`` command: ``info``, ``check`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

__all__ = ["main"]


def _info(args: argparse.Namespace) -> int:
    from parascan._sysinfo import summary

    info = summary()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, dict):
            value = "; ".join(f"{d}: {', '.join(v) or 'none'}" for d, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(value) or "none"
        print(f"{key:<{width}}  {value}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from parascan.check import run_check

    return run_check(args.device)


def _bench(args: argparse.Namespace) -> int:
    from parascan import bench

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("parascan bench: --device cuda, but this machine has no CUDA device",
                  file=sys.stderr)  # fmt: skip
            return 2
        return bench.run_bench(
            cases=[replace(c, device=args.device) for c in bench.CUDA_CASES],
            backend_names=args.backend, repeat=args.repeat, as_json=args.json,
        )  # fmt: skip
    if args.device != "cpu":
        print(f"parascan bench: no benchmark for device {args.device!r}", file=sys.stderr)
        return 2
    return bench.run_bench(
        cases=bench.QUICK_CASES if args.quick else bench.DEFAULT_CASES,
        generic_cases=bench.QUICK_GENERIC_CASES if args.quick else bench.GENERIC_CASES,
        backend_names=args.backend,
        repeat=args.repeat,
        as_json=args.json,
        plot_path=args.plot,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="parascan", description="Parallel scans and linear recurrences for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, threads, CPU features and backends per device")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_info)

    p = sub.add_parser("check", help="self-test: every backend against the float64 loop")
    p.add_argument("--device", action="append", help="device to check (repeatable)")
    p.set_defaults(run=_check)

    p = sub.add_parser("bench", help="benchmark against the memory-bandwidth limit")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", action="append", help="backend to time (repeatable)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per case (median)")
    p.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--plot", metavar="FILE.png", help="also sweep T and plot time against T (matplotlib)"
    )
    p.set_defaults(run=_bench)

    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
