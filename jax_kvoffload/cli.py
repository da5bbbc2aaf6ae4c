"""Command line: `jax-kvoffload` (also `python -m jax_kvoffload`).

Subcommands import their modules lazily, so `--help` stays fast and the config command
never initialises JAX backends.
"""

from __future__ import annotations

import argparse
import re
import sys


def _config_explain(args: argparse.Namespace) -> int:
    from jax_kvoffload import _explain
    from jax_kvoffload.errors import KVOffloadError

    # Every way a description can be wrong ends in one line naming it and exit status 2;
    # a traceback would tell a user nothing they can fix.
    try:
        result = _explain.explain_file(args.file)
        out = _explain.as_json(result) if args.json else _explain.as_text(result)
    except KVOffloadError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{args.file}: {exc.strerror or exc}")
    except Exception as exc:  # a bug of ours: still one line, and say so
        return _fail(f"{args.file}: unexpected {type(exc).__name__}: {exc} (please report this)")
    print(out)
    return 0


def _fail(message: str) -> int:
    print("error: " + " ".join(message.split()), file=sys.stderr)
    return 2


BENCHMARKS = (
    "kernels",
    "offload",
    "manager",
    "canonical",
    "mesh",
    "tiers",
    "pools",
    "tpu_inference",
    "kernels_rpa",
    "gpu_paths",
)


def _bench(args: argparse.Namespace) -> int:
    import pathlib
    import runpy

    # The benchmark scripts live in the source checkout (benchmarks/), beside the package.
    if args.name is None:
        args.parser.error(f"name a benchmark: one of {', '.join(BENCHMARKS)}")
    root = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    script = root / f"{args.name}.py"
    if not script.is_file():
        print(
            f"error: {script} not found: `jax-kvoffload bench` runs the scripts of a source "
            "checkout (pip install -e .)",
            file=sys.stderr,
        )
        return 2
    saved = sys.argv
    sys.argv = [str(script), *args.args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    finally:
        sys.argv = saved
    return 0


def _demo(args: argparse.Namespace) -> int:
    import json

    # Arguments first, with modules that import no jax: a typo, a tier directory others
    # can read or a Redis server that is not running is reported at once, not after
    # the 8-17 s of importing jax (the model, the kernels) a busy machine takes.
    # The sizes and the form of each --tier are checked first, by the standard library
    # alone (instant); a tier's directory and server next (the config package: ~1 s).
    from jax_kvoffload import demo

    try:
        cfg = _demo_config(args)
    except demo.DemoConfigError as exc:
        return _fail(_in_flags(str(exc)))
    except Exception as exc:
        from jax_kvoffload.errors import KVOffloadError

        if not isinstance(exc, KVOffloadError):
            raise
        return _fail(str(exc))
    from jax_kvoffload.errors import KVOffloadError

    progress = None if args.quiet else demo.StreamProgress(sys.stderr)
    try:
        if args.role is not None:  # one process of the two-process mode
            run = demo.run_writer if args.role == "writer" else demo.run_reader
            summary = run(cfg, progress)
            print(json.dumps(summary, indent=2))
            return 0 if summary["passed"] else 1
        if args.two_process:
            relay = progress.line if progress is not None else None
            summary = demo.run_two_process(cfg, progress, relay)
            print(json.dumps(summary, indent=2) if args.json else demo.format_two_process(summary))
            return 0 if summary["passed"] else 1
        summary = demo.run_scenario(cfg, progress)
    except (demo.DemoConfigError, KVOffloadError) as exc:  # e.g. a tier that refused to open
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(demo.format_summary(summary))
    return 0 if summary["passed"] else 1


# The demo's config fields by the flags that set them: an error names what was typed.
_FLAGS = {
    "vocab_size": "--vocab", "num_layers": "--layers", "num_heads": "--heads",
    "num_kv_heads": "--kv-heads", "head_dim": "--head-dim", "ffn_dim": "--ffn-dim",
    "block_size": "--block-size", "prompt_blocks": "--prompt-blocks",
    "suffix_tokens": "--suffix-tokens", "decode_tokens": "--decode-tokens",
    "blocks_per_chunk": "--blocks-per-chunk",
}  # fmt: skip


def _in_flags(message: str) -> str:
    """`message` followed by the flags of the config fields it names (`name=`)."""
    flags = [f for name, f in _FLAGS.items() if re.search(rf"\b{name}=", message)]
    return f"{message} [{', '.join(flags)}]" if flags else message


def _demo_config(args: argparse.Namespace):
    """The demo's `ScenarioConfig`, every argument checked; only a `--kernel-backend`
    other than auto imports jax (last: the registry needs the platform's devices)."""
    from jax_kvoffload import demo

    tiers = tuple(args.tier or ())
    if args.two_process and not tiers:
        raise demo.DemoConfigError("--two-process needs at least one --tier")
    model = demo.DemoModelConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn_dim=args.ffn_dim,
        rope=not args.no_rope,
        seed=args.seed,
        cache_layout=args.layout,
    )
    sizes = dict(
        block_size=args.block_size,
        prompt_blocks=args.prompt_blocks,
        suffix_tokens=args.suffix_tokens,
        decode_tokens=args.decode_tokens,
        blocks_per_chunk=args.blocks_per_chunk,
        skip_load=args.skip_load,
        tiers=tiers,
        mesh_sizes=None if args.mesh_sizes is None else demo.parse_mesh_sizes(args.mesh_sizes),
    )
    if sizes["mesh_sizes"] is not None and not (args.two_process or args.role):
        raise demo.DemoConfigError("--mesh-sizes needs --two-process (one mesh per process)")
    demo.ScenarioConfig(model=model, **sizes)  # sizes and tier forms, without jax
    demo.check_tiers(tiers)  # directories, servers
    return demo.ScenarioConfig(model=model, kernel_backend=args.kernel_backend, **sizes)


