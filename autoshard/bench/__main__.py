"""python -m autoshard.bench [--quick] [--json FILE] [--plot FILE.png] [--only KEY ...]

With no suite named, runs the full benchmark (every workload against plain jax.jit) and prints
the tables and the targets. Other suites: `compiler` (pass time vs XLA compile, GPT bytes),
`pipeline` (schedules: simulated bubble, measured step with and without overlap) and
`report FILE.json ...` (re-print saved runs; with --json/--plot, merge them).
"""
from __future__ import annotations

import argparse
import os
import sys


def _devices() -> None:
    # Must happen before jax is imported anywhere: 8 simulated CPU devices.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard.bench", description=__doc__.split("\n\n")[1])
    parser.add_argument("--quick", action="store_true", help="small sizes, 1-layer GPT, few timings")
    parser.add_argument("--json", help="write rows, metadata and targets to this file")
    parser.add_argument("--plot", help="bar chart of the ratios (PNG)")
    parser.add_argument("--only", nargs="*", help="workload keys to run (default: all)")
    parser.add_argument("--pairs", type=int, help="interleaved timing pairs per workload")
    parser.add_argument("--hlo", metavar="DIR", help="save both compiled programs' HLO text here")
    sub = parser.add_subparsers(dest="suite")
    comp = sub.add_parser("compiler", help="pass time vs XLA compile; GPT bytes vs jax.jit")
    comp.add_argument("--layers", type=int, nargs="*", default=[2, 12, 48])
    comp.add_argument("--scan", type=int, nargs="*", default=[12])
    comp.add_argument("--json")
    comp.add_argument("--quick", action="store_true", help="2 layers unrolled and scanned only")
    pipe = sub.add_parser("pipeline", help="pipeline schedules: simulated bubble, measured step")
    pipe.add_argument("--hidden", type=int, default=512)
    pipe.add_argument("--batch", type=int, default=256)
    pipe.add_argument("--json")
    pipe.add_argument("--quick", action="store_true", help="small sizes, two schedules")
    rep = sub.add_parser("report", help="print (and with --json/--plot, merge) saved --json runs")
    rep.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    _devices()
    if args.suite == "compiler":
        from .compiler import run

        if args.quick:
            run(layers=[2], scan=[2], json_path=args.json)
        else:
            run(layers=args.layers, scan=args.scan, json_path=args.json)
        return 0
    if args.suite == "pipeline":
        from .pipeline import RUNS, run as run_pipeline

        if args.quick:
            run_pipeline(hidden=32, batch=32, json_path=args.json, runs=RUNS[1:3], repeats=1)
        else:
            run_pipeline(hidden=args.hidden, batch=args.batch, json_path=args.json)
        return 0
    from . import report

    if args.suite == "report":
        import json

        docs = []
        for path in args.paths:
            with open(path) as fh:
                docs.append(json.load(fh))
        rows = [r for d in docs for r in d["rows"]]
        print(report.render(rows))
        if args.json:
            meta = dict(docs[0]["meta"], merged_from=[d["meta"] for d in docs])
            report.write_json(args.json, rows, meta)
        if args.plot:
            report.plot(args.plot, rows)
        return 0
    from .suite import run as run_suite

    meta = report.metadata()
    print(f"autoshard benchmark — {meta['date']}, {meta['machine']}, {meta['devices']}, "
          f"jax {meta['jax']}", flush=True)
    rows = run_suite(quick=args.quick, only=args.only, pairs=args.pairs,
                     progress=lambda s: print(s, flush=True), hlo_dir=args.hlo)
    print()
    print(report.render(rows))
    if args.json:
        report.write_json(args.json, rows, meta)
    if args.plot:
        report.plot(args.plot, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
