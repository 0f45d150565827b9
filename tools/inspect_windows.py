"""Inspect the window table of an aah checkpoint: per-layer windows, ACR, causal coverage, block density, the
policy's hierarchy of head groups; writes window_map.png and windows.csv (layer, head, group, window).

    python tools/inspect_windows.py runs/aah/checkpoints/last.ckpt --out inspect/
    python tools/inspect_windows.py last.ckpt --out inspect/ --mask 3 5 --seq-len 1024   # + mask_layer3_head5.png

How the table is read and what each number means: ``aah_lightning/windows/inspection.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aah_lightning.errors import ConfigError
from aah_lightning.inputs import writable_folder
from aah_lightning.windows.inspection import InspectError, load, report, settings, write_files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a Lightning checkpoint of aah (or a GPT state_dict with --seq-len)")
    p.add_argument("--out", required=True, help="folder for window_map.png, windows.csv and mask pictures")
    p.add_argument("--seq-len", type=int, help="sequence length T (default: the checkpoint's)")
    p.add_argument("--block-size", type=int, help="BlockMask tile size (default: the checkpoint's)")
    p.add_argument("--mask", nargs=2, type=int, metavar=("LAYER", "HEAD"), help="also draw this head's mask")
    args = p.parse_args(argv)
    try:
        writable_folder(args.out, "--out")
        info = load(args.checkpoint)
        seq_len, block_size = settings(info, args.seq_len, args.block_size, args.mask)
    except (InspectError, ConfigError) as e:
        print(f"inspect_windows: error: {e}", file=sys.stderr)
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(report(info, seq_len, block_size))
    written = write_files(info, out, seq_len, block_size, args.mask)
    print("\nwrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
