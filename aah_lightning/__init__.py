"""aah: Asymmetric Attention Heads for GPT training on PyTorch Lightning."""

__version__ = "0.1.0"
