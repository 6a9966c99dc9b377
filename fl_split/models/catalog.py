"""The architectures fl_split knows, as plain data: importing this module imports nothing heavy.

``fl-split --help``, ``fl-split models`` and the validation of ``--model`` read this catalog; the
modules that build an architecture (with PyTorch) are imported only when a model is built. A test
checks every entry against the registered architecture (inputs, layers, default cut, description).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    name: str
    #: "vector" or "image"
    inputs: str
    #: cuttable layers of the default configuration
    num_layers: int
    default_cut: int
    description: str
    #: the module whose import registers the architecture
    module: str


CATALOG: tuple[ModelEntry, ...] = (
    ModelEntry("mlp", "vector", 3, 1, "generic MLP: Linear+ReLU layers (--hidden, --norm), default hidden 64,32, cut "
                                      "after layer 1", "fl_split.models.mlp"),
    ModelEntry("movielens-mlp", "vector", 4, 1, "001 Table 10 MovieLens: Linear(d,128)+ReLU | 128-64-items",
               "fl_split.models.mlp"),
    ModelEntry("bookcrossing-mlp", "vector", 4, 1, "001 Table 10 BookCrossing: Linear(d,128)+ReLU | 256-128-items",
               "fl_split.models.mlp"),
    ModelEntry("mnist-mlp-bn", "vector", 4, 2, "001 Table 10 MNIST: Linear(d,128)+BN+ReLU, Linear(128,64)[+BN+ReLU] | "
                                               "Linear(64,64)+BN+ReLU, Linear(64,10)", "fl_split.models.mlp"),
    ModelEntry("cnn-stripe", "image", 3, 2, "small stripe CNN: conv16+pool, conv32+pool | FC64, FC-out",
               "fl_split.models.vision"),
    ModelEntry("cnn-mnist", "image", 3, 2, "003 Table 1 CNN-MNIST: conv32, conv64+pool | FC256, FC-out",
               "fl_split.models.vision"),
    ModelEntry("resnet18-split", "image", 6, 2, "001 Table 10 CIFAR ResNet-18: stem, layer1 | layer2..4, avgpool, "
                                                "FC-out", "fl_split.models.vision"),
    ModelEntry("resnet20", "image", 5, 5, "003 Table 1 ResNet-20: stem, 3 stages x 3 blocks (16/32/64), maxpool->256 "
                                          "| FC-out", "fl_split.models.vision"),
)


def model_names() -> list[str]:
    return [m.name for m in CATALOG]


def model_entry(name: str) -> ModelEntry:
    for m in CATALOG:
        if m.name == name:
            return m
    from fl_split.errors import ConfigError

    raise ConfigError("model", name, "one of " + ", ".join(model_names()))
