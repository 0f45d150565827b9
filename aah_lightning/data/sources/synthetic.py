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
        vocab = self.settings.synthetic.vocab
        return vocab + 1, vocab  # the symbols, and the end-of-document id after them

    def stream(self, tokenizer):
        hp, syn = self.settings, self.settings.synthetic
        distance = syn.distance or hp.seq_len // 2
        require(0 < distance < hp.seq_len, "data.synthetic.distance", distance, f"in [1, seq_len={hp.seq_len})")
        docs = synthetic_documents(syn.documents, hp.seq_len, distance, syn.vocab, seed=hp.seed)
        return TokenStream.from_documents(docs, syn.vocab)
