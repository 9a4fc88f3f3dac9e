"""The ``ltx2blas`` command."""
import argparse
import json
import sys

from .errors import Ltx2BlasError


def _cmd_info(args):
    from .info import collect, format_info

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _cmd_demo(args):
    from .demo import run_demo

    return run_demo(threads=args.threads, rank=args.rank, shape=(args.rows, args.cols))


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(prog="ltx2blas", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, BLAS, threads, CPU features, sgemm exact depth")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("demo", help="fuse an LTX-2-shaped adapter in memory, check it, time it")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="threads (default: every CPU this process may use)")
    p.add_argument("--rank", type=_positive_int, default=384, help="adapter rank (default 384)")
    p.add_argument("--rows", type=_positive_int, default=4096, help="weight rows (default 4096)")
    p.add_argument("--cols", type=_positive_int, default=4096,
                   help="weight columns (default 4096)")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (Ltx2BlasError, OSError) as exc:
        print(f"ltx2blas: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ltx2blas: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
