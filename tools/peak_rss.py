"""Run a command; print its wall time and the peak resident memory of its whole process tree (all processes summed,
sampled every 0.1 s from /proc, Linux only). Used for the measurements in docs/data.md.

    python tools/peak_rss.py -- aah-prepare --config configs/quickstart.yaml --repeat 83 --out /tmp/stdlib_1g
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def tree_rss(root: int) -> tuple[int, int]:
    """Bytes resident in ``root`` and all its descendants: in all, and anonymous (not pages of mapped files)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/statm") as f:
                resident, shared = (int(x) * os.sysconf("SC_PAGE_SIZE") for x in f.read().split()[1:3])
            rss[int(entry)] = (resident, resident - shared)
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    total = anon = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        total, anon = total + rss.get(pid, (0, 0))[0], anon + rss.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return total, anon


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: peak_rss.py -- command [args...]")
    start = time.perf_counter()
    proc = subprocess.Popen(argv)
    peak = peak_anon = 0
    while proc.poll() is None:
        total, anon = tree_rss(proc.pid)
        peak, peak_anon = max(peak, total), max(peak_anon, anon)
        time.sleep(0.1)
    wall = time.perf_counter() - start
    print(
        f"peak_rss: exit {proc.returncode}, wall {wall:.1f} s, peak resident memory of the process tree "
        f"{peak / 2**20:.0f} MiB (anonymous {peak_anon / 2**20:.0f} MiB)",
        file=sys.stderr,
    )
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
