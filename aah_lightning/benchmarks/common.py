"""What the benchmark tools share: the paper's window mix, a static table for a model without windows
(``static_table``), the benchmark models, interleaved timing, the machine line, Markdown tables and the table of
target verdicts (tools/bench.py, tools/bench_decode.py,
tools/bench_controller.py, tools/gpu_tune.py).

Timing runs the variants interleaved, one call of each per round, so that a change in machine load hits every
variant alike and their ratios stay fair; ``use_clock("cpu")`` times CPU time instead of wall time (steadier with one
thread on a busy machine).
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.model.window_math import default_candidates
from aah_lightning.windows import metrics

PAPER_MIX = (0.63, 0.12, 0.10, 0.15)  # share of heads on T/8, T/4, T/2, T
SUMMARY: list[list] = []  # [target, measured, verdict] rows, filled by the benchmarks' sections
CLOCK = time.perf_counter


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host clock measures it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def md_table(title: str | None, header: list[str], rows: list[list]) -> str:
    """A Markdown table (under a ``### title`` heading when one is given)."""
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def use_clock(name: str) -> None:
    """``wall`` (default) or ``cpu``: process CPU time of all threads."""
    global CLOCK
    CLOCK = time.process_time if name == "cpu" else time.perf_counter


def check(target: str, value: float, limit: float, text: str, higher_is_better: bool = False) -> None:
    ok = value >= limit if higher_is_better else value <= limit
    SUMMARY.append([target, text, "met" if ok else "MISSED"])


def timeit(fns: dict, device, repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Times in ms of each ``fns[name]()`` on ``CLOCK``, interleaved (one call of each per round), so that a change in
    machine load hits every variant alike and their ratios stay fair."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = CLOCK()
            fn()
            sync(device)
            times[name].append((CLOCK() - start) * 1e3)
    return times


def fmt(times: list[float]) -> str:
    med = statistics.median(times)
    return f"{med:.1f} [{min(times):.1f}, {max(times):.1f}]" if len(times) > 1 else f"{med:.1f}"


def med(times: list[float]) -> float:
    return statistics.median(times)


def window_mix(seq_len: int, heads: int, shares=PAPER_MIX) -> torch.Tensor:
    """A window row with the given shares of T/8, T/4, T/2, T (largest-remainder rounding), in increasing order."""
    cands = default_candidates(seq_len)  # T/8, T/4, T/2, T
    exact = [s * heads for s in shares]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: heads - sum(counts)]:
        counts[i] += 1
    return torch.tensor([c for c, n in zip(cands, counts) for _ in range(n)], dtype=torch.int32)


def aah_table(n_layer: int, n_head: int, seq_len: int) -> torch.Tensor:
    """The paper's window mix over all heads of the model (its ACR is ~0.3), dealt round-robin over the layers so that
    every layer gets a mix."""
    ws = window_mix(seq_len, n_layer * n_head)
    table = torch.empty(n_layer, n_head, dtype=torch.int32)
    for i, w in enumerate(ws.tolist()):
        table[i % n_layer, i // n_layer] = w
    return table


def static_table(n_layer: int, n_head: int, n_kv_head: int, context: int, acr: float, sink: int, full_every: int):
    """A table for a model without windows of its own: one key/value head in ``full_every`` (counted over the layers
    and their key/value heads in order) sees the whole text, every other one the sink and a window ``W``, the query
    heads of a key/value head alike (so the ACR is also the share of the KV cache kept); ``W`` is the widest with
    ACR <= ``acr`` at ``context``, the sink's pairs counted. Returns ``(table, W)``."""
    group = n_head // n_kv_head
    full = torch.zeros(n_layer * n_kv_head, dtype=torch.bool)
    full[::full_every] = True
    full = full.view(n_layer, n_kv_head).repeat_interleave(group, dim=1)

    def table(w: int) -> torch.Tensor:
        return torch.where(full, context, w).to(torch.int32)

    low, high = 1, context  # the ACR grows with W: the widest W within the budget
    if float(metrics.acr(table(low), context, sink)) > acr:
        raise ValueError(f"ACR {acr}: the full heads and the sink alone cover more at T={context}")
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if float(metrics.acr(table(mid), context, sink)) <= acr else (low, mid - 1)
    return table(low), low


def train_step(model: GPT, tokens: torch.Tensor, device, dtype):
    """One optimizer step of ``model`` on ``tokens`` as a closure."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def small_model(device, seq_len: int, backend: str = "auto") -> GPT:
    if device.type == "cuda":
        cfg = GPTConfig(vocab_size=50304, seq_len=seq_len, n_layer=12, n_head=12, n_embd=768, backend=backend)
    else:
        cfg = GPTConfig(vocab_size=257, seq_len=seq_len, n_layer=4, n_head=4, n_embd=256, backend=backend)
    torch.manual_seed(0)
    return GPT(cfg).to(device)


def machine(device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"clock {'CPU time' if CLOCK is time.process_time else 'wall'}"
    )
    if device.type == "cuda":
        text += f", {torch.cuda.get_device_name(device)}"
    try:
        text += f", load average {os.getloadavg()[0]:.2f} at start"
    except OSError:
        pass
    return text


def emit(text: str) -> None:
    print(text, flush=True)
