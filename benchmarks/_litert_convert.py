"""Convert a saved torch.export program (.pt2) to a .tflite file with LiteRT's PyTorch
converter (litert-torch, formerly ai-edge-torch). Run with the interpreter of a venv that holds the converter
(it pins packages opswap's environment does not); never imported by opswap.

    EDGE_VENV/bin/python benchmarks/_litert_convert.py IN.pt2 OUT.tflite
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    src, dst = sys.argv[1], sys.argv[2]
    try:  # the converter's new name; ai-edge-torch 0.7 is an empty shell around it
        import litert_torch as converter
    except ImportError:
        import ai_edge_torch as converter

    ep = torch.export.load(src)
    args, _ = ep.example_inputs
    edge = converter.convert(ep.module(), tuple(args))
    edge.export(dst)
    print("converted", dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
