"""The ``parascan`` command: ``info``, ``check`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

__all__ = ["main"]


def _info(args: argparse.Namespace) -> int:
    from parascan.cli.info import summary

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
    from parascan.cli.check import run_check

    return run_check(args.device, families=args.family, backend_names=args.backend)


def _bench(args: argparse.Namespace) -> int:
    from parascan.cli import bench

    if args.device.startswith("cuda"):
        return bench.run_bench(
            cases=[replace(c, device=args.device) for c in bench.CUDA_CASES],
            backend_names=args.backend, repeat=args.repeat, as_json=args.json,
        )  # fmt: skip
    workload = "quick" if args.quick else "full" if args.full else "default"
    cases, generic, packed, ssm = bench.WORKLOADS[workload]
    status = bench.run_bench(
        cases=cases, generic_cases=generic, packed_cases=packed, ssm_cases=ssm,
        backend_names=args.backend, repeat=args.repeat, as_json=args.json, plot_path=args.plot,
        sweep=bench.SWEEPS[workload],
    )  # fmt: skip
    if args.models or workload == "full":
        status = max(status, _bench_models(quick=workload == "quick"))
    elif workload == "default" and not args.json:
        print(
            "\nThe default workload: the slow implementations on smaller shapes, timed once. "
            "`parascan bench --full` runs the whole workload (about 10 minutes on 2 cores, "
            "plus the end-to-end models of `--models`)."
        )
    return status


def _bench_models(quick: bool) -> int:
    """The end-to-end tables: a transformers model of every family the patch covers
    (Mamba, Mamba2, Qwen3.5, Kimi Linear, LFM2, RecurrentGemma, RWKV, MiniMax)
    unpatched against patched (parascan.cli.bench_transformers); 1 when any result
    differs."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        print("\nEnd-to-end models: transformers is not installed "
              "(pip install 'parascan[transformers]')")  # fmt: skip
        return 0
    from parascan.cli import bench_transformers

    status = 0
    for model in bench_transformers.PATCHED_MODELS:
        print(f"\nEnd to end: {model}, unpatched against parascan.integrations.transformers",
              flush=True)  # fmt: skip
        rows = bench_transformers.run(
            quick=quick, model_name=model, progress=lambda line: print("  " + line, flush=True)
        )
        print(bench_transformers.format_rows(rows, model))
        status = max(status, 0 if all(r.correct for r in rows) else 1)
    return status


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _device_problem(text: str) -> str | None:
    """Why ``text`` names no device these commands can run on (cpu, or cuda when
    this machine has it), or None."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        return f"{text!r} is not a device name (expected cpu or cuda)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {text}, but this machine has no CUDA device"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"--device {text}, but this machine has {torch.cuda.device_count()} CUDA devices"
        return None
    if device.type != "cpu":
        return f"no checks or benchmarks for device type {device.type!r} (expected cpu or cuda)"
    if device.index is not None:
        return f"--device {text}: the CPU is one device, 'cpu' (its threads: torch.set_num_threads)"
    return None


def _validate(parsers: dict[str, argparse.ArgumentParser], args: argparse.Namespace) -> None:
    """What argparse's types cannot see, reported as argparse does (usage, one line
    saying what is wrong, exit 2), before any work starts."""
    parser = parsers[args.command]
    if args.command == "info":
        return
    devices = (args.device or []) if args.command == "check" else [args.device]
    for device in devices:
        if (problem := _device_problem(device)) is not None:
            parser.error(problem)
    if args.command == "check" and args.family:
        from parascan.cli.check import family_names

        names = family_names()
        for name in args.family:
            if name not in names:
                parser.error(f"--family {name}: expected one of {', '.join(names)}")
    if args.command == "check" and args.backend:
        from parascan import backends
        from parascan.cli.check import default_devices

        devices = devices or default_devices()
        runnable = {b for device in devices for b in backends(device)}
        for name in args.backend:
            if name not in runnable:
                parser.error(
                    f"--backend {name}: it cannot run on {', '.join(devices)} here (available: "
                    f"{', '.join(sorted(runnable))})"
                )
    if args.command != "bench":
        return
    if args.backend:
        from parascan import backends

        available = backends(args.device)
        for name in args.backend:
            if name not in available:
                parser.error(
                    f"backend {name!r} cannot run on {args.device} here (available: "
                    f"{', '.join(available)})"
                )
    if args.json and (args.models or args.full):
        parser.error("--json covers the kernel tables only; run --models or --full without it")
    if args.plot is not None:
        import importlib.util
        from pathlib import Path

        # the path first: its error does not depend on what is installed
        if not Path(args.plot).resolve().parent.is_dir():
            parser.error(f"--plot {args.plot}: its folder does not exist")
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib (pip install 'parascan[bench]')")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="parascan", description="Parallel scans and linear recurrences for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, threads, CPU features and backends per device")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_info)
    parsers = {"info": p}

    p = sub.add_parser(
        "check",
        help="self-test: every family of scans on every backend against a float64 loop, "
        "and gradcheck",
    )
    p.add_argument("--device", action="append", help="device to check: cpu or cuda (repeatable)")
    p.add_argument(
        "--family",
        action="append",
        help="check only this function, e.g. ssd_scan (repeatable; default: every family)",
    )
    p.add_argument(
        "--backend",
        action="append",
        help="check only this backend (repeatable; default: every backend of the device; "
        "the functions without a backend argument run regardless)",
    )
    p.set_defaults(run=_check)
    parsers["check"] = p

    p = sub.add_parser("bench", help="benchmark against the memory-bandwidth limit")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--backend", action="append", help="backend to time (repeatable)")
    p.add_argument("--repeat", type=_positive_int, default=5, help="timed runs per case (median)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    size.add_argument(
        "--full",
        action="store_true",
        help="the whole workload: every dtype, thread count and peer at full size (minutes)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--models",
        action="store_true",
        help="also a transformers model of every family the patch covers, end to end, "
        "unpatched against patched (needs transformers; minutes; on with --full)",
    )
    p.add_argument(
        "--plot", metavar="FILE.png", help="also sweep T and plot time against T (matplotlib)"
    )
    p.set_defaults(run=_bench)
    parsers["bench"] = p

    args = parser.parse_args(argv)
    _validate(parsers, args)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
