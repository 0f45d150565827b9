#!/usr/bin/env python
"""Carry a set of wheels to a machine without network access in parts that each fit a transfer limit.

    python tools/carry_wheels.py pack --out .whl/fa4                 # download the FA4 set (below), split it in parts
    python tools/carry_wheels.py pack --wheels DIR --out .whl/fa4    # split wheels already on disk
    python tools/carry_wheels.py install --parts P1 P2 ...           # on the offline machine: check, join, pip install

``pack`` tars the wheels, cuts the tar into chunks of at most ``--part-mib`` MiB (a wheel may be larger than one
transfer: FlashAttention-4's CuTeDSL library wheel is 87.7 MiB) and writes ``OUT/part1``, ``OUT/part2``, ... each with a
``manifest.json`` holding every chunk's SHA-256 and the whole tar's. ``install`` takes the part folders in any order,
refuses a missing or corrupt chunk with a message naming it, joins and unpacks the wheels, installs them with
``pip --no-index --no-deps`` into the running interpreter's environment (site-packages, so that the ``.pth`` file
with which ``nvidia-cutlass-dsl`` puts its packages on the path is read), and imports ``--check`` modules.

The FA4 set (``pack`` without ``--wheels``): FlashAttention-4 and what it needs beyond a CUDA torch image that
already holds cuda-bindings, einops, protobuf and typing-extensions, for CPython 3.12 on x86-64 Linux with CUDA 13.
docs/benchmarks.md ("Carrying FlashAttention-4 to an offline GPU") gives the two-transfer procedure.

Standard library only: it runs on a machine before anything is installed there.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

FA4_SET = (
    "flash-attn-4==4.0.0b36",
    "nvidia-cutlass-dsl==4.8.1",
    "nvidia-cutlass-dsl-libs-base==4.8.1",
    "nvidia-cutlass-dsl-libs-core==4.8.1",
    "nvidia-cutlass-dsl-libs-cu13==4.8.1",
    "quack-kernels==0.6.5",
    "apache-tvm-ffi==0.1.15.post2",
    "torch-c-dlpack-ext==0.1.5",
)
FA4_CHECK = ("flash_attn.cute",)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "any",
)
MANIFEST = "manifest.json"
CHUNK = "wheels.tar.{:03d}"
MIB = 1 << 20


class CarryError(Exception):
    """A part set that cannot be joined, with what is wrong and what to do."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download(specs, dest: Path, python_version: str) -> list[Path]:
    """``pip download`` each spec (no dependencies: the set names them all) for the target interpreter."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + list(specs), check=True)
    return sorted(dest.glob("*.whl"))


def pack(wheels: list[Path], out: Path, part_mib: float) -> list[Path]:
    """Tar ``wheels``, cut the tar into chunks of at most ``part_mib`` MiB, one chunk per part folder."""
    if not wheels:
        raise CarryError("no wheels to pack")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for wheel in sorted(wheels, key=lambda p: p.name):
            tar.add(wheel, arcname=wheel.name)
    data = buffer.getvalue()
    size = max(1, int(part_mib * MIB))
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    manifest = {
        "wheels": sorted(w.name for w in wheels),
        "tar_sha256": sha256(data),
        "chunks": [
            {"name": CHUNK.format(i), "part": i + 1, "bytes": len(c), "sha256": sha256(c)} for i, c in enumerate(chunks)
        ],
    }
    parts = []
    for i, chunk in enumerate(chunks):
        part = out / f"part{i + 1}"
        part.mkdir(parents=True, exist_ok=True)
        (part / CHUNK.format(i)).write_bytes(chunk)
        (part / MANIFEST).write_text(json.dumps(manifest, indent=1))
        parts.append(part)
    return parts


def join(parts: list[Path]) -> tuple[dict, bytes]:
    """The manifest and the checked tar bytes from part folders given in any order."""
    manifests = [json.loads((p / MANIFEST).read_text()) for p in parts if (p / MANIFEST).is_file()]
    if not manifests:
        raise CarryError(f"no {MANIFEST} in {', '.join(map(str, parts))}: these are not folders written by pack")
    manifest = manifests[0]
    if any(m["tar_sha256"] != manifest["tar_sha256"] for m in manifests):
        raise CarryError("the parts come from different pack runs (their manifests differ): pack once, carry those")
    data = []
    for chunk in manifest["chunks"]:
        found = [p / chunk["name"] for p in parts if (p / chunk["name"]).is_file()]
        if not found:
            raise CarryError(
                f"chunk {chunk['name']} (part {chunk['part']} of {len(manifest['chunks'])}) is missing: "
                f"carry part{chunk['part']} too"
            )
        blob = found[0].read_bytes()
        if sha256(blob) != chunk["sha256"]:
            raise CarryError(f"chunk {chunk['name']} is corrupt (SHA-256 differs from the manifest): carry it again")
        data.append(blob)
    joined = b"".join(data)
    if sha256(joined) != manifest["tar_sha256"]:
        raise CarryError("the joined tar's SHA-256 differs from the manifest")
    return manifest, joined


def unpack(parts: list[Path], dest: Path) -> list[Path]:
    """Check and join the parts, write the wheels to ``dest``."""
    manifest, data = join(parts)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
        if sorted(names) != manifest["wheels"] or any("/" in n or n.startswith(".") for n in names):
            raise CarryError(f"the tar holds {names}, not the manifest's wheels")
        tar.extractall(dest, filter="data")
    return [dest / name for name in manifest["wheels"]]


def install(wheels: list[Path], check: tuple[str, ...]) -> None:
    """``pip install`` the wheels into this interpreter's environment, then import each of ``check`` afresh."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--break-system-packages",
            *map(str, wheels),
        ],
        check=True,
    )
    for module in check:
        subprocess.run([sys.executable, "-c", f"import {module}; print('imported {module}')"], check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="download (or take) wheels and split them into parts")
    pk.add_argument("--out", type=Path, required=True, help="folder for part1, part2, ...")
    pk.add_argument("--wheels", type=Path, help="take the wheels in this folder instead of downloading the FA4 set")
    pk.add_argument(
        "--part-mib",
        type=float,
        default=56.0,
        help="largest part in MiB (default 56: a 64 MiB transfer with room for a small repository)",
    )
    pk.add_argument("--python-version", default="3.12", help="the offline interpreter's version (download only)")
    ins = sub.add_parser("install", help="check and join the parts, install the wheels here")
    ins.add_argument("--parts", type=Path, nargs="+", required=True, help="every part folder, any order")
    ins.add_argument("--dest", type=Path, default=Path("/tmp/carried-wheels"), help="where the joined wheels go")
    ins.add_argument("--check", nargs="*", default=list(FA4_CHECK), help="modules to import afterwards")
    ins.add_argument("--no-install", action="store_true", help="only check, join and unpack")
    args = p.parse_args(argv)
    try:
        if args.command == "pack":
            wheels = (
                sorted(args.wheels.glob("*.whl"))
                if args.wheels
                else download(FA4_SET, args.out / "downloaded", args.python_version)
            )
            parts = pack(wheels, args.out, args.part_mib)
            for part in parts:
                mib = sum(f.stat().st_size for f in part.iterdir()) / MIB
                print(f"{part}: {mib:.1f} MiB")
            print(f"{len(wheels)} wheels in {len(parts)} parts; on the offline machine, with every part there:")
            print(f"  python tools/carry_wheels.py install --parts {' '.join(str(q) for q in parts)}")
        else:
            wheels = unpack(args.parts, args.dest)
            print(f"joined {len(wheels)} wheels into {args.dest}")
            if not args.no_install:
                install(wheels, tuple(args.check))
    except CarryError as err:
        print(f"carry_wheels: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
