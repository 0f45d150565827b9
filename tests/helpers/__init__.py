"""Plain helpers the tests share (pytest fixtures live in tests/conftest.py). Imported as ``helpers.<module>``:
pyproject's pytest ``pythonpath`` holds tests/, and the multi-process tests put tests/ on their subprocesses'
PYTHONPATH, so a run started by a test can load a callback from here by its class path (``helpers.resume.Recorder``).
"""
