"""An aah GPT for Hugging Face transformers: per-head causal attention windows (copied into every export folder).

Self-contained on purpose (torch and transformers only): the export folder loads with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` on a machine without aah.

The network is aah's GPT, computed the same way: pre-norm blocks (norm, attention, norm, MLP), rotary position
embeddings in rotate-half form applied to queries and keys, no dropout. By default the norms are LayerNorm, the MLP is
GELU, every query head has its own key/value head and the output layer reuses the token embedding matrix; the Llama
family's choices are config settings (``configuration_aah.py``): grouped-query attention, SwiGLU, RMSNorm, an untied
output layer, q/k/v biases, a norm over each head's q and k (Qwen3) and RoPE's linear or llama3 scaling. Attention runs through ``scaled_dot_product_attention`` with a boolean mask built from the
window table in the config: query ``i`` of head ``h`` in layer ``l`` attends to key ``j`` iff
``0 <= i - j < windows[l][h]`` or ``0 <= j < sink <= i`` (the config's attention sink: the first ``sink`` positions of
the text stay visible), with ``i`` and ``j`` counted over the whole text so far (cached tokens included).
Keys marked 0 in a 2-D ``attention_mask`` (padding) are never attended to, and the sink is the first ``sink`` tokens
of each row's own text (after its left padding). ``attn_implementation`` is ``"sdpa"``
(the default) or ``"eager"`` (the same softmax written out); ``output_attentions=True`` computes the weights the
eager way, ``output_hidden_states=True`` returns the embeddings, every block's input and the final output.

Incremental decoding keeps, by default, only what each key/value head can still see: ``AAHWindowCache``, a
transformers ``Cache`` that ``generate`` uses unless told otherwise. A key/value head whose query heads see at most
``W`` positions back (the widest window among them) keeps the ``sink`` first positions of each row's text and a ring
of its last ``W`` (everything while the text is shorter): ``min(sink + W, length)`` positions, sized once by
``generate`` for the longest text it can reach. Each slot records the column and the text position it holds, and the
attention masks the slots by them, so the cache computes exactly what one forward pass over the whole text computes.
A ``DynamicCache`` passed in (or ``cache_implementation="dynamic"``) is still accepted: it keeps every position, and the
windows are applied by the mask, at the memory of a model without windows. Fixed-size caches of transformers
(``cache_implementation="static"``, ``"sliding_window"``, ...) are refused in one line.

Past the trained length (``max_position_embeddings``) the table still holds: a head whose window equals the trained
length slides at that length. Documents are not masked from each other even for models trained with document
masking (aah's own generation does not either): give the model one document at a time.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_aah import AAHTransformersConfig

# transformers renamed the cache argument and output field from ``past_key_values`` to ``cache`` (5.x); the model
# accepts both names and fills the field the installed version defines.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# transformers 4.56 made a Cache a list of per-layer caches (``Cache(layers=...)``); 4.5x's has none.
_LAYERED = "layers" in inspect.signature(Cache.__init__).parameters
# scaled_dot_product_attention reads one key/value head for several query heads itself from torch 2.5 on.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
# The masks one forward keeps for the layers after it (bytes): a decode step's all, a long prefill's first few.
_MASK_MEMO_BYTES = 1 << 28
# Generation modes that never take a cache back (assisted generation, contrastive search and DoLa do).
_WINDOW_CACHE_MODES = (
    "greedy_search",
    "sample",
    "beam_search",
    "beam_sample",
    "group_beam_search",
    "constrained_beam_search",
)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, H, T, D]``: ``x * cos + (-x2, x1) * sin`` with ``x = (x1, x2)`` halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def inv_frequencies(config: AAHTransformersConfig, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies ``[head_dim / 2]`` (float32): ``rope_base ** (-2i / D)``, then the scaling:
    ``linear`` divides every frequency by ``rope_factor``; ``llama3`` (Llama 3.1) divides those whose wavelength
    exceeds ``original / low_freq_factor`` by it, keeps those below ``original / high_freq_factor``, and blends the
    two linearly in ``original / wavelength`` between."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    kind, factor = config.rope_scaling_type, config.rope_factor
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        original = config.rope_original_max_position_embeddings
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        kept = original / (2 * math.pi / inv_freq)  # periods of the original context per wavelength
        smooth = ((kept - low) / (high - low)).clamp(0, 1)  # 0: long waves (scaled), 1: short waves (kept)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


def rotary_tables(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[B, 1, T, D]`` at integer positions ``[B, T]``, computed in float32 and cast to ``dtype``."""
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def text_positions(attention_mask: torch.Tensor | None, length: int, device) -> torch.Tensor:
    """Each token's position in its row's own text, ``[B or 1, length]``: the count of real tokens before it, -1 for
    padding (0 in a 2-D ``attention_mask``); without a mask, the column (what ``generate``'s ``position_ids`` are)."""
    if attention_mask is None:
        return torch.arange(length, device=device).unsqueeze(0)
    real = attention_mask.to(device=device, dtype=torch.long)
    return (real.cumsum(-1) - 1).masked_fill(real == 0, -1)


