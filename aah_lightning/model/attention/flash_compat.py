"""What flex's FLASH backend (FlashAttention-4 behind ``flex_attention``) needs from the installed torch.

A ``kernel_options={"BACKEND": "FLASH"}`` call is compiled by translating the mask_mod into CuTeDSL: inductor lowers
the mask to pointwise ops, and torch's CuTeDSL code generation (``CuteDSLOpOverrides`` for the arithmetic, the
``ModificationWrapperCuteDSL`` handler for loads and indexing, in ``torch/_inductor/codegen/cutedsl/``) writes each op
as CuTeDSL. That translation grew release by release: torch 2.11 has no ``index_expr`` and leaves ``minimum`` and
``maximum`` as ``NotImplementedError`` stubs, so a mask that needs them stops deep inside a compile with "UNSUPPORTED
CUTEDSL OPERATION"; projects whose masks use them patch those ops into torch 2.11.

aah's masks do not need them. ``MASK_OPS`` lists the ops that the window mask and the document mask (with and without
an attention sink) lower to
(recorded from inductor's own lowering; tests/model/test_flash_compat.py keeps the list true), and torch 2.11's CuTeDSL
code generation already writes every one of them. So this module patches nothing on any torch version. What it adds
is the check: before a run compiles, ``flash_gap`` reads the installed torch's CuTeDSL code generation (its source,
without importing it: the modules import CUTLASS's DSL in some versions) and names any op of ``MASK_OPS`` it lacks;
``flex_fa4`` then falls back to ``flex_tuned`` with that reason instead of failing mid-compile.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

import torch

# The inductor ops aah's masks lower to (model/masks.py): the window mask ``kv <= q and q - kv < W[h]`` and the
# document mask (the same and ``doc[b, q] == doc[b, kv]``). ``load`` and ``indirect_indexing`` (reading W[h] and
# doc[b, i]) are the CuTeDSL handler's own; the rest are CuteDSLOpOverrides methods.
MASK_OPS: tuple[str, ...] = (
    "bitwise_and",
    "bitwise_or",  # the attention sink: within the window or among the first positions
    "eq",
    "indirect_indexing",
    "le",
    "load",
    "lt",
    "sub",
    "to_dtype",
)
HANDLER_OPS = frozenset({"load", "indirect_indexing"})
OVERRIDES_MODULE = "torch._inductor.codegen.cutedsl.cutedsl_op_overrides"
HANDLER_MODULE = "torch._inductor.codegen.cutedsl.cutedsl_kernel"
FLASH_MODULE = "torch._inductor.kernel.flex.flex_flash_attention"


def _methods(source: str, class_name: str) -> dict[str, ast.FunctionDef] | None:
    """The methods a class defines in ``source`` (None: no such class)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
    return None


def _is_stub(function: ast.FunctionDef) -> bool:
    """Whether a method's whole body (past its docstring) raises NotImplementedError."""
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def translation_gaps(ops, overrides_source: str, handler_source: str) -> list[str] | None:
    """The ops of ``ops`` that this CuTeDSL code generation cannot write, each with why (empty: all of them). None when
    the sources do not hold the two classes this check reads: a layout it does not know, so it claims no gap."""
    overrides = _methods(overrides_source, "CuteDSLOpOverrides")
    handler = _methods(handler_source, "ModificationWrapperCuteDSL")
    if overrides is None or handler is None:
        return None
    gaps = []
    for op in sorted(set(ops)):
        methods = handler if op in HANDLER_OPS else overrides
        if op not in methods:
            gaps.append(f"{op} (not implemented)")
        elif _is_stub(methods[op]):
            gaps.append(f"{op} (a NotImplementedError stub)")
    return gaps


def _source(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    return Path(spec.origin).read_text() if spec is not None and spec.origin else None


@functools.lru_cache(maxsize=1)
def flash_gap() -> str | None:
    """Why this torch cannot compile aah's masks for the FLASH backend (None: it can, as far as the code shows)."""
    try:
        sources = [_source(m) for m in (FLASH_MODULE, OVERRIDES_MODULE, HANDLER_MODULE)]
    except (ImportError, OSError) as err:  # a torch built without inductor's sources
        return f"torch {torch.__version__}: inductor's FLASH sources do not read ({err})"
    if sources[0] is None:
        return f"torch {torch.__version__} has no FLASH backend for flex_attention"
    if None in sources:
        return f"torch {torch.__version__} has no CuTeDSL code generation"
    # Only a gap the sources show blocks FLASH; code generation laid out otherwise (a later torch) is left to compile.
    gaps = translation_gaps(MASK_OPS, sources[1], sources[2])
    if gaps:
        return f"torch {torch.__version__}'s CuTeDSL code generation lacks ops aah's masks need: {', '.join(gaps)}"
    return None
