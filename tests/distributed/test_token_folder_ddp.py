"""Exact resume from a token folder under DDP: two processes (gloo) train from a memory-mapped folder, are preempted,
resume with ``--ckpt_path last`` and match an uninterrupted run batch for batch and loss for loss."""

from __future__ import annotations

import pytest

from helpers.distributed import DDP, check_ranks, fit, preempted_then_resumed
from helpers.resume import assert_same_training, read_run
from helpers.token_folders import TEXTS, small_folder

pytestmark = pytest.mark.heavy


def test_ddp_resume_from_a_token_folder_is_exact(tmp_path):
    folder = small_folder(tmp_path, texts=TEXTS * 6)
    data = ["--data.source=tokens", f"--data.tokens.path={folder}", "--data.seq_len=32", "--data.tokenizer=byte"]
    (tmp_path / "whole").mkdir()
    fit(tmp_path / "whole", DDP, *data)
    whole = [read_run(tmp_path / "whole" / "rec", r) for r in (0, 1)]
    check_ranks(whole)  # each rank its own blocks, one window table
    (tmp_path / "parts").mkdir()
    preempted_then_resumed(tmp_path / "parts", DDP, *data)
    for rank in (0, 1):
        assert_same_training(whole[rank], read_run(tmp_path / "parts" / "rec", rank))
