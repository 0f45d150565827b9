"""Prompts for ``aah predict``: a text file (one prompt per line) or JSON Lines (a ``prompt`` field per line).

Every prompt becomes ``[end-of-document] + its tokens``: in training every document follows the previous one's
end-of-document token, so this is how the model saw documents begin (and an empty prompt asks for a new document).
A prompt longer than ``seq_len`` tokens (with that separator) keeps its last ``seq_len`` tokens: a full-window head
never looks further back, and the model was never trained on longer contexts. A warning names every such prompt,
and the output records how many tokens were dropped.
"""

from __future__ import annotations

import json

from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from aah_lightning.errors import ConfigError
from aah_lightning.inputs import utf8_lines

JSON_SUFFIXES = (".jsonl", ".json")


def read_prompts(path, setting: str = "data.prompts") -> list[str]:
    """The prompts of ``path``: every non-blank line of a text file, or the ``prompt`` field of every non-blank line
    of a ``.jsonl`` / ``.json`` file. The file must be UTF-8: a missing, unreadable or undecodable file, or a folder,
    is one ``ConfigError`` line (the line number where it is not UTF-8)."""
    if not path:
        raise ConfigError(
            f"{setting} is not set: aah predict needs a prompts file (one prompt per line, or JSONL with "
            f"a 'prompt' field)"
        )
    what = "a prompts file (a prompt per line, or JSONL), encoded as UTF-8"
    lines = [(n, line.rstrip("\r\n")) for n, line in utf8_lines(path, setting, what) if line.strip()]
    prompts = []
    if str(path).endswith(JSON_SUFFIXES):
        for n, line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{setting}={str(path)!r} line {n} is not JSON ({e.msg})") from e
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ConfigError(f"{setting}={str(path)!r} line {n} has no string field 'prompt'")
            prompts.append(row["prompt"])
    else:
        prompts = [line for _, line in lines]
    if not prompts:
        raise ConfigError(f"{setting}={str(path)!r} holds no prompts (it is empty or blank)")
    return prompts


def encode_prompt(text: str, tokenizer, max_tokens: int) -> tuple[list[int], int]:
    """``[eos] + tokens`` of ``text``, cut from the left to ``max_tokens``; returns (ids, tokens dropped)."""
    ids = [tokenizer.eos_id] + [int(t) for t in tokenizer.encode(text)]
    dropped = max(0, len(ids) - max_tokens)
    return ids[dropped:], dropped


def shard(n: int, rank: int, world: int) -> list[int]:
    """The prompt numbers rank ``rank`` of ``world`` generates for: every world-th, so the ranks split the prompts
    into disjoint sets that together cover all of them."""
    return list(range(rank, n, world))


class PromptSet(Dataset):
    """One rank's prompts. Item: its number in the file, the text, its token ids and the tokens dropped."""

    def __init__(self, texts: list[str], tokenizer, max_tokens: int, rank: int = 0, world: int = 1):
        self.items = []
        for i in shard(len(texts), rank, world):
            ids, dropped = encode_prompt(texts[i], tokenizer, max_tokens)
            if dropped:
                rank_zero_warn(
                    f"prompt {i} has {len(ids) + dropped - 1} tokens, more than data.seq_len={max_tokens} with the "
                    f"leading end-of-document token: its first {dropped} tokens are dropped"
                )
            self.items.append({"index": i, "text": texts[i], "tokens": ids, "dropped": dropped})
        self.eod_id = tokenizer.eos_id

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def collate(self, items: list[dict]) -> dict:
        """Lists, not tensors: prompts differ in length (model/generate.py pads them)."""
        batch = {key: [item[key] for item in items] for key in items[0]}
        batch["eod_id"] = self.eod_id
        return batch


def require_text_tokenizer(tokenizer) -> None:
    """Prompts are text: a run of token ids (``data.source`` synthetic or recall) has no tokenizer to read them."""
    if tokenizer is None:
        raise ConfigError(
            "aah predict needs a text tokenizer, and data.source='synthetic' has none: use the config "
            "of a model trained on text"
        )


def prompt_loader(path, tokenizer, seq_len: int, batch_size: int, rank: int = 0, world: int = 1) -> DataLoader:
    """Batches of this rank's prompts, in file order."""
    require_text_tokenizer(tokenizer)
    prompts = PromptSet(read_prompts(path), tokenizer, seq_len, rank, world)
    return DataLoader(prompts, batch_size=batch_size, shuffle=False, collate_fn=prompts.collate)
