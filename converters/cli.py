"""`llm-convert SRC --to mlx|coreml --out DIR`: export an HF folder or a .gguf file.

Errors a user can fix (unsupported architecture, missing files, bad shapes) exit with code 2 and
one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from converters.manifest import ConvertError, source_sha256


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-convert", description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="HF checkpoint folder or .gguf file")
    parser.add_argument("--to", required=True, choices=("mlx", "coreml"))
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--rows", type=int, default=4, help="batch rows of the graph (1 = serial)")
    parser.add_argument("--context", type=int, default=None, help="positions per row")
    parser.add_argument(
        "--dtype",
        choices=("float16", "float32", "bfloat16"),
        default=None,
        help="weights dtype (default: float32 for mlx, float16 for coreml)",
    )
    parser.add_argument(
        "--quantize",
        type=int,
        choices=(4, 8),
        default=None,
        help="mlx only: affine-quantize linear weights to this many bits",
    )
    return parser


def _progress(desc: str):
    from tqdm import tqdm

    def wrap(items: Iterable) -> Iterable:
        return tqdm(items, desc=desc, unit="layer", file=sys.stderr)

    return wrap


def convert(args: argparse.Namespace, scratch: Path) -> Path:
    """Run one conversion; a .gguf source is first imported into `scratch` as an HF folder."""
    src: Path = args.src
    if not src.exists():
        raise ConvertError(f"{src}: no such file or folder")
    if args.to == "coreml" and args.quantize is not None:
        raise ConvertError("--quantize applies to --to mlx only")
    if src.suffix == ".gguf":
        from converters.gguf_import import import_gguf

        source_hash = source_sha256([src])
        print(f"importing {src.name} ...", file=sys.stderr)
        src = import_gguf(src, scratch / "hf", dtype="float32")
    elif src.is_dir():
        source_hash = None
    else:
        raise ConvertError(f"{src}: expected an HF folder or a .gguf file")
    if args.to == "mlx":
        from converters.mlx_export import export_mlx

        return export_mlx(
            src,
            args.out,
            rows=args.rows,
            context_length=args.context,
            dtype=args.dtype or "float32",
            quantize=args.quantize,
            source_hash=source_hash,
        )
    from converters.coreml_export import export_coreml

    return export_coreml(
        src,
        args.out,
        rows=args.rows,
        context_length=args.context,
        dtype=args.dtype or "float16",
        source_hash=source_hash,
        progress=_progress("building graph"),
    )


def main(argv: list[str] | None = None) -> int:
    from llm_server.native.blas import ensure_fast_blas

    ensure_fast_blas()
    args = _parser().parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="llm-convert-") as scratch:
            out = convert(args, Path(scratch))
    except (ConvertError, FileNotFoundError, ValueError, KeyError) as exc:
        print(f"llm-convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
