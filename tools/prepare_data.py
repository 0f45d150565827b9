"""Tokenize a training config's corpus once into a token folder (the same as the ``aah-prepare`` command).

    python tools/prepare_data.py --config configs/quickstart.yaml --out data/stdlib_tokens
    aah fit --config configs/quickstart.yaml --data.source=tokens --data.tokens.path=data/stdlib_tokens

``--help`` lists the options; docs/data.md describes the folder and the measurements.
"""

from aah_lightning.data.prepare import main

if __name__ == "__main__":
    main()
