"""`tsterm import-gguf FILE [--out DIR] [--dtype D] [--force] [--dequantize]`: a GGUF file -> a model directory
(`tsterm.convert.gguf.import_gguf`), with a progress bar on a terminal; the output path on stdout."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tsterm.convert.gguf import DTYPES, import_gguf
from tsterm.errors import TstermError
from tsterm.paths import default_cache_dir


def _progress_bar(done: int, total: int, name: str, width: int = 30) -> None:
    if not sys.stderr.isatty() and done < total:
        return
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {name[:40]:<40}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cli_main(args: list[str]) -> int:
    """Exit codes: 0 imported, 1 the file cannot be imported, 2 usage error. The output path goes to stdout."""
    parser = argparse.ArgumentParser(prog="tsterm import-gguf",
                                     description="Import a llama.cpp GGUF model as a tsterm model directory.")
    parser.add_argument("file", help="the .gguf file (the first part of a split GGUF)")
    parser.add_argument("--out", help="output directory (default: <tsterm cache>/models/<file name>)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="weight dtype (default float32)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--dequantize", action="store_true",
                        help="write every weight as floats of --dtype (default: Q8_0/Q4_0/Q4_1/Q4_K linear weights "
                             "stay quantized, Q5_K/Q6_K ones become int8 blocks, which tsterm runs on its int8/int4 "
                             "kernels)")
    try:
        opts = parser.parse_args(args)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    name = re.sub(r"-00001-of-\d{5}$", "", Path(opts.file).stem).lower()
    out = Path(opts.out) if opts.out else default_cache_dir() / "models" / name
    try:
        path = import_gguf(opts.file, out, progress=_progress_bar, dtype=opts.dtype, overwrite=opts.force,
                           dequantize=opts.dequantize)
    except TstermError as e:
        print(f"tsterm import-gguf: error: {e}", file=sys.stderr)
        return e.exit_code
    print(path)
    return 0
