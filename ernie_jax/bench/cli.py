"""`python -m ernie_jax.bench COMMAND ...`: one parser per benchmark module (see bench/__init__.py)."""

from __future__ import annotations

import argparse
import sys

from ernie_jax import bench


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        # The HTTP client owns its own arguments and must not pull in the engine.
        from ernie_jax.bench import serve
        return serve.main(argv[1:])
    from ernie_jax.bench import eplb, itl, kv, mtp, offline, step_profile
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.bench", description=bench.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    offline.add_parsers(sub)
    sub.add_parser("serve", add_help=False, help="a running OpenAI-compatible server under load (`serve --help`)")
    kv.add_parsers(sub)
    itl.add_parsers(sub)
    mtp.add_parsers(sub)
    eplb.add_parsers(sub)
    step_profile.add_parsers(sub)
    args = ap.parse_args(argv)
    return args.run(args)
