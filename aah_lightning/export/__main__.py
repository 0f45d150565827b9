import sys

from aah_lightning.export.exporter import main

sys.exit(main())
