"""hybridl.data: datasets, the DataLoader (background prefetch, sharding), transforms, and the
vision datasets (Digits, MNIST, Fashion-MNIST).

Importing this package does not import ``hybridl.ndarray``; the loader imports it lazily when
it builds the first batch.
"""

from . import transforms, vision
from .dataloader import DataLoader, default_batchify_fn
from .dataset import ArrayDataset, Dataset, SimpleDataset
from .transforms import Compose, Normalize, ToFloat
from .vision import MNIST, DatasetError, Digits, DownloadError, FashionMNIST

__all__ = ["Dataset", "SimpleDataset", "ArrayDataset", "DataLoader", "default_batchify_fn",
           "transforms", "vision", "ToFloat", "Normalize", "Compose",
           "Digits", "MNIST", "FashionMNIST", "DatasetError", "DownloadError"]
