"""The window table of a checkpoint, for a person: per-layer windows with ACR, causal coverage and block density,
the window fractions, the policy's hierarchy of head groups, windows.csv (layer, head, group, window), the window map
and one head's mask as pictures (tools/inspect_windows.py is the command line).

The checkpoint is read with ``aah_lightning.checkpoint.read_checkpoint``: verified (complete archive, matching
checksums) and unpickled weights-only, so no code in it runs. Block density is the analytic tile count of the table
(the checkpoint holds no BlockMask; FlexAttention's BlockMask is built from exactly this count).
The ``group`` column is the head's level-0 group in its layer; it is empty when the policy has no groups.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import torch

from aah_lightning.atomic import atomic_write_text
from aah_lightning.checkpoint import (
    GLOBAL_STEP_KEY,
    POLICY_KEY,
    hyperparameters,
    read_checkpoint,
    sink_setting,
    window_table,
)
from aah_lightning.errors import ConfigError
from aah_lightning.windows import metrics, plots
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.policy_base import PolicyReport, policy_class


class InspectError(ValueError):
    """The checkpoint or the arguments cannot be inspected (one line for the user)."""


def load(path) -> dict:
    """Everything the report needs from a checkpoint file (a Lightning checkpoint of aah, or a GPT's state_dict)."""
    try:
        ckpt = read_checkpoint(path)
        table = window_table(ckpt).to(torch.int64)
    except ConfigError as e:
        raise InspectError(str(e)) from None
    hp = hyperparameters(ckpt)
    aah, gpt = hp.get("aah") or {}, hp.get("gpt") or {}
    return {
        "table": table,
        "seq_len": gpt.get("seq_len"),
        "block_size": gpt.get("block_size", 128),
        "policy": aah.get("policy", "?"),
        "candidates": aah.get("candidates"),
        "sink": sink_setting(ckpt),
        "report": policy_report(aah, ckpt.get(POLICY_KEY) or {}, gpt.get("seq_len")),
        "step": ckpt.get(GLOBAL_STEP_KEY),
    }


def policy_report(aah: dict, state: dict, seq_len: int | None) -> PolicyReport:
    """What the checkpoint's policy decided (its groups), rebuilt from its saved state without building it."""
    candidates = aah.get("candidates") or (AAHConfig().resolved_candidates(seq_len) if seq_len else [])
    try:
        cls = policy_class(aah["policy"]) if "policy" in aah else None
    except ConfigError:  # a plugin policy that is not importable here: show the table without its groups
        cls = None
    return PolicyReport(candidates) if cls is None else cls.report_from_state(state, candidates)


def report(info: dict, seq_len: int, block_size: int) -> str:
    table = info["table"]
    trees = info["report"].trees
    sink = info.get("sink", 0)
    acr, cov = metrics.layer_acr(table, seq_len, sink), metrics.layer_causal_coverage(table, seq_len, sink)
    dens = metrics.layer_block_density(table, seq_len, block_size, sink)
    width = max(len(str(int(w))) for w in table.flatten())
    lines = [
        f"step {info['step']}, policy {info['policy']}, T={seq_len}, {table.shape[0]} layers x {table.shape[1]} heads, "
        f"tiles of {block_size}" + (f", attention sink {sink}" if sink else ""),
        "",
        "window table (per layer: ACR, causal coverage, block density)",
    ]
    for layer, row in enumerate(table.tolist()):
        cells = " ".join(f"{w:>{width}}" for w in row)
        lines.append(
            f"  layer {layer:>2}: {cells}   ACR {acr[layer]:.4f}  cov {cov[layer]:.4f}  dens {dens[layer]:.4f}"
        )
    lines += [
        "",
        f"model: ACR {float(metrics.acr(table, seq_len, sink)):.4f}, causal coverage "
        f"{float(metrics.causal_coverage(table, seq_len, sink)):.4f}, block density "
        f"{float(metrics.block_density(table, seq_len, block_size, sink)):.4f}",
    ]
    candidates = info["candidates"] or AAHConfig().resolved_candidates(seq_len)
    shares = [f"W={w} {float((table == w).double().mean()):.1%}" for w in metrics.fraction_windows(table, candidates)]
    lines += ["window fractions: " + ", ".join(shares), "", "hierarchy:"]
    text = metrics.hierarchy_text(table, trees, info["report"].last_step)
    if trees is None:
        lines.append(f"  (policy {info['policy']} has no groups: heads and windows per layer)")
    lines += ["  " + line for line in text.splitlines()]
    return "\n".join(lines)


def write_csv(path, table: torch.Tensor, trees) -> None:
    text = io.StringIO(newline="")
    out = csv.writer(text)
    out.writerow(["layer", "head", "group", "window"])
    for layer, row in enumerate(table.tolist()):
        tree = None if trees is None else trees[layer]
        for head, window in enumerate(row):
            group = None if tree is None else tree.group_of(head)
            out.writerow([layer, head, "" if group is None else group, window])
    atomic_write_text(path, text.getvalue())


def settings(info: dict, seq_len: int | None, block_size: int | None, mask) -> tuple[int, int]:
    """The sequence length and tile size to inspect at (the checkpoint's unless given); checks ``mask`` (LAYER, HEAD)
    against the table."""
    seq_len = seq_len or info["seq_len"]
    if not seq_len or seq_len < 1:
        raise InspectError("the checkpoint has no seq_len hyperparameter: pass --seq-len")
    block_size = block_size or info["block_size"]
    table = info["table"]
    if mask is not None:
        layer, head = mask
        if not (0 <= layer < table.shape[0] and 0 <= head < table.shape[1]):
            raise InspectError(f"--mask {layer} {head}: the table has {table.shape[0]} layers x {table.shape[1]} heads")
    return seq_len, block_size


def write_files(info: dict, out: Path, seq_len: int, block_size: int, mask=None) -> list[Path]:
    """windows.csv, window_map.png and, for ``mask`` (LAYER, HEAD), that head's mask picture, in ``out``."""
    table = info["table"]
    write_csv(out / "windows.csv", table, info["report"].trees)
    title = (
        f"step {info['step']}, policy {info['policy']}: ACR {float(metrics.acr(table, seq_len, info.get('sink', 0))):.3f}, "
        f"causal coverage {float(metrics.causal_coverage(table, seq_len, info.get('sink', 0))):.3f}"
    )
    candidates = info["candidates"] or AAHConfig().resolved_candidates(seq_len)
    plots.save_png(plots.window_map_figure(table, seq_len, candidates, title), out / "window_map.png")
    written = [out / "windows.csv", out / "window_map.png"]
    if mask is not None:
        layer, head = mask
        path = out / f"mask_layer{layer}_head{head}.png"
        plots.save_png(plots.mask_figure(table[layer], head, seq_len, block_size, layer), path)
        written.append(path)
    return written
