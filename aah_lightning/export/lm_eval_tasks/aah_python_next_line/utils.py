"""Loads the task's data from data.jsonl next to this file, wherever lm-evaluation-harness is run from."""

import os

import datasets

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data.jsonl")


def load_data(**kwargs) -> dict:
    """The test split (lm-evaluation-harness passes the task's metadata as keyword arguments; none are needed)."""
    return {"test": datasets.load_dataset("json", data_files={"test": DATA}, split="test")}
