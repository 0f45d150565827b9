"""Read TensorBoard event files back with TensorBoard's own reader."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from aah_lightning.experiments.records import event_files


def read_events(log_root):
    """All tags of all event files under ``log_root``: {'scalars': {tag: [(step, value)]}, 'histograms': {...}}."""
    out = {"scalars": {}, "histograms": {}, "images": {}, "text": {}}
    for path in event_files(str(log_root)):
        acc = EventAccumulator(path, size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        for tag in tags.get("scalars", []):
            out["scalars"].setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        for tag in tags.get("histograms", []):
            out["histograms"].setdefault(tag, []).extend(acc.Histograms(tag))
        for tag in tags.get("images", []):
            out["images"].setdefault(tag, []).extend(acc.Images(tag))
        for tag in tags.get("tensors", []):
            out["text"].setdefault(tag, []).extend(acc.Tensors(tag))
    return out
