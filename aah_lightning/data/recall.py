"""Multi-query associative recall: a task whose answers lie at controlled distances across the whole context.

A sequence is made of 3-token slots ``k v k``: a key, its value, and the key again (the echo). Keys and values come
from disjoint ranges of the vocabulary; within a sequence every key names one value. The first slot of a key binds
it; afterwards the key comes back after a gap of ``g`` slots (drawn from ``gaps``), again and again. Every return is
a query: at the returning key the model must predict its value, which only the key's previous slot tells. Slot by
slot, left to right, a slot holds the returning key that is due earliest, or else a new key (when new keys run out,
the earliest returning key comes early).

Two kinds of targets carry a signal, and training counts only them (``loss_mask``):

* the **answer** after a returning key (a recall), at distance ``d = i - j`` from the key's last value token ``j``;
* the **echo** after a value: a copy of the token before it, which a previous-token head predicts. That head also
  writes the value into the echo's position, so a recall needs one head that reaches from the query back to the echo
  (``d - 1`` tokens back, inside a window ``W >= d``) and matches the key there. Without the echo nothing rewards the
  previous-token head until the whole circuit exists, and small models never learn the task.

New keys and the values of first bindings are random, so they are left out of the loss. ``recall_distance`` is
``d`` at every answer and 0 elsewhere: the smallest causal window that reaches the answer.

Gap distributions (in slots, over ``[1, S)`` with S the slots of a sequence): ``uniform``; ``loguniform``
(``floor(exp(U(0, ln S)))``, many short gaps); ``mix`` (each gap one or the other, with probability 1/2: short
answers to learn from and long ones across the whole context). Sequences are deterministic: sequence ``i`` of split
``s`` is drawn from a generator seeded by ``(seed, s, i)``, so no sequence is stored and any of them can be read in any
order (and resumed runs see the same ones).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
from torch.utils.data import Dataset

SLOT = 3  # k v k
GAPS = ("mix", "uniform", "loguniform")
# multi-query associative recall; a copy at one distance (``copy_sequence``); recall whose value must be carried
# through the depth of the model to its key before it can be read (``relay_sequence``)
TASKS = ("mqar", "copy", "relay")
CLASSES = 4  # relay: the token after a bound key names its value's class (value mod CLASSES)
SPLITS = {"train": 0, "val": 1, "test": 2}


def _gap(rng: np.random.Generator, n_slots: int, kind: str) -> int:
    if kind == "mix":
        kind = "loguniform" if rng.random() < 0.5 else "uniform"
    if kind == "uniform":
        return int(rng.integers(1, n_slots))
    return int(np.clip(np.floor(np.exp(rng.uniform(0.0, np.log(n_slots)))), 1, n_slots - 1))


def recall_sequence(rng: np.random.Generator, length: int, n_keys: int, n_values: int, gaps: str = "mix"):
    """One sequence of ``length`` tokens: ``(tokens, loss_mask, distance)``.

    ``tokens`` int64 ``[length]`` (keys ``[0, n_keys)``, values ``[n_keys, n_keys + n_values)``); ``loss_mask`` bool and
    ``distance`` int64 ``[length - 1]``, aligned with the targets: entry ``i`` describes the prediction of token
    ``i + 1`` from position ``i``.
    """
    n_slots = -(-length // SLOT)
    fresh = list(rng.permutation(n_keys))
    values = rng.integers(n_keys, n_keys + n_values, size=n_keys)
    due: list[tuple[int, int, int]] = []  # (due slot, order of scheduling, key): ties go to the earlier schedule
    last_value: dict[int, int] = {}  # key -> position of its latest value token
    tokens = np.empty(n_slots * SLOT, dtype=np.int64)
    answer = np.zeros(n_slots * SLOT, dtype=np.int64)  # distance at the query position, 0 = no answer
    echo = np.zeros(n_slots * SLOT, dtype=bool)
    order = 0
    for slot in range(n_slots):
        if due and (due[0][0] <= slot or not fresh):
            key = heapq.heappop(due)[2]
        else:
            key = int(fresh.pop())
        at = slot * SLOT
        tokens[at : at + SLOT] = (key, values[key], key)
        if key in last_value:
            answer[at] = at - last_value[key]
        last_value[key] = at + 1
        echo[at + 1] = True  # the value's position predicts the echo
        heapq.heappush(due, (slot + _gap(rng, n_slots, gaps), order, key))
        order += 1
    tokens, answer, echo = tokens[:length], answer[: length - 1], echo[: length - 1]
    return tokens, (answer > 0) | echo, answer


def copy_sequence(rng: np.random.Generator, length: int, vocab: int, distance: int):
    """The second long-range task: ``(tokens, loss_mask, distance)`` as ``recall_sequence`` returns them.

    The first ``distance`` tokens are uniform over ``[0, vocab)``; every later token repeats the token exactly
    ``distance`` back. Only the copies count, and each is an answer at ``distance``. Unlike associative recall this
    needs no circuit across layers: one head of any layer that reaches ``distance`` back by position solves it (the
    oracle puts it in layer 0), and nothing nearer helps (recall's answers lie at every distance, these at one)."""
    tokens = rng.integers(0, vocab, size=length)
    for t in range(distance, length):
        tokens[t] = tokens[t - distance]
    targets = np.arange(1, length)
    mask = targets >= distance
    return tokens.astype(np.int64), mask, np.where(mask, distance, 0).astype(np.int64)


def relay_ids(n_keys: int, n_values: int) -> int:
    """Token ids of the relay task: keys, values, the filler, and the ``CLASSES`` class tokens."""
    return n_keys + n_values + 1 + CLASSES


def relay_sequence(rng: np.random.Generator, length: int, n_keys: int, n_values: int, gap: int = 2, gaps: str = "mix"):
    """The deep task: ``(tokens, loss_mask, distance)`` as ``recall_sequence`` returns them.

    A binding is ``v f .. f k c``: a value, ``gap - 1`` fillers (one token), its key ``gap`` tokens after the value,
    and the value's class (``CLASSES`` of them). A bound key comes back once, as a query ``k v``, a delay drawn from
    ``gaps`` (in tokens, as recall's gaps are drawn in slots) after its binding. Left to right: the query that is due
    earliest, or else a new binding (when keys run out, the earliest query comes early). Counted targets: the class
    after each bound key (the key's position must know its value, ``gap`` tokens back) and the answer after each
    query, at distance ``d`` from the query back to the bound key.

    What makes it deep: a query finds its key by the key's own token, and can read the value there only once the value
    has been carried forward into the key's position. A head of window 2 (itself and the token before) moves a token
    one position per layer, so with such short heads the value reaches its key after ``gap`` layers, and only a long
    head in a layer at depth ``>= gap`` can answer (answers lie up to the whole context back). A long head spent on
    the carrying leaves none to answer with, and the class token next to the key tells a quarter of the value at
    most. The class target rewards each step of the carrying before an answer exists (as the echo does for recall),
    and the short delays give answers to learn from early (as recall's do). Keys ``[0, n_keys)``, values
    ``[n_keys, n_keys + n_values)``, then the filler, then the ``CLASSES`` classes; a tail too short for a binding is
    fillers.
    """
    filler, class0 = n_keys + n_values, n_keys + n_values + 1
    tokens = np.full(length, filler, dtype=np.int64)
    answer = np.zeros(length, dtype=np.int64)
    target = np.zeros(length, dtype=bool)
    fresh = list(rng.permutation(n_keys))
    due: list[tuple[int, int, int, int]] = []  # (due position, order, key, value): ties go to the earlier binding
    bound_at: dict[int, int] = {}
    at = order = 0
    while at < length:
        if due and (due[0][0] <= at or not fresh):
            _, _, key, value = heapq.heappop(due)
            tokens[at : at + 2] = (key, value)[: length - at]
            answer[at] = at - bound_at[key]
            at += 2
        elif fresh and at + gap + 2 <= length:
            key, value = int(fresh.pop()), int(rng.integers(n_keys, n_keys + n_values))
            k = at + gap
            tokens[at], tokens[k], tokens[k + 1] = value, key, class0 + (value - n_keys) % CLASSES
            target[k] = True  # the key's position predicts its value's class
            bound_at[key] = k
            heapq.heappush(due, (k + 2 + _gap(rng, length, gaps), order, key, value))
            order += 1
            at += gap + 2
        else:
            break
    answer, target = answer[: length - 1], target[: length - 1]
    return tokens, (answer > 0) | target, answer


def relay_circuit_possible(table: list[list[int]], gap: int, reach: int) -> bool:
    """Whether a window table leaves room for the relay task's circuit: a head of window ``>= reach`` (the farthest
    answer) in a layer ``l`` whose layers below can carry a value ``gap`` tokens forward. A head of window ``W`` moves a
    token up to ``W - 1`` positions, and one head per layer composes, so the layers below ``l`` carry at most the sum
    of their widest windows minus one each. A necessary condition: what training finds is another matter."""
    carried = 0
    for row in table:
        if max(row) >= reach and carried >= gap:
            return True
        carried += max(row) - 1
    return False


def _placements(windows: list[int]):
    """Every distinct ordering of a multiset of windows, once each."""
    if not windows:
        yield []
        return
    for w in sorted(set(windows)):
        rest = list(windows)
        rest.remove(w)
        for tail in _placements(rest):
            yield [w, *tail]


def placement_chance(table: list[list[int]], possible) -> tuple[float, int]:
    """The chance that ``table``'s windows, placed on heads drawn at random over the whole model (every distinct
    placement equally likely, as a uniform permutation of the heads gives), make ``possible(rows)`` true; counted
    exactly over every distinct placement. Returns (chance, placements)."""
    n_head = len(table[0])
    windows = [w for row in table for w in row]
    hits = total = 0
    for flat in _placements(windows):
        hits += bool(possible([flat[i : i + n_head] for i in range(0, len(flat), n_head)]))
        total += 1
    return hits / total, total


class RelayCircuit:
    """``relay_circuit_possible`` as one callable for reports (``experiments/protocol.py``): ``circuit(table)``."""

    def __init__(self, gap: int, reach: int):
        self.gap, self.reach = gap, reach
        self.name = f"the relay circuit (a head of window >= {reach} above layers that carry a value {gap} tokens)"

    def __call__(self, table: list[list[int]]) -> bool:
        return relay_circuit_possible(table, self.gap, self.reach)


def relay_placement_chance(table: list[list[int]], gap: int, reach: int) -> tuple[float, int]:
    """``placement_chance`` of the relay circuit (``relay_circuit_possible``)."""
    return placement_chance(table, RelayCircuit(gap, reach))


class RecallBlocks(Dataset):
    """``count`` recall sequences of ``seq_len + 1`` tokens (one training block each) of one split.

    Item: ``tokens`` and ``doc_ids`` ``[seq_len + 1]`` (int64; one document per block), ``loss_mask`` and
    ``recall_distance`` ``[seq_len]`` (aligned with the targets), and its ``index``. Token ids are shifted by
    ``offset`` (a recall task mixed into a text corpus lives above the tokenizer's ids).
    """

    def __init__(
        self,
        seq_len: int,
        count: int,
        n_keys: int,
        n_values: int,
        gaps: str = "mix",
        seed: int = 0,
        split: str = "train",
        offset: int = 0,
        task: str = "mqar",
        copy_distance: int | None = None,
        relay_gap: int = 2,
    ):
        self.seq_len, self.count, self.n_keys, self.n_values = seq_len, count, n_keys, n_values
        self.gaps, self.seed, self.split, self.offset = gaps, seed, SPLITS[split], offset
        self.task, self.copy_distance, self.relay_gap = task, copy_distance, relay_gap

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.count:
            raise IndexError(i)
        rng = np.random.default_rng([self.seed, self.split, i])
        if self.task == "copy":
            tokens, mask, distance = copy_sequence(
                rng, self.seq_len + 1, self.n_keys + self.n_values, self.copy_distance
            )
        elif self.task == "relay":
            tokens, mask, distance = relay_sequence(
                rng, self.seq_len + 1, self.n_keys, self.n_values, self.relay_gap, self.gaps
            )
        else:
            tokens, mask, distance = recall_sequence(rng, self.seq_len + 1, self.n_keys, self.n_values, self.gaps)
        return {
            "tokens": torch.from_numpy(tokens + self.offset),
            "doc_ids": torch.zeros(self.seq_len + 1, dtype=torch.int64),
            "loss_mask": torch.from_numpy(mask),
            "recall_distance": torch.from_numpy(distance),
            "index": i,
        }
