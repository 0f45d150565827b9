"""Run a command; print its wall time and the peak resident memory of its whole process tree (all processes summed,
sampled every 0.1 s from /proc, Linux only). Used for the measurements in docs/data.md.

    python tools/peak_rss.py -- aah-prepare --config configs/quickstart.yaml --repeat 83 --out /tmp/stdlib_1g
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def tree_rss(root: int) -> int:
    """Bytes resident in ``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/statm") as f:
                rss[int(entry)] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: peak_rss.py -- command [args...]")
    start = time.perf_counter()
    proc = subprocess.Popen(argv)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.1)
    wall = time.perf_counter() - start
    print(f"peak_rss: exit {proc.returncode}, wall {wall:.1f} s, peak resident memory of the process tree "
          f"{peak / 2**20:.0f} MiB", file=sys.stderr)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
