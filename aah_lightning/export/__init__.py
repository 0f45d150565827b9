"""Use a trained model outside aah: export to Hugging Face transformers (``aah export``), and a small
lm-evaluation-harness task built from the embedded corpus' held-out text (docs/export.md).

``hf_code/`` holds the modeling and configuration code every export folder carries; it imports torch and
transformers only, never aah.
"""
