"""tools/compare_suites.py: two suites' paired differences side by side, on hand-made results.csv files."""

import csv
from pathlib import Path

from aah_lightning.experiments.records import COLUMNS
from helpers.cli import run_tool

FIELDS = ["row", "seed", "wall_s", *COLUMNS]  # the columns tools/suite.py writes


def write(folder: Path, rows: dict[tuple[str, int], tuple[float, float]]) -> Path:
    folder.mkdir()
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for (row, seed), (loss, gain) in rows.items():
            w.writerow(
                {k: 1.0 for k in FIELDS} | {"row": row, "seed": seed, "val_loss": loss, "val_loss_last_gain": gain}
            )
    return folder


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_paired_differences_of_both_suites_and_how_they_moved(tmp_path, capsys):
    short = write(
        tmp_path / "short",
        {
            ("baseline", 0): (2.0, 0.05),
            ("baseline", 1): (2.2, 0.07),
            ("fixed_w", 0): (1.9, 0.04),
            ("fixed_w", 1): (2.0, 0.06),
            ("static", 0): (2.1, 0.05),
        },
    )
    long = write(
        tmp_path / "long",
        {
            ("baseline", 0): (1.5, 0.01),
            ("baseline", 1): (1.6, 0.03),
            ("baseline", 2): (1.7, 0.02),
            ("fixed_w", 0): (1.45, 0.01),
            ("fixed_w", 1): (1.5, 0.02),
            ("fixed_w", 2): (1.6, 0.02),
        },
    )
    assert run_tool("compare_suites", str(short), str(long), "--names", "short", "long") == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("command: python ")
    assert cells(lines[1])[:6] == [
        "row",
        "seeds",
        "Δ vs baseline, short",
        "Δ vs baseline, long",
        "change",
        "Δ per seed, long",
    ]
    body = {cells(x)[0]: cells(x) for x in lines[3:] if x.startswith("| ")}
    assert set(body) == {"baseline", "fixed_w"}  # static ran in one suite only
    fw = body["fixed_w"]
    assert fw[1] == "2"  # seed 2 is in the long suite only: left out of the pairing
    assert fw[2] == "-0.150 ± 0.071"  # (-0.1, -0.2)
    assert fw[3] == "-0.075 ± 0.035"  # (-0.05, -0.1)
    assert fw[4] == "+0.075 ± 0.035"  # (0.05, 0.1)
    assert fw[5] == "-0.050 / -0.100"
    assert fw[6] == "1.950 ± 0.071" and fw[7] == "1.475 ± 0.035"
    assert fw[8] == "0.050 ± 0.014" and fw[9] == "0.015 ± 0.007"
    assert body["baseline"][2:6] == ["–"] * 4
    assert "Rows in one suite only: static." in out
    assert "fixed_w: seed(s) 2" in out and "baseline: seed(s) 2" in out


def test_a_folder_without_results_is_one_clear_error(tmp_path, capsys):
    assert run_tool("compare_suites", str(tmp_path), str(tmp_path)) == 1
    assert "results.csv does not exist" in capsys.readouterr().err
