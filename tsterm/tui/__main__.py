"""`python -m tsterm.tui [--profile NAME|PATH] [--auto] [--workspace DIR] [--serve [--port N]]`: the TUI without the
CLI (`tsterm [--profile ...]` is the same)."""
from __future__ import annotations

import argparse
import sys

from tsterm.launch import add_parallel_arguments
from tsterm.server.serve import add_workstation_serve_arguments, workstation_serve_overrides
from tsterm.tui import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tsterm.tui")
    parser.add_argument("--profile", default="default", help="profile name or YAML path")
    parser.add_argument("--auto", action="store_true", help="agent sessions run tools without asking")
    parser.add_argument("--workspace", default=None, help="agent sessions' directory (default: the profile's)")
    add_workstation_serve_arguments(parser)
    add_parallel_arguments(parser)
    args = parser.parse_args()
    try:
        serve = workstation_serve_overrides(args)
    except ValueError as e:  # ConfigError
        parser.error(str(e))
    sys.exit(main(args.profile, args.auto, args.workspace, serve,
                  {"tensor_parallel_size": args.tensor_parallel_size, "expert_parallel_size": args.expert_parallel_size,
                   "quantization": args.quantization}))