def head_windows(row: torch.Tensor):
    """A row of windows as the mask compares distances with it: one number when every head has it, else
    ``[1, H, 1, 1]`` (a mask of one head is broadcast over the heads instead of stored for each)."""
    if bool((row == row[0]).all()):
        return int(row[0])
    return row.view(1, -1, 1, 1)


def window_mask(row: torch.Tensor, past: int, length: int, positions: torch.Tensor, sink: int = 0) -> torch.Tensor:
    """The mask of one layer over every key so far, ``[B or 1, H or 1, length, past + length]``: True where query
    ``past + t`` may attend to key ``j``, i.e. ``0 <= past + t - j`` and (``past + t - j < W[h]`` or key ``j`` is one of
    its row's first ``sink`` tokens), and key ``j`` is not padding (``positions``: ``text_positions`` of every key).

    A real token always sees itself (every window is at least 1), so only padding queries could be left without any
    key, which would make their attention NaN; they are given their own position (their outputs are never used)."""
    query = torch.arange(past, past + length, device=row.device, dtype=torch.int32).view(1, 1, -1, 1)
    distance = query - torch.arange(past + length, device=row.device, dtype=torch.int32).view(1, 1, 1, -1)
    key = positions.view(positions.shape[0], 1, 1, -1)
    allowed = (key >= 0) & (distance >= 0) & ((distance < head_windows(row)) | (key < sink))
    return allowed | (distance == 0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, eager: bool):
    """Query heads ``[B, H, T, D]`` over key/value heads ``[B, Hkv, S, D]`` (query head ``h`` reads key/value head
    ``h // (H / Hkv)``) under a boolean ``mask`` broadcast to ``[B, H, T, S]``: the output ``[B, H, T, D]``, and with
    ``eager`` also the weights (the same softmax written out, which ``scaled_dot_product_attention`` does not return)."""
    group = q.shape[1] // k.shape[1]
    if eager:
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        weights = scores.masked_fill(~mask, float("-inf")).float().softmax(dim=-1).to(q.dtype)
        return weights @ v, weights
    if group > 1 and _SDPA_GQA:  # reads each key/value head in place instead of copying it for its query heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), None
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None


# -- the window cache --------------------------------------------------------------------------------------------------
def kv_widths(row: list[int], n_kv_head: int) -> list[int]:
    """The widest window among the query heads that read each key/value head: how far back it must keep keys."""
    group = len(row) // n_kv_head
    return [max(row[j * group : (j + 1) * group]) for j in range(n_kv_head)]


