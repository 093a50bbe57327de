"""``hl.models``: reference networks, each a HybridBlock.

* :func:`mlp` — multilayer perceptron (Dense + ReLU);
* :func:`lenet` — LeNet-5 style CNN (LeCun et al. 1998), adapting its kernels to small inputs;
* :func:`resnet18` — CIFAR-style ResNet-18 (He et al. 2016: 3x3 stem, no max-pool, BatchNorm);
* :func:`inception_net` — a small multi-branch (Inception-style, Szegedy et al. 2015) network
  whose branches are independent, to show parallel segments.
"""
from .. import nd as F
from ..nn import (Activation, BatchNorm, Conv2D, Dense, Flatten, GlobalAvgPool2D, HybridBlock,
                  HybridSequential, MaxPool2D)

__all__ = ["mlp", "lenet", "resnet18", "inception_net", "get_model", "MODELS"]


def mlp(hidden=(256, 128), num_classes=10, activation="relu"):
    """MLP: Flatten -> Dense(h, activation) for h in hidden -> Dense(num_classes).

    Input (N, ...) any trailing shape; output (N, num_classes) logits.
    """
    net = HybridSequential()
    for h in hidden:
        net.add(Dense(h, activation=activation))
    net.add(Dense(num_classes))
    return net


def lenet(num_classes=10, input_size=28):
    """LeNet: conv(6) -> pool -> conv(16) -> pool -> Dense 120 -> 84 -> classes, ReLU.

    For inputs of 28x28 and up: 5x5 kernels (the first padded by 2), as in LeCun et al. 1998;
    below (e.g. the 8x8 Digits): 3x3 kernels with padding 1 so the feature maps stay >= 2x2.
    Input (N, C, H, W) with H = W = input_size; output (N, num_classes).

    Raises:
        ValueError: ``input_size`` below 4 (two 2x2 poolings need at least 4x4 inputs).
    """
    if isinstance(input_size, bool) or not isinstance(input_size, int) or input_size < 4:
        raise ValueError(f"lenet: input_size: expected an int >= 4 (two 2x2 poolings), got "
                         f"{input_size!r}")
    if input_size >= 28:
        k1, p1, k2, p2 = 5, 2, 5, 0
    else:
        k1, p1, k2, p2 = 3, 1, 3, 1
    net = HybridSequential()
    net.add(Conv2D(6, k1, padding=p1, activation="relu"), MaxPool2D(2),
            Conv2D(16, k2, padding=p2, activation="relu"), MaxPool2D(2),
            Flatten(), Dense(120, activation="relu"), Dense(84, activation="relu"),
            Dense(num_classes))
    return net


class _BasicBlock(HybridBlock):
    """ResNet basic block: two 3x3 conv + BatchNorm, identity (or 1x1 projection) shortcut."""

    def __init__(self, channels, stride):
        super().__init__()
        self.conv1 = Conv2D(channels, 3, stride, 1, use_bias=False)
        self.bn1 = BatchNorm()
        self.conv2 = Conv2D(channels, 3, 1, 1, use_bias=False)
        self.bn2 = BatchNorm()
        self._stride, self._channels = stride, channels
        self.down = None

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        sc = x if self.down is None else self.down(x)
        return F.relu(y + sc)


def _block(channels, stride, in_channels):
    b = _BasicBlock(channels, stride)
    if stride != 1 or in_channels != channels:
        down = HybridSequential()
        down.add(Conv2D(channels, 1, stride, use_bias=False), BatchNorm())
        b.down = down
    return b


class ResNet(HybridBlock):
    """CIFAR-style ResNet: 3x3 stem, stages of basic blocks, global average pool, Dense."""

    def __init__(self, layers=(2, 2, 2, 2), width=64, num_classes=10):
        super().__init__()
        self.stem = HybridSequential()
        self.stem.add(Conv2D(width, 3, 1, 1, use_bias=False), BatchNorm(), Activation("relu"))
        self.stages = HybridSequential()
        cin = width
        for i, n in enumerate(layers):
            ch = width * 2 ** i
            for j in range(n):
                self.stages.add(_block(ch, 2 if (j == 0 and i > 0) else 1, cin))
                cin = ch
        self.pool = GlobalAvgPool2D()
        self.flat = Flatten()
        self.fc = Dense(num_classes)

    def forward(self, x):
        return self.fc(self.flat(self.pool(self.stages(self.stem(x)))))


def resnet18(num_classes=10, width=64):
    """ResNet-18 for small images (CIFAR variant of He et al. 2016). ``width`` scales every
    stage (64 is the standard; smaller is handy for tests). Input (N, C, H, W)."""
    return ResNet((2, 2, 2, 2), width, num_classes)


class _Inception(HybridBlock):
    """Four independent branches (1x1; 1x1->3x3; 1x1->5x5; pool->1x1) concatenated on channels."""

    def __init__(self, c1, c2, c3, c4):
        super().__init__()
        self.b1 = Conv2D(c1, 1, activation="relu")
        self.b2 = HybridSequential()
        self.b2.add(Conv2D(c2[0], 1, activation="relu"), Conv2D(c2[1], 3, padding=1, activation="relu"))
        self.b3 = HybridSequential()
        self.b3.add(Conv2D(c3[0], 1, activation="relu"), Conv2D(c3[1], 5, padding=2, activation="relu"))
        self.b4 = HybridSequential()
        self.b4.add(MaxPool2D(3, 1, 1), Conv2D(c4, 1, activation="relu"))

    def forward(self, x):
        return F.concat(self.b1(x), self.b2(x), self.b3(x), self.b4(x), axis=1)


def inception_net(num_classes=10, width=16):
    """A small Inception-style network (Szegedy et al. 2015): a stem, two Inception blocks of
    four independent branches each, global pooling and a classifier."""
    w = width
    net = HybridSequential()
    net.add(Conv2D(w, 3, padding=1, activation="relu"),
            _Inception(w, (w, 2 * w), (w // 2, w), w),
            _Inception(2 * w, (w, 2 * w), (w // 2, w), w),
            GlobalAvgPool2D(), Flatten(), Dense(num_classes))
    return net


MODELS = {"mlp": mlp, "lenet": lenet, "resnet18": resnet18, "inception": inception_net}


def get_model(name, **kwargs):
    """A model by name ('mlp', 'lenet', 'resnet18', 'inception').

    Raises:
        ValueError: unknown name.
    """
    if name not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name](**kwargs)
