"""model/attention/flash_compat.py: the ops aah's masks lower to, and the check of a torch's CuTeDSL code generation."""

import pytest
import torch
from torch._inductor.kernel.flex import flex_cpu
from torch._inductor.utils import sympy_index_symbol
from torch._inductor.virtualized import V
from torch.nn.attention.flex_attention import flex_attention

from aah_lightning.model import masks
from aah_lightning.model.attention import flash_compat


class RecordingHandler:
    """An ops handler that records each op's name, set directly as inductor's handler the way torch's CuTeDSL code
    generation sets its own (so indexing arrives as ``indirect_indexing`` and a symbol, with no bounds code)."""

    def __init__(self, names: list):
        self.names = names

    def indirect_indexing(self, var, size, check=True, wrap_neg=True):
        self.names.append("indirect_indexing")
        return sympy_index_symbol(str(var))

    def __getattr__(self, name):
        def op(*args, **kwargs):
            self.names.append(name)
            return f"v{len(self.names)}"

        return op


class AllRecorded(Exception):
    pass


def recorded_mask_ops(monkeypatch, block_masks, heads: int, seq_len: int) -> list[set[str]]:
    """The ops inductor's lowering of each BlockMask's mask_mod calls, from one fresh CPU compile of flex_attention
    called once per mask.

    The CPU lowering wraps a mask in ``where(mask, score, -inf)``: that adds a load of the score, a constant and a
    where, which the CUDA lowering does not."""
    recorded: list[list[str]] = []
    build = flex_cpu.build_subgraph_module_buffer

    def spy(args, graph_module):
        result = build(args, graph_module)
        recorded.append(names := [])
        for buffer in result if isinstance(result, (list, tuple)) else [result]:
            if buffer is not None:
                index = [sympy_index_symbol(f"i{k}") for k in range(len(buffer.data.ranges))]
                with V.set_ops_handler(RecordingHandler(names)):
                    buffer.data.inner_fn(index)
        if len(recorded) == len(block_masks):
            raise AllRecorded  # stop before code generation and the C++ compile: nothing past lowering is needed
        return result

    def attend(q, *block_masks):
        return [flex_attention(q, q, q, block_mask=m) for m in block_masks]

    monkeypatch.setattr(flex_cpu, "build_subgraph_module_buffer", spy)
    q = torch.randn(1, heads, seq_len, 16)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True), pytest.raises(Exception) as stopped:
        torch.compile(attend, dynamic=False)(q, *block_masks)
    cause = stopped.value
    while cause is not None and not isinstance(cause, AllRecorded):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None, f"the compile failed before the masks were lowered: {stopped.value}"
    assert len(recorded) == len(block_masks), "the spy did not see each mask's lowering once"
    return [set(names) - {"constant", "where"} for names in recorded]


@pytest.mark.heavy  # a cold CPU compile up to lowering, inductor's caches off (~15 s)
def test_mask_ops_lists_what_the_window_and_document_masks_lower_to(monkeypatch):
    T, H = 256, 4
    row = torch.tensor([17, 64, 129, T], dtype=torch.int32)
    docs = torch.tensor([[0] * 100 + [1] * 156])
    built = [masks.window_block_mask(row, T, 128), masks.document_block_mask(row, docs, 128)]
    built += [masks.window_block_mask(row, T, 128, sink=4), masks.document_block_mask(row, docs, 128, sink=4)]
    window, document, window_sink, document_sink = recorded_mask_ops(monkeypatch, built, H, T)
    assert {"le", "sub", "lt", "indirect_indexing"} <= window  # the window: kv <= q and q - kv < W[h]
    assert "eq" in document - window  # the document: doc[b, q] == doc[b, kv]
    assert "bitwise_or" in window_sink - window  # the sink: q - kv < W[h] or kv < sink
    assert window | document | window_sink | document_sink == set(flash_compat.MASK_OPS)


OVERRIDES = '''
class CuteDSLOpOverrides(OpOverrides):
    @staticmethod
    def le(a, b):
        return f"({a} <= {b})"
    @staticmethod
    def minimum(a, b):
        """Not yet."""
        raise NotImplementedError("TODO: minimum")
    @staticmethod
    def lt(a, b):
        if a is None:
            raise NotImplementedError
        return f"({a} < {b})"
'''
HANDLER = """
class ModificationWrapperCuteDSL(V.WrapperHandler):
    def load(self, name, index):
        return name
    def indirect_indexing(self, var, size, check, wrap_neg=True):
        return var
"""


def test_translation_gaps_names_missing_ops_and_stubs_only():
    assert flash_compat.translation_gaps(["le", "lt", "load", "indirect_indexing"], OVERRIDES, HANDLER) == []
    assert flash_compat.translation_gaps(["minimum", "index_expr", "le"], OVERRIDES, HANDLER) == [
        "index_expr (not implemented)",
        "minimum (a NotImplementedError stub)",
    ]
    handler_without_indexing = HANDLER.split("    def indirect_indexing")[0]
    assert flash_compat.translation_gaps(["indirect_indexing"], OVERRIDES, handler_without_indexing) == [
        "indirect_indexing (not implemented)"
    ]
    assert flash_compat.translation_gaps(["le"], "x = 1", HANDLER) is None  # a layout the check cannot read


def test_the_installed_torch_translates_every_mask_op():
    # torch 2.13 (and 2.11, checked by hand against its wheel) write every op of MASK_OPS: nothing to patch.
    assert flash_compat.flash_gap() is None


def test_flex_fa4_falls_back_with_the_torch_gap_as_its_reason(monkeypatch):
    from aah_lightning.model.attention import flex, get_backend, registry, resolve_backend

    gap = "torch 2.0's CuTeDSL code generation lacks ops aah's masks need: lt (not implemented)"
    monkeypatch.setattr(flex, "fa4_missing", lambda device: None)  # a Hopper GPU with flash-attn-4 (faked)
    monkeypatch.setattr(flash_compat, "flash_gap", lambda: gap)
    cuda = torch.device("cuda")
    assert get_backend("flex_fa4").available(cuda, needs_grad=True).reason == gap
    registry._logged.clear()
    assert resolve_backend("flex_fa4", cuda, needs_grad=True, seq_len=4096) == "flex_tuned"
    monkeypatch.setattr(flash_compat, "flash_gap", lambda: None)
    assert resolve_backend("flex_fa4", cuda, needs_grad=True, seq_len=4096) == "flex_fa4"