def cache_layout(width: int, sink: int, length: int) -> tuple[int, int]:
    """``(ring, sink slots)`` of a key/value head of widest window ``width`` for a text of ``length`` tokens: a ring of
    its last ``min(width, length)`` positions, and fixed slots for the sink positions the ring has moved past by then:
    ``min(sink + width, length)`` slots in all, as aah's own decoding cache keeps."""
    ring = min(width, length)
    return ring, min(sink, max(0, length - ring))


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` with one batch size: a leading 1 (rows alike) is expanded to the other's."""
    rows = max(a.shape[0], b.shape[0])
    return a.expand(rows, *a.shape[1:]), b.expand(rows, *b.shape[1:])


def slot_mask(
    col: torch.Tensor, pos: torch.Tensor, fixed: int, low: int, past: int, length: int, windows, sink: int
) -> torch.Tensor:
    """Which slots queries ``past .. past + length - 1`` may attend to, ``[B or 1, heads or 1, length, slots]``:
    slot ``s`` holds the key of column ``col[:, s]`` (-1: empty) at text position ``pos[:, s]`` (-1: padding or empty);
    the first ``fixed`` slots are sink slots, which count only for a column below ``low``, the oldest one the ring
    holds (until then the ring holds the same key). Otherwise as ``window_mask``."""
    slots = col.shape[1]
    column = col.to(torch.int32).view(col.shape[0], 1, 1, slots)  # int32: half the memory of a long prefill's mask
    key = pos.view(pos.shape[0], 1, 1, slots)
    distance = torch.arange(past, past + length, device=col.device, dtype=torch.int32).view(1, 1, -1, 1) - column
    in_ring = (torch.arange(slots, device=col.device) >= fixed).view(1, 1, 1, slots)
    usable = (key >= 0) & (in_ring | (column < low))
    allowed = usable & (distance >= 0) & ((distance < windows) | (key < sink))
    return allowed | (in_ring & (distance == 0))


class _HeadGroup:
    """Key/value heads of one layer with the same widest window, and the slots that keep their keys and values."""

    def __init__(self, kv_heads: list[int], queries: list[int], windows: list[int], width: int, whole: bool):
        self.kv_heads, self.queries = (None, None) if whole else (kv_heads, queries)  # None: all, in order
        self.windows, self.width = windows, width  # the query heads' windows, and the widest
        self.ring = self.fixed = 0  # the layout: a ring of ``ring`` slots after ``fixed`` sink slots
        self.k = self.v = None  # [B, heads, fixed + ring, D]
        self.col = self.pos = None  # [B or 1, fixed + ring]: the column and the text position each slot holds
        self._index: dict = {}

    def index(self, name: str, device) -> torch.Tensor | None:
        heads = getattr(self, name)
        if heads is None:
            return None
        if (name, device) not in self._index:
            self._index[name, device] = torch.tensor(heads, device=device)
        return self._index[name, device]

    def head_windows(self, device):
        if ("windows", device) not in self._index:
            self._index["windows", device] = head_windows(torch.tensor(self.windows, device=device))
        return self._index["windows", device]

    def write(self, k, v, past: int, positions: torch.Tensor, sink_rows: bool) -> None:
        """Write ``k``, ``v`` ``[B, heads, T, D]`` of columns ``past ..`` in place: into the ring (``T`` is 1, or
        the ring has room for all of them, so no key a query of them needs is overwritten), and a row's sink
        positions into their sink slots too."""
        T = k.shape[2]
        first = self.fixed + past % self.ring  # T > 1 only where the ring has not wrapped: contiguous slots
        self.k[:, :, first : first + T] = k
        self.v[:, :, first : first + T] = v
        self.col, positions = _same_rows(self.col, positions)
        self.pos, _ = _same_rows(self.pos, positions)
        self.col, self.pos = self.col.contiguous(), self.pos.contiguous()
        self.col[:, first : first + T] = torch.arange(past, past + T, device=k.device)
        self.pos[:, first : first + T] = positions
        if sink_rows:
            cols = torch.arange(past, past + T, device=k.device).expand_as(positions)
            self._keep_sinks(k, v, cols, positions)

    def _keep_sinks(self, k, v, col, pos) -> None:
        """Copy each row's key and value of text position ``j`` (if among ``k``, ``v`` ``[B, heads, n, D]``, whose
        columns and positions are ``col``, ``pos`` ``[B or 1, n]``) into sink slot ``j``, for every sink slot."""
        B = k.shape[0]
        for j in range(self.fixed):
            hit = pos == j  # at most one per row
            found = hit.any(-1)
            if not bool(found.any()):
                continue
            at = hit.to(torch.int8).argmax(-1)
            column = col.gather(1, at.unsqueeze(1)).squeeze(1)
            if hit.shape[0] == 1 and self.col.shape[0] == 1:  # every row alike
                self.k[:, :, j], self.v[:, :, j] = k[:, :, int(at)], v[:, :, int(at)]
                self.col[:, j], self.pos[:, j] = column, j
                continue
            rows = torch.arange(B, device=k.device)
            at, found, column = (t.expand(B) for t in (at, found, column))
            keep = found.view(B, 1, 1)
            self.k[:, :, j] = torch.where(keep, k[rows, :, at], self.k[:, :, j])
            self.v[:, :, j] = torch.where(keep, v[rows, :, at], self.v[:, :, j])
            self.col, self.pos = (t.expand(B, -1).contiguous() for t in (self.col, self.pos))
            self.col[:, j] = torch.where(found, column, self.col[:, j])
            self.pos[:, j] = torch.where(found, torch.full_like(column, j), self.pos[:, j])

    def joined(self, k, v, past: int, positions: torch.Tensor):
        """The slots held so far followed by ``k``, ``v`` of columns ``past ..``, with their columns and positions."""
        col = torch.arange(past, past + k.shape[2], device=k.device).unsqueeze(0)
        if self.k is None:
            return (k, v, *_same_rows(col, positions))
        old_col, col = _same_rows(self.col, col)
        old_pos, positions = _same_rows(self.pos, positions)
        return (
            torch.cat([self.k, k], dim=2),
            torch.cat([self.v, v], dim=2),
            torch.cat([old_col, col], dim=1),
            torch.cat([old_pos, positions], dim=1),
        )

    def store(self, k, v, col, pos, past: int, count: int, layout: tuple[int, int]) -> None:
        """Keep of ``joined``'s keys and values (``count`` columns seen) what the ``layout`` holds: the last ``ring``
        columns at slots ``fixed + column % ring``, and each row's sink positions in the sink slots."""
        ring, fixed = layout
        held = k.shape[2] - (count - past)  # slots held before this call: the new columns follow them
        cols = torch.arange(max(0, count - ring), count, device=k.device)
        source = torch.where(cols >= past, held + cols - past, self.fixed + cols % max(self.ring, 1))
        slots = fixed + cols % ring
        B, heads, _, D = k.shape
        self.k, self.v = k.new_zeros(B, heads, fixed + ring, D), v.new_zeros(B, heads, fixed + ring, D)
        self.k[:, :, slots] = k.index_select(2, source)
        self.v[:, :, slots] = v.index_select(2, source)
        self.col = torch.full((col.shape[0], fixed + ring), -1, dtype=torch.long, device=k.device)
        self.pos = torch.full_like(self.col, -1)
        self.col[:, slots] = col.index_select(1, source)
        self.pos[:, slots] = pos.index_select(1, source)
        self.ring, self.fixed = layout
        self._keep_sinks(k, v, col, pos)

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)
            if self.col.shape[0] > 1:
                self.col, self.pos = self.col.index_select(0, rows), self.pos.index_select(0, rows)

    def reset(self) -> None:
        self.ring = self.fixed = 0
        self.k = self.v = self.col = self.pos = None


class AAHWindowLayer:
    """One layer's window cache: its key/value heads grouped by their widest window (one attention call per group)."""

    def __init__(self, row: list[int], n_kv_head: int, sink: int, max_len: int | None):
        self.sink, self.max_len, self.count = sink, max_len, 0  # count: the columns seen
        widths, group = kv_widths(row, n_kv_head), len(row) // n_kv_head
        self.groups = []
        for width in sorted(set(widths)):
            heads = [j for j, w in enumerate(widths) if w == width]
            queries = [h for j in heads for h in range(j * group, (j + 1) * group)]
            self.groups.append(_HeadGroup(heads, queries, [row[h] for h in queries], width, len(heads) == n_kv_head))

    def attend(self, q, k, v, positions: torch.Tensor, sink_rows: bool, masks: dict, eager: bool):
        """Store this call's keys and values ``[B, Hkv, T, D]`` (rotated) of text ``positions`` ``[B or 1, T]``, and
        attend the queries ``[B, H, T, D]`` over what each key/value head holds: the output ``[B, H, T, D]`` and, with
        ``eager``, the weights over the columns so far ``[B, H, T, count]``. ``sink_rows``: some new token is among
        its row's first ``sink``. ``masks``: the masks of this forward so far, by group: every layer holds the same
        columns, so groups of one widest window and the same query windows in any layer have the same mask."""
        past, T = self.count, k.shape[2]
        count = past + T
        length = max(count, self.max_len or 0)  # generate sizes the cache once for the longest text it reaches
        out = q if len(self.groups) == 1 else torch.empty_like(q)
        weights = None
        for g in self.groups:
            kv, queries = g.index("kv_heads", k.device), g.index("queries", q.device)
            kg, vg = (x if kv is None else x.index_select(1, kv) for x in (k, v))
            qg = q if queries is None else q.index_select(1, queries)
            layout = cache_layout(g.width, self.sink, length)
            in_place = g.k is not None and layout == (g.ring, g.fixed) and (T == 1 or count <= layout[0])
            if in_place:
                g.write(kg, vg, past, positions, sink_rows)
                keys, values, col, pos, low = g.k, g.v, g.col, g.pos, max(0, count - g.ring)
            else:  # the first call, a chunk that would overwrite keys its own queries need, or a longer text
                keys, values, col, pos = g.joined(kg, vg, past, positions)
                low = max(0, past - g.ring) if g.k is not None else 0
            key = (g.width, tuple(g.windows), in_place)
            mask = masks.get(key)
            if mask is None:
                mask = slot_mask(col, pos, g.fixed, low, past, T, g.head_windows(q.device), self.sink)
                if masks.get("bytes", 0) + mask.numel() <= _MASK_MEMO_BYTES:  # a long prefill keeps only a few
                    masks[key], masks["bytes"] = mask, masks.get("bytes", 0) + mask.numel()
            y, w = attention(qg, keys, values, mask, eager)
            if not in_place:
                g.store(keys, values, col, pos, past, count, layout)
            if eager:  # the weights of each slot at its column (an empty slot's weight is 0)
                if weights is None:
                    weights = w.new_zeros(q.shape[0], q.shape[1], T, count)
                spread = w.new_zeros(w.shape[0], w.shape[1], T, count)
                spread.scatter_add_(-1, col.clamp(min=0).view(col.shape[0], 1, 1, -1).expand_as(w), w)
                if queries is None:
                    weights = spread
                else:
                    weights.index_copy_(1, queries, spread)
            if queries is None:
                out = y
            else:
                out.index_copy_(1, queries, y)
        self.count = count
        return out, weights

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for g in self.groups for x in (g.k, g.v) if x is not None)


class AAHWindowCache(Cache):
    """The default cache of an aah model in transformers: per layer and key/value head, the first ``sink`` positions
    of each row's text and a ring of the last ``W`` (the widest window of the query heads that read it), so
    ``min(sink + W, length)`` positions, what aah's own decoding cache keeps (and the model card counts).

    ``generate`` makes one sized for the longest text it can reach (``max_len``): it is allocated at the first call
    and filled in place from then on. Without ``max_len`` (``AAHWindowCache(model.config)``, or the model's forward
    given ``use_cache=True`` and no cache) it grows with the text up to ``sink + W`` positions per key/value head.
    The model's attention reads it (``AAHWindowLayer.attend``); ``update``, which would return every key so far in
    order, is not offered."""

    is_compileable = False
    is_croppable = False  # what the ring has overwritten cannot be brought back

    def __init__(self, config, max_len: int | None = None):
        n_kv, sink = config.num_key_value_heads, int(getattr(config, "sink", 0))
        self.window_layers = [AAHWindowLayer(list(row), n_kv, sink, max_len) for row in config.windows]
        if _LAYERED:  # transformers 4.56+: a cache is a list of layers, which its own methods walk
            super().__init__(layers=self.window_layers)
        else:
            super().__init__()

    def __len__(self) -> int:
        return len(self.window_layers)

    def __repr__(self) -> str:
        return f"AAHWindowCache({len(self)} layers, {self.get_seq_length()} tokens, {self.nbytes:,} bytes)"

    @property
    def nbytes(self) -> int:
        """The bytes of the keys and values it holds."""
        return sum(layer.nbytes for layer in self.window_layers)

    @property
    def is_initialized(self) -> bool:
        return any(layer.count for layer in self.window_layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        raise NotImplementedError(
            "AAHWindowCache is read by the aah model's attention (its slots are not in position order): pass it to "
            "the model, or use a DynamicCache to get every key back"
        )

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.window_layers[layer_idx or 0].count if self.window_layers else 0

    def get_max_cache_shape(self, layer_idx: int = 0):
        return -1 if _LAYERED else None  # no limit: the text may go on (4.5x spelled it None)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.window_layers:
            for g in layer.groups:
                g.select_rows(torch.as_tensor(indices, device=g.k.device if g.k is not None else None))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.window_layers:
            for g in layer.groups:
                if g.k is not None:
                    g.select_rows(torch.arange(g.k.shape[0], device=g.k.device).repeat_interleave(repeats))

    def crop(self, max_length: int) -> None:
        count = self.get_seq_length()
        if max_length == 0 or max_length >= count:  # nothing to take back
            return
        raise ValueError(
            "AAHWindowCache cannot be cropped (its ring has overwritten older keys): pass past_key_values="
            "DynamicCache() to generate for assisted decoding or other rollbacks"
        )

    def reset(self) -> None:
        for layer in self.window_layers:
            layer.count = 0
            for g in layer.groups:
                g.reset()


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (torch's ``nn.RMSNorm``, which aah trains with,
    written out for the torch versions before it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(config: AAHTransformersConfig, dim: int) -> nn.Module:
    """The norm of ``config.norm`` over ``dim`` channels (LayerNorm has a bias only with ``config.bias``)."""
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.layer_norm_eps)
    return nn.LayerNorm(dim, eps=config.layer_norm_eps, bias=config.bias)


class AAHAttention(nn.Module):
    """``num_attention_heads`` query heads, ``num_key_value_heads`` key/value heads (query head ``h`` reads key/value
    head ``h // group``). The fused ``qkv`` projection holds the rows of q, then k, then v."""

    def __init__(self, config: AAHTransformersConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.qkv = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.bias or config.qkv_bias)
        self.proj = nn.Linear(q_size, config.hidden_size, bias=config.bias)
        if config.qk_norm:  # one norm over each head's channels, shared by the heads
            self.q_norm, self.k_norm = make_norm(config, self.head_dim), make_norm(config, self.head_dim)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, cache: Cache | None, eager: bool = False, step=None):
        """The attention output, and with ``eager`` also its weights ``[B, H, T, past + T]``. With an
        ``AAHWindowCache`` the cache masks its own slots (``step``: the new tokens' text positions, and whether one
        of them is a sink position); otherwise ``mask`` covers every key so far."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        # keys are cached after the rotation, at their absolute positions (key/value heads)
        if isinstance(cache, AAHWindowCache):
            y, weights = cache.window_layers[self.layer_idx].attend(q, k, v.contiguous(), *step, eager)
        else:
            if cache is not None:
                k, v = cache.update(k, v.contiguous(), self.layer_idx)
            y, weights = attention(q, k, v.contiguous(), mask, eager)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D)), weights


class AAHMLP(nn.Module):
    """``proj(gelu(fc x))``."""

    def __init__(self, config: AAHTransformersConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class AAHSwiGLU(nn.Module):
    """The Llama family's gated MLP: ``proj(silu(gate x) * up x)``."""

    def __init__(self, config: AAHTransformersConfig):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class AAHBlock(nn.Module):
    def __init__(self, config: AAHTransformersConfig, layer_idx: int):
        super().__init__()
        self.ln1 = make_norm(config, config.hidden_size)
        self.attn = AAHAttention(config, layer_idx)
        self.ln2 = make_norm(config, config.hidden_size)
        self.mlp = AAHSwiGLU(config) if config.mlp == "swiglu" else AAHMLP(config)

    def forward(self, x, cos, sin, mask, cache, eager: bool = False, step=None):
        y, weights = self.attn(self.ln1(x), cos, sin, mask, cache, eager, step)
        x = x + y
        return x + self.mlp(self.ln2(x)), weights


class AAHPreTrainedModel(PreTrainedModel):
    config_class = AAHTransformersConfig
    base_model_prefix = "model"
    _no_split_modules = ["AAHBlock"]
    supports_gradient_checkpointing = False
    _supports_cache_class = True  # transformers 4.5x: generate accepts a Cache object (ours, or a DynamicCache)
    # attn_implementation: "sdpa" (the default: scaled_dot_product_attention with the window mask) or "eager" (the
    # same softmax computed explicitly; also what output_attentions uses). No FlashAttention: its masks are not
    # per-head windows.
    _supports_sdpa = True


class AAHModel(AAHPreTrainedModel):
    """The decoder without the output layer: token ids -> final hidden states (after the last norm)."""

    _auto_class = "AutoModel"  # as AAHForCausalLM's

    def __init__(self, config: AAHTransformersConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(AAHBlock(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = make_norm(config, config.hidden_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    @property
    def windows(self) -> torch.Tensor:
        """The window table ``int32 [n_layer, n_head]`` (read from the config, which is what gets saved)."""
        return torch.tensor(self.config.windows, dtype=torch.int32)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        if output_attentions is None:
            output_attentions = bool(getattr(self.config, "output_attentions", False))
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = AAHWindowCache(self.config)
        if cache is not None and not isinstance(cache, (AAHWindowCache, DynamicCache)):
            # A fixed-size cache of transformers (cache_implementation "static", "sliding_window", "hybrid", ...)
            # holds no positions past its length and is masked by transformers, not by the window table.
            raise ValueError(
                f"aah models keep their keys and values in their window cache (AAHWindowCache, the default) or a "
                f"DynamicCache, not a {type(cache).__name__}: pass nothing (or past_key_values=DynamicCache()), and "
                f"leave cache_implementation unset"
            )
        if isinstance(cache, AAHWindowCache) and len(cache) != len(self.blocks):
            raise ValueError(f"this AAHWindowCache has {len(cache)} layers, the model {len(self.blocks)}")
        past = cache.get_seq_length() if cache is not None else 0

        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device).unsqueeze(0).expand(B, T)
        cos, sin = rotary_tables(position_ids, inv_frequencies(self.config, x.device), x.dtype)

        key_padding = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("attention_mask must be 2-D [batch, past + new tokens] (1 = token, 0 = padding)")
            if attention_mask.shape[1] != past + T:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[1]} tokens; the cache and the input hold {past + T}"
                )
            key_padding = attention_mask.to(device=x.device, dtype=torch.bool)
            if bool(key_padding.all()):
                key_padding = None
        positions = text_positions(key_padding, past + T, x.device)  # of every token so far, in its row's text
        sink = int(getattr(self.config, "sink", 0))
        step = None
        if isinstance(cache, AAHWindowCache):
            new = positions[:, past:]
            step = (new, bool(sink) and bool(((new >= 0) & (new < sink)).any()), {})  # {}: the layers' masks

        eager = output_attentions or getattr(self.config, "_attn_implementation", None) == "eager"
        rows = self.windows.to(x.device)
        hidden_states, attentions = [], []
        mask, built = None, None
        for layer, block in enumerate(self.blocks):
            if step is None and tuple(rows[layer].tolist()) != built:
                # One layer's mask at a time: those of every layer at once would not fit in memory for long texts.
                mask, built = window_mask(rows[layer], past, T, positions, sink), tuple(rows[layer].tolist())
            hidden_states.append(x)
            x, weights = block(x, cos, sin, mask, cache, eager, step)
            attentions.append(weights)
        x = self.ln_f(x)
        hidden_states.append(x)  # as transformers' decoders: the embeddings, every block's input, the final output
        out = BaseModelOutputWithPast(
            last_hidden_state=x,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
            **{_CACHE_FIELD: cache if use_cache else None},
        )
        return out if return_dict is not False else out.to_tuple()


class AAHForCausalLM(AAHPreTrainedModel, GenerationMixin):
    """The aah GPT with its output layer: logits over the vocabulary, from the token embedding matrix (tied) or from
    ``lm_head`` (``tie_word_embeddings: false``)."""

    # What register_for_auto_class sets: save_pretrained then copies this code into the folder it writes (transformers
    # 4.50 does not set it when loading a folder with trust_remote_code, and saved a folder that could not load).
    _auto_class = "AutoModelForCausalLM"

    def __init__(self, config: AAHTransformersConfig):
        super().__init__(config)
        self.model = AAHModel(config)
        # Tied: the logits reuse the embedding matrix (no second weight, nothing for transformers to tie).
        tied = getattr(config, "tie_word_embeddings", True)
        self.lm_head = None if tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.wte = value

    def get_output_embeddings(self) -> nn.Linear | None:
        return self.lm_head

    @property
    def windows(self) -> torch.Tensor:
        """The window table ``int32 [n_layer, n_head]``."""
        return self.model.windows

    def set_windows(self, table) -> None:
        """Replace the window table (``[n_layer, n_head]`` ints >= 1); ``save_pretrained`` then saves the new one."""
        rows = [[int(w) for w in row] for row in torch.as_tensor(table).tolist()]
        old = self.config.windows
        self.config.windows = rows
        try:
            self.config.check()
        except ValueError:
            self.config.windows = old
            raise

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``; a fixed-size ``cache_implementation`` is refused in one line before
        transformers builds it (each transformers version fails on it otherwise in its own way, or ignores it)."""
        config = kwargs.get("generation_config", args[1] if len(args) > 1 else None) or self.generation_config
        implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
        if implementation not in (None, "dynamic"):
            raise ValueError(
                f"aah models keep their keys and values in their window cache (the default) or a DynamicCache "
                f'(cache_implementation="dynamic"): cache_implementation={implementation!r} is not supported; leave '
                f"cache_implementation unset"
            )
        return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' choice of a cache for ``generate``, with the window cache in place of the ``DynamicCache`` it
        makes by default, sized for the longest text this call reaches (``max_cache_length``). A cache passed in,
        ``cache_implementation="dynamic"`` and the modes that take cached tokens back (assisted generation,
        contrastive search, DoLa) keep transformers' own."""
        given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if given is not None or not generation_config.use_cache or generation_config.cache_implementation is not None:
            return
        # After (generation_config, model_kwargs): transformers 4.57 and 5.x pass (generation_mode, batch_size,
        # max_cache_length), 4.5x (assistant_model, batch_size, max_cache_length, device).
        mode = args[0] if args else kwargs.get("generation_mode", kwargs.get("assistant_model"))
        max_len = args[2] if len(args) > 2 else kwargs.get("max_cache_length")
        if not isinstance(mode, str):
            mode = generation_config.get_generation_mode(mode)
        if mode in _WINDOW_CACHE_MODES:
            model_kwargs[_CACHE_FIELD] = AAHWindowCache(self.config, max_len)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """Logits ``[B, T, vocab]`` (only the last ``logits_to_keep`` positions when it is > 0). With ``labels``
        (``[B, T]``, -100 = ignore), also the mean next-token cross-entropy: position ``t`` predicts label ``t + 1``."""
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        x = hidden.last_hidden_state
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = F.linear(x, self.model.wte.weight) if self.lm_head is None else self.lm_head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=hidden.hidden_states,
            attentions=hidden.attentions,
            **{_CACHE_FIELD: hidden.get(_CACHE_FIELD)},
        )
        return out if return_dict is not False else out.to_tuple()


__all__ = ["AAHTransformersConfig", "AAHForCausalLM", "AAHModel", "AAHPreTrainedModel", "AAHWindowCache"]
