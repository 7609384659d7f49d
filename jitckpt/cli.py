"""The `jitckpt` command: run, analyze, report, doctor, daemon."""
from __future__ import annotations

import argparse
import sys
from typing import Optional


def _cmd_run(args: argparse.Namespace) -> int:
    from jitckpt.launcher.config import LaunchConfig
    from jitckpt.launcher.supervisor import run

    try:
        cfg = LaunchConfig.from_args(args)
    except ValueError as e:
        print(f"jitckpt run: error: {e}", file=sys.stderr)
        return 2
    return run(cfg)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from jitckpt.proxy_api import coverage

    if not args.api_coverage:
        from jitckpt import doctor

        return doctor.main(as_json=args.json)
    print(coverage.render(coverage.coverage(), as_json=args.json, verbose=args.verbose), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jitckpt.launcher.config import add_run_arguments

    parser = argparse.ArgumentParser(prog="jitckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="launch a training job (torchrun-compatible flags)",
                           allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_run_arguments(p_run)
    p_run.set_defaults(func=_cmd_run)
    from jitckpt.observability import analyze_cli, report

    from jitckpt.daemon import daemon_cli

    analyze_cli.register(sub)
    report.register(sub)
    daemon_cli.register(sub)
    p_doc = sub.add_parser("doctor", help="check what this installation can do")
    p_doc.add_argument("--api-coverage", action="store_true",
                       help="per library, what proxy mode does with each CUDA symbol PyTorch imports")
    p_doc.add_argument("--json", action="store_true", help="machine-readable output")
    p_doc.add_argument("--verbose", action="store_true", help="one line per symbol, with the reason")
    p_doc.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `jitckpt report ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
