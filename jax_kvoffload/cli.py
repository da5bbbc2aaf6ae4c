"""Command line: `jax-kvoffload` (also `python -m jax_kvoffload`).

Subcommands import their modules lazily, so `--help` stays fast and the config command
never initialises JAX backends.
"""

from __future__ import annotations

import argparse
import sys


def _config_explain(args: argparse.Namespace) -> int:
    from jax_kvoffload import _explain
    from jax_kvoffload.config import OffloadConfigError

    try:
        result = _explain.explain_file(args.file)
    except FileNotFoundError:
        print(f"error: {args.file}: no such file", file=sys.stderr)
        return 2
    except OffloadConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_explain.as_json(result) if args.json else _explain.as_text(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jax-kvoffload",
        description="JAX/XLA-portable KV-cache offload for LLM serving.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    config = commands.add_parser("config", help="inspect offloading configurations")
    config_commands = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    explain = config_commands.add_parser(
        "explain",
        help="print the OffloadingConfig for an engine + KV cache description and why "
        "each certification came out as it did",
    )
    explain.add_argument("file", help='JSON file: {"engine": {...}, "kv_cache": {...}}')
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(func=_config_explain)
    config.set_defaults(func=lambda _args: (config.print_help(), 0)[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)
