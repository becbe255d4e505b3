"""Small classifiers: a conv net for images and an MLP for tests and benchmarks."""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn

from ._common import classification_outputs


class ImageClassifier(nn.Module):
    """A small CNN: ``model({"image", ["label"]}) -> {"cls_logits", ["loss", "acc"]}``.

    Args:
        in_channels: image channels C of ``batch["image"]`` [B, C, H, W].
        num_classes: number of classes; ``batch["label"]`` is [B] int64 (-1 = ignore).
        width: channels of the first block; each later block doubles them.
        depth: number of conv-BN-ReLU blocks; every block after the first halves H and W
            with a stride-2 convolution.
        channels_last: run the blocks on a channels-last copy of the image (the layout
            oneDNN's convolutions use). Besides being torch's own CNN recipe, it matters for
            a whole-step compile: inductor fixes the layout of a tensor that
            ``convolution_backward`` reads to the layout eager would give it, so on NCHW
            input every ReLU output was stored three times (one NCHW copy for the ReLU
            backward, two channels-last copies for the next convolution and its backward)
            and the step ran 1.15-1.26x slower than on channels-last input (benchmarks/README.md).
            Values are the same up to float rounding.
    Global average pooling makes the net accept any H, W (at least 2**(depth-1)).
    """

    label_key = "label"  # the batch entry its loss is computed from

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, depth: int = 3,
                 channels_last: bool = True):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        layers, cin = [], in_channels
        for i in range(depth):
            cout = width * 2 ** i
            layers += [
                nn.Conv2d(cin, cout, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(),
            ]
            cin = cout
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)
        self.in_channels = in_channels
        self.channels_last = channels_last

    def forward(self, batch: dict) -> dict:
        x = batch["image"]
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"batch['image'] must be [B, {self.in_channels}, H, W], got {tuple(x.shape)}")
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        logits = self.head(self.body(x).mean(dim=(2, 3)))
        return classification_outputs(logits, batch, "label", "cls_logits")


class MLPClassifier(nn.Module):
    """A tiny MLP: ``model({"x", ["y"]}) -> {"cls_logits", ["loss", "acc"]}``.

    Args:
        in_features: width of ``batch["x"]`` [B, in_features].
        num_classes: classes; ``batch["y"]`` is [B] int64 (-1 = ignore).
        hidden: hidden layer widths, or one width (ReLU between layers; no norm, so no buffers).
    """

    label_key = "y"  # the batch entry its loss is computed from

    def __init__(self, in_features: int, num_classes: int, hidden: Union[int, Sequence[int]] = (64,)):
        super().__init__()
        if isinstance(hidden, int):
            hidden = (hidden,)
        layers, cin = [], in_features
        for h in hidden:
            layers += [nn.Linear(cin, h), nn.ReLU()]
            cin = h
        layers.append(nn.Linear(cin, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, batch: dict) -> dict:
        return classification_outputs(self.net(batch["x"]), batch, "y", "cls_logits")
