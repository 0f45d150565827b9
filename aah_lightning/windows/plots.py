"""Pictures of the window table: the layer x head window map and one head's attention mask.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch), so they render the same
in a training process, a test and a headless server. Sizes are fixed by the table's shape (no tight bounding box),
so callers know the pixel size in advance (``window_map_size``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from aah_lightning.atomic import atomic_write
from aah_lightning.model import masks, window_math

DPI = 100


def _layout(n_layer: int, n_head: int) -> tuple[float, float, float, float, float, float]:
    """Cell width/height and margins (left, right, top, bottom) in inches; cells shrink so big models stay on screen."""
    cell_w = min(0.55, 13.0 / n_head)
    cell_h = min(0.42, 11.0 / n_layer)
    return cell_w, cell_h, 0.95, 2.1, 0.55, 0.6


def window_map_size(n_layer: int, n_head: int) -> tuple[int, int]:
    """Pixel size ``(width, height)`` of the window map of an ``n_layer x n_head`` table."""
    cell_w, cell_h, left, right, top, bottom = _layout(n_layer, n_head)
    width = left + right + max(n_head * cell_w, 1.5)
    height = top + bottom + max(n_layer * cell_h, 1.6)
    return round(width * DPI), round(height * DPI)


def _short(w: int) -> str:
    return f"{w // 1024}k" if w >= 1024 and w % 1024 == 0 else str(w)


def window_map_figure(table: Tensor, seq_len: int, candidates: Sequence[int] = (), title: str | None = None):
    """Layer x head grid coloured by window (one colour per window, larger = brighter), each cell labelled with its
    window, and a legend with each window's share of heads."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    table = table.to(torch.int64).cpu()
    n_layer, n_head = table.shape
    values = sorted(set(int(c) for c in candidates) | set(table.flatten().tolist()))
    colours = matplotlib.colormaps["viridis"](np.linspace(0.0, 1.0, len(values)) if len(values) > 1 else [0.6])
    index = torch.searchsorted(torch.tensor(values), table).numpy()

    width_px, height_px = window_map_size(n_layer, n_head)
    fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    cell_w, cell_h, left, right, top, bottom = _layout(n_layer, n_head)
    w_in, h_in = width_px / DPI, height_px / DPI
    ax = fig.add_axes((left / w_in, bottom / h_in, 1 - (left + right) / w_in, 1 - (top + bottom) / h_in))
    cmap = ListedColormap(colours)
    ax.imshow(index, cmap=cmap, norm=BoundaryNorm(np.arange(len(values) + 1) - 0.5, len(values)), aspect="auto")

    step_x = max(1, math.ceil(n_head / 32))
    step_y = max(1, math.ceil(n_layer / 32))
    ax.set_xticks(range(0, n_head, step_x))
    ax.set_yticks(range(0, n_layer, step_y))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.tick_params(labelsize=8, length=0)
    ax.set_xticks(np.arange(-0.5, n_head, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, n_layer, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)

    if cell_w >= 0.3 and cell_h >= 0.2:  # labels only where they fit
        size = 7 if cell_w >= 0.45 else 6
        for l in range(n_layer):
            for h in range(n_head):
                r, g, b, _ = colours[index[l, h]]
                ink = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                ax.text(h, l, _short(int(table[l, h])), ha="center", va="center", fontsize=size, color=ink)

    total = table.numel()
    handles = [
        Patch(
            facecolor=colours[i],
            label=f"W={w}{' (full)' if w >= seq_len else ''}  {int((table == w).sum()) / total:.0%}",
        )
        for i, w in enumerate(values)
    ]
    fig.legend(
        handles=handles,
        loc="center left",
        bbox_to_anchor=(1 - (right - 0.1) / w_in, 0.5),
        fontsize=8,
        frameon=False,
        title=f"window (T={seq_len})",
        title_fontsize=8,
    )
    fig.suptitle(title or f"window map ({n_layer} layers x {n_head} heads)", fontsize=9, y=1 - 0.12 / h_in, va="top")
    return fig


def figure_rgb(fig) -> np.ndarray:
    """The rendered figure as ``uint8 [height, width, 3]``."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def save_png(fig, path) -> None:
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=DPI))


def head_mask(windows_row: Tensor, head: int, seq_len: int) -> Tensor:
    """Bool ``[T, T]`` attention mask of one head, evaluated from the layer's mask_mod (True = query attends key)."""
    mask_mod = masks.window_mask_mod(windows_row.to(torch.int32))
    q = torch.arange(seq_len).view(-1, 1)
    kv = torch.arange(seq_len).view(1, -1)
    return mask_mod(torch.zeros((), dtype=torch.long), torch.tensor(head), q, kv)


def mask_figure(windows_row: Tensor, head: int, seq_len: int, block_size: int, layer: int | None = None):
    """One head's attention mask (from the mask_mod) over ``seq_len`` tokens, with the BlockMask tile grid."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    mask = head_mask(windows_row, head, seq_len)
    window = int(windows_row[head])
    pairs, causal = int(mask.sum()), seq_len * (seq_len + 1) // 2
    partial, full = window_math.window_tiles(windows_row[head : head + 1].to(torch.int64), seq_len, block_size)
    n = partial.shape[-1]
    tiles = int((partial | full).sum())

    fig = Figure(figsize=(6.4, 6.8), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.12, 0.1, 0.82, 0.76))
    allowed = ListedColormap(["white", "#3b6fb6"])
    ax.imshow(mask.numpy(), cmap=allowed, vmin=0, vmax=1, interpolation="nearest", extent=(0, seq_len, seq_len, 0))
    if n <= 64:
        for edge in range(block_size, seq_len, block_size):
            ax.axhline(edge, color="tab:orange", linewidth=0.5, alpha=0.7)
            ax.axvline(edge, color="tab:orange", linewidth=0.5, alpha=0.7)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    where = f"layer {layer} head {head}" if layer is not None else f"head {head}"
    fig.suptitle(
        f"{where}: W={window}, T={seq_len}\n"
        f"{pairs} of {causal} causal pairs ({pairs / causal:.1%}); "
        f"{tiles} of {n * (n + 1) // 2} tiles of {block_size} ({tiles / (n * (n + 1) // 2):.1%})",
        fontsize=9,
    )
    return fig
