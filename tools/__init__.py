"""Command-line tools, run as ``python tools/<name>.py`` with the package installed; tests import them as
``tools.<name>`` from the repository root. Helpers they share live in ``aah_lightning.reporting``."""
