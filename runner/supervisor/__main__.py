"""`python -m m3run.runner.supervisor run CONFIG --run-dir DIR ...`: the supervisor process that
`m3run launch --detach` starts. Users run `m3run launch`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from m3run.runner.supervisor.launch import LaunchOptions, launch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m3run.runner.supervisor")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run_p = sub.add_parser("run", help="supervise a run (what `m3run launch --detach` starts)")
    run_p.add_argument("config", type=Path)
    run_p.add_argument("--run-dir", type=Path, required=True)
    run_p.add_argument("--set", dest="overrides", action="append", default=[])
    run_p.add_argument("--resume", default="latest")
    run_p.add_argument("--force", action="store_true")
    run_p.add_argument("--smoke", action="store_true", help="run the smoke test in any case")
    run_p.add_argument("--log-format", choices=("text", "json"), default="text")
    run_p.add_argument(
        "--console", action="store_true", help="echo events and worker output on stdout"
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return launch(
        LaunchOptions(
            config=args.config,
            run_dir=args.run_dir,
            overrides=args.overrides,
            resume=args.resume,
            force=args.force,
            console=args.console,
            smoke=args.smoke,
            log_format=args.log_format,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
