"""A model's files in and out of aah, side by side: ``aah export`` (``exporter.py``: a checkpoint -> a folder Hugging
Face transformers loads) and ``aah import`` (``importer.py``: a Hugging Face Llama-family folder -> an aah
checkpoint), and a small lm-evaluation-harness task built from the embedded corpus' held-out text (docs/export.md,
docs/retrofit.md). The package keeps the name of its first direction: ``python -m aah_lightning.export``, the
package data (``lm_eval_tasks/``) and the lm-eval commands in the docs name it.

``hf_code/`` holds the modeling and configuration code every export folder carries; it imports torch and
transformers only, never aah.
"""
