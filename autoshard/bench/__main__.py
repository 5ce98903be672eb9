"""python -m autoshard.bench <suite> — see each suite's module for what it measures."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard.bench")
    sub = parser.add_subparsers(dest="suite", required=True)
    comp = sub.add_parser("compiler", help="pass time vs XLA compile; GPT bytes vs jax.jit")
    comp.add_argument("--layers", type=int, nargs="*", default=[2, 12, 48])
    comp.add_argument("--scan", type=int, nargs="*", default=[12])
    comp.add_argument("--json")
    comp.add_argument("--quick", action="store_true", help="2 layers unrolled and scanned only")
    args = parser.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    if args.suite == "compiler":
        from .compiler import run

        if args.quick:
            run(layers=[2], scan=[2], json_path=args.json)
        else:
            run(layers=args.layers, scan=args.scan, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