def _add_demo(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="prefix reuse on a small Flax model: offload request A's KV blocks, reuse "
        "them for request B, check B's logits against a full recompute",
        description="Runs the prefix-reuse scenario on the default JAX backend "
        "(docs/demo.md). Exit status 1 if B's logits differ from a full recompute.",
    )
    sizes = demo.add_argument_group("model")
    sizes.add_argument("--layers", type=int, default=4, help="decoder layers (4)")
    sizes.add_argument("--heads", type=int, default=8, help="query heads (8)")
    sizes.add_argument("--kv-heads", type=int, default=2, help="KV heads, GQA (2)")
    sizes.add_argument("--head-dim", type=int, default=64, help="head dimension (64)")
    sizes.add_argument("--ffn-dim", type=int, default=1024, help="MLP hidden size (1024)")
    sizes.add_argument("--vocab", type=int, default=1024, help="vocabulary size (1024)")
    sizes.add_argument("--no-rope", action="store_true", help="no rotary embeddings")
    sizes.add_argument("--seed", type=int, default=0, help="weights and prompts seed (0)")
    sizes.add_argument(
        "--layout",
        choices=("nhd", "rpa"),
        default="nhd",
        help="KV cache layout: nhd, or rpa (tpu-inference's ragged-paged-attention v3)",
    )
    scenario = demo.add_argument_group("scenario")
    scenario.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    scenario.add_argument(
        "--prompt-blocks", type=int, default=8, help="full blocks of the shared prefix (8)"
    )
    scenario.add_argument(
        "--suffix-tokens", type=int, default=24, help="B's tokens after the prefix (24)"
    )
    scenario.add_argument("--decode-tokens", type=int, default=4, help="tokens decoded (4)")
    scenario.add_argument(
        "--blocks-per-chunk", type=int, default=2, help="blocks per offloaded chunk (2)"
    )
    # No argparse `choices`: the list comes from the pallas_kernels registry filtered by
    # this platform, which needs JAX initialised; the demo checks it before building the
    # model (ScenarioConfig) and names the backends that run here.
    scenario.add_argument(
        "--kernel-backend",
        default="auto",
        metavar="NAME",
        help="gather/scatter backend: auto (the best this platform runs) or a name from "
        "pallas_kernels.supported_backends() (xla and reference on CPU)",
    )
    scenario.add_argument(
        "--skip-load",
        action="store_true",
        help="negative control: B skips loading its prefix, so the check must fail",
    )
    tiers = demo.add_argument_group("secondary tiers")
    tiers.add_argument(
        "--tier",
        action="append",
        metavar="TIER",
        help="a secondary tier behind the host store: disk:PATH (a private directory), "
        "redis://HOST:PORT (a running Redis/Valkey server, or any node of a cluster; "
        "several nodes of one cluster comma-separated) or mooncake://HOST:PORT (a "
        "Mooncake Store's master; ?metadata=URL&local=HOST); repeatable",
    )
    tiers.add_argument(
        "--two-process",
        action="store_true",
        help="per tier: a writer process stores A's prefix, then a fresh reader process "
        "serves it from the tier; prints the ratio of serving vs recomputing it",
    )
    tiers.add_argument(
        "--mesh-sizes",
        metavar="W,R",
        help="with --two-process: the writer's engine on W devices, the reader's on R "
        "(CPU devices on a CPU host), KV heads sharded over each mesh; canonical pages "
        "carry the prefix from one tensor-parallel size to the other, e.g. 2,4",
    )
    tiers.add_argument("--role", choices=("writer", "reader"), help=argparse.SUPPRESS)
    demo.add_argument("--json", action="store_true", help="print only JSON on stdout")
    demo.add_argument("--quiet", action="store_true", help="no progress on stderr")
    demo.set_defaults(func=_demo, subparser=demo)


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
    explain.set_defaults(func=_config_explain, subparser=explain)
    config.set_defaults(func=lambda _args: (config.print_help(), 0)[1])  # type: ignore[func-returns-value]

    bench = commands.add_parser(
        "bench",
        help=f"run a benchmark script ({', '.join(BENCHMARKS)}); extra arguments pass "
        "through, e.g. `jax-kvoffload bench offload --quick`",
    )
    # `name` is checked in _bench: argparse would report a missing name as "required:
    # name, args", as if the script's (optional) arguments were required too.
    bench.add_argument("name", nargs="?", choices=BENCHMARKS)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    bench.set_defaults(func=_bench, parser=bench)
    _add_demo(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse reports a subcommand's unknown flag with the top-level usage, which
        # hides the flags that exist: report it with the subcommand's own usage instead.
        getattr(args, "subparser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)
