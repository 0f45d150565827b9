"""A synthetic language with known short- and long-range structure, for tests and demos.

Each document has ``length`` tokens over ``vocab`` symbols. Its first ``distance`` tokens follow a sparse random
first-order Markov chain (each symbol has a few likely successors): predicting them needs only the previous token.
Every later token repeats the token exactly ``distance`` positions earlier: predicting those needs a head that
reaches back ``distance`` tokens. A model that solves the task therefore needs a few long-window heads and can give
every other head a short window - the allocation AAH is meant to find.
"""

from __future__ import annotations

import numpy as np


def markov_chain(vocab: int, successors: int, rng: np.random.Generator) -> np.ndarray:
    """Row-stochastic ``[vocab, vocab]`` matrix with ``successors`` non-zero entries per row."""
    probs = np.zeros((vocab, vocab))
    for s in range(vocab):
        nxt = rng.choice(vocab, size=successors, replace=False)
        probs[s, nxt] = rng.dirichlet(np.ones(successors))
    return probs


def synthetic_documents(
    n_docs: int, length: int, distance: int, vocab: int = 64, successors: int = 3, seed: int = 0
) -> list[np.ndarray]:
    """``n_docs`` documents of ``length`` tokens: Markov prefix of ``distance`` tokens, then copies at ``distance``."""
    if not 0 < distance < length:
        raise ValueError(f"distance={distance} must be in [1, length={length})")
    rng = np.random.default_rng(seed)
    probs = markov_chain(vocab, successors, rng)
    cdf = probs.cumsum(1)
    docs = []
    for _ in range(n_docs):
        doc = np.empty(length, dtype=np.int32)
        doc[0] = rng.integers(vocab)
        u = rng.random(distance)
        for t in range(1, distance):
            doc[t] = min(int(np.searchsorted(cdf[doc[t - 1]], u[t])), vocab - 1)
        for t in range(distance, length):
            doc[t] = doc[t - distance]
        docs.append(doc)
    return docs
