"""``synthetic``: documents of a small Markov language with copies at one long distance (``data/synthetic.py``)."""

from __future__ import annotations

from aah_lightning.data.sources.base import TokenStreamSource, register_source
from aah_lightning.data.synthetic import synthetic_documents
from aah_lightning.data.token_folder import TokenStream
from aah_lightning.errors import require


@register_source
class SyntheticSource(TokenStreamSource):
    name = "synthetic"
    has_tokens = False

    def vocabulary(self, tokenizer) -> tuple[int, int]:
        vocab = self.settings.synthetic_vocab
        return vocab + 1, vocab  # the symbols, and the end-of-document id after them

    def stream(self, tokenizer):
        hp = self.settings
        distance = hp.synthetic_distance or hp.seq_len // 2
        require(0 < distance < hp.seq_len, "data.synthetic_distance", distance, f"in [1, seq_len={hp.seq_len})")
        docs = synthetic_documents(hp.synthetic_documents, hp.seq_len, distance, hp.synthetic_vocab, seed=hp.seed)
        return TokenStream.from_documents(docs, hp.synthetic_vocab)
