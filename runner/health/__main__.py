"""`python -m m3run.runner.health`: a human GPU check (exit 69 when a GPU is unhealthy), and, with
``--probe-json``, the probe child itself. Torch-free."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from m3run.runner.health.checks import (
    DEFAULT_MIN_FREE_MEM_MIB,
    DEFAULT_TEMP_LIMIT_C,
    check_gpu_health,
)
from m3run.runner.health.probe import DEFAULT_TIMEOUT_S, PROBE_MODES, probe_main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m m3run.runner.health",
        description="Check the GPUs; exit 69 when a GPU is unhealthy.",
    )
    parser.add_argument("--probe-json", action="store_true", help="(internal) the probe child")
    parser.add_argument("--mode", choices=PROBE_MODES, default="health", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S")
    parser.add_argument("--min-free-mib", type=int, default=DEFAULT_MIN_FREE_MEM_MIB)
    parser.add_argument("--temp-limit", type=float, default=DEFAULT_TEMP_LIMIT_C, metavar="C")
    parser.add_argument("--allow-pid", type=int, action="append", default=[], metavar="PID")
    parser.add_argument("--allow-foreign-processes", action="store_true")
    parser.add_argument("--fake", metavar="JSON", help="a FakeNVML description instead of NVML")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.probe_json:
        return probe_main(args.mode)
    report = check_gpu_health(
        timeout_s=args.timeout,
        min_free_mem_mib=args.min_free_mib,
        allowed_pids=args.allow_pid,
        allow_foreign_processes=args.allow_foreign_processes,
        temp_limit_c=args.temp_limit,
        fake=args.fake,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
