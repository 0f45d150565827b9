"""tools/carry_wheels.py: wheels split into parts under a size limit come back whole, and only whole."""

import json
import os
import random

from helpers.cli import run_tool

LIMIT_MIB = 0.01  # ~10 KiB parts, so a few small files need several


def make_wheels(folder, sizes):
    folder.mkdir()
    rng = random.Random(0)
    for i, size in enumerate(sizes):
        (folder / f"pkg{i}-1.0-py3-none-any.whl").write_bytes(rng.randbytes(size))
    return sorted(folder.iterdir())


def pack(tmp_path, sizes=(3000, 25000, 700)):
    wheels = make_wheels(tmp_path / "wheels", sizes)
    out = tmp_path / "parts"
    assert (
        run_tool(
            "carry_wheels",
            "pack",
            "--wheels",
            str(tmp_path / "wheels"),
            "--out",
            str(out),
            "--part-mib",
            str(LIMIT_MIB),
        )
        == 0
    )
    return wheels, sorted(out.iterdir())


def test_parts_fit_the_limit_and_join_to_the_same_wheels_in_any_order(tmp_path, capsys):
    wheels, parts = pack(tmp_path)
    assert len(parts) >= 3  # one wheel is larger than a part: it is cut across parts
    for part in parts:
        chunk = [f for f in part.iterdir() if f.name != "manifest.json"]
        assert len(chunk) == 1 and chunk[0].stat().st_size <= LIMIT_MIB * (1 << 20)
    dest = tmp_path / "joined"
    assert (
        run_tool("carry_wheels", "install", "--parts", *map(str, reversed(parts)), "--dest", str(dest), "--no-install")
        == 0
    )
    assert sorted(p.name for p in dest.iterdir()) == [w.name for w in wheels]
    for wheel in wheels:
        assert (dest / wheel.name).read_bytes() == wheel.read_bytes()
    assert f"joined {len(wheels)} wheels" in capsys.readouterr().out


def test_a_missing_corrupt_or_foreign_part_is_refused_by_name(tmp_path, capsys):
    _, parts = pack(tmp_path)
    dest = str(tmp_path / "joined")

    assert run_tool("carry_wheels", "install", "--parts", *map(str, parts[1:]), "--dest", dest, "--no-install") == 2
    assert f"chunk wheels.tar.000 (part 1 of {len(parts)}) is missing: carry part1 too" in capsys.readouterr().err

    chunk = parts[1] / "wheels.tar.001"
    data = bytearray(chunk.read_bytes())
    data[7] ^= 1
    chunk.write_bytes(bytes(data))
    assert run_tool("carry_wheels", "install", "--parts", *map(str, parts), "--dest", dest, "--no-install") == 2
    assert "chunk wheels.tar.001 is corrupt" in capsys.readouterr().err

    manifest = json.loads((parts[2] / "manifest.json").read_text())
    manifest["tar_sha256"] = "0" * 64
    (parts[2] / "manifest.json").write_text(json.dumps(manifest))
    assert run_tool("carry_wheels", "install", "--parts", *map(str, parts), "--dest", dest, "--no-install") == 2
    assert "different pack runs" in capsys.readouterr().err
    assert not os.path.exists(dest)  # nothing is unpacked from a part set that does not check out
