"""``python -m aah_lightning.hf_checkpoint``: kept because README.md and docs/retrofit.md name it; ``aah import`` lives
in ``export/importer.py``, beside ``aah export``."""

import sys

from aah_lightning.export.importer import main

if __name__ == "__main__":
    sys.exit(main())
