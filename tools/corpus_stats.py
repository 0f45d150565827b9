"""Print a data config's corpus size and unigram entropy (the loss of a model that knows only token frequencies).

    python tools/corpus_stats.py --config configs/quickstart.yaml

The unigram entropy is measured on the validation blocks with frequencies from the training blocks (cross-entropy,
nats/token, add-one smoothing), i.e. the validation loss of the best context-free model.
"""

import argparse
import math

import torch
import yaml

from aah_lightning.lit.datamodule import TextDataModule


def unigram_cross_entropy(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train.flatten(), minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[val.flatten()].mean())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    args = p.parse_args()
    with open(args.config) as f:
        data_cfg = yaml.safe_load(f).get("data", {})
    dm = TextDataModule(**data_cfg)
    dm.setup("fit")
    train, val = (torch.from_numpy(s.as_array()[:, 1:].astype("int64")) for s in (dm.train_set, dm.val_set))
    h = unigram_cross_entropy(train, val, dm.vocab_size)  # on the predicted positions
    print(f"train blocks {len(dm.train_set)}, val blocks {len(dm.val_set)}, tokens {(train.numel() + val.numel())}")
    print(f"unigram entropy (val, nats/token): {h:.4f}  ({h / math.log(2):.3f} bits)")


if __name__ == "__main__":
    main()
