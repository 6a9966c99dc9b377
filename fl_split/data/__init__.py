"""Datasets, vertical partitioning, ID alignment and per-party encoding."""

from fl_split.data.base import (
    PartyData,
    PartySlice,
    VerticalDataset,
    apply_padding,
    partition,
    positions_of,
    prepare_party,
    split_ids,
)
from fl_split.data.registry import dataset_info, dataset_names, load_dataset

__all__ = [
    "PartyData", "PartySlice", "VerticalDataset", "apply_padding", "partition", "positions_of",
    "prepare_party", "split_ids", "dataset_info", "dataset_names", "load_dataset",
]
