"""Convolutional zoo models: resnet, mobilenet, largekernel, longconv.

Each builder returns `(module, example_inputs)`; its keyword arguments are the
overrides `--set` accepts. Patterns the rules look for are listed in each
model's docstring, and tests/models/test_zoo.py counts them in the graph.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from opswap.errors import SpecError
from opswap.models._common import positive, seeded


def realistic_batchnorm(model: nn.Module) -> None:
    """Give every BatchNorm non-trivial affine parameters and running statistics.

    Freshly built BN layers have mean 0, var 1, weight 1, bias 0, which makes a
    Conv+BN fold look right even when the folding arithmetic is wrong.
    """
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                # the zoo's BatchNorm layers track running statistics
                cast(torch.Tensor, m.running_mean).copy_(torch.randn(n) * 0.2)
                cast(torch.Tensor, m.running_var).copy_(torch.rand(n) * 1.5 + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(n) * 1.0 + 0.5)
                    m.bias.copy_(torch.randn(n) * 0.1)


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]


def _images(batch: int, channels: int, size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch, channels, size, size),)


# --------------------------------------------------------------------------- resnet


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut (1x1 conv+BN when the shape changes), ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3)
        self.downsample = (
            nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None
        )
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class ResNet(nn.Module):
    def __init__(self, in_channels: int, width: int, num_classes: int):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(in_channels, width, 3)
        self.relu = nn.ReLU()
        self.layer1 = BasicBlock(width, width)
        self.layer2 = nn.Sequential(
            BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width)
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(2 * width, 4 * width)
        self.bn_fc = nn.BatchNorm1d(4 * width)
        self.relu_fc = nn.ReLU()
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))  # x: [B, W, H, W]
        x = self.layer2(self.layer1(x))  # x: [B, 2W, H/2, W/2]
        x = torch.flatten(self.avgpool(x), 1)
        x = self.relu_fc(self.bn_fc(self.fc1(x)))
        return self.fc(x)


def resnet(
    batch: int = 2,
    image_size: int = 32,
    width: int = 16,
    num_classes: int = 10,
    in_channels: int = 3,
    seed: int = 0,
):
    """ResNet-style CNN (chapters 4, 9, 11, 13).

    Patterns: 8 Conv2d directly followed by BatchNorm2d (stem, two per basic block,
    the stride-2 downsample shortcut), 4 of them then ReLU (Conv+BN+ReLU fusion);
    3 residual adds each followed by ReLU; AdaptiveAvgPool2d(1) + flatten (global
    pooling); Linear directly followed by BatchNorm1d (Linear+BN fold); final Linear.
    """
    positive(
        "zoo:resnet",
        batch=batch,
        image_size=image_size,
        width=width,
        num_classes=num_classes,
        in_channels=in_channels,
    )
    with seeded(seed):
        model = ResNet(in_channels, width, num_classes)
        realistic_batchnorm(model)
        return model.eval(), _images(batch, in_channels, image_size)


# --------------------------------------------------------------------------- mobilenet


class SqueezeExcite(nn.Module):
    """Channel attention: global avg pool, 1x1 reduce, ReLU, 1x1 expand, hardsigmoid, scale."""

    def __init__(self, channels: int, reduced: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.relu = nn.ReLU()
        self.expand = nn.Conv2d(reduced, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.gate(self.expand(self.relu(self.reduce(self.pool(x)))))  # s: [B, C, 1, 1]
        return x * s


class InvertedResidual(nn.Module):
    """1x1 expand (BN, ReLU6) -> 3x3 depthwise (BN, hardswish) -> [SE] -> 1x1 project (BN) [+ x]."""

    def __init__(self, cin: int, cout: int, expand: int, stride: int, se: bool):
        super().__init__()
        hidden = cin * expand
        self.expand = nn.Sequential(*_conv_bn(cin, hidden, 1), nn.ReLU6())
        self.depthwise = nn.Sequential(
            *_conv_bn(hidden, hidden, 3, stride, groups=hidden), nn.Hardswish()
        )
        self.se = SqueezeExcite(hidden, max(8, hidden // 4)) if se else nn.Identity()
        self.project = nn.Sequential(*_conv_bn(hidden, cout, 1))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.se(self.depthwise(self.expand(x))))
        return out + x if self.residual else out


class MobileNet(nn.Module):
    def __init__(self, in_channels: int, width: int, num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(in_channels, width, 3, stride=2), nn.Hardswish())
        self.blocks = nn.Sequential(
            InvertedResidual(width, width, expand=4, stride=1, se=True),
            InvertedResidual(width, 2 * width, expand=4, stride=2, se=True),
            InvertedResidual(2 * width, 2 * width, expand=4, stride=1, se=False),
        )
        self.head = nn.Sequential(*_conv_bn(2 * width, 8 * width, 1), nn.Hardswish())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(8 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.classifier(torch.flatten(self.pool(x), 1))


def mobilenet(
    batch: int = 2,
    image_size: int = 32,
    width: int = 16,
    num_classes: int = 10,
    in_channels: int = 3,
    seed: int = 0,
):
    """MobileNetV2/V3-style CNN (chapters 4, 9, 11, 13).

    Patterns: 3 inverted residual blocks with a 1x1 expand Conv+BN+ReLU6, a 3x3
    depthwise Conv (groups = channels)+BN+Hardswish and a 1x1 project Conv+BN
    (11 Conv+BN pairs with stem and head); 2 squeeze-excitation blocks
    (AdaptiveAvgPool2d -> 1x1 Conv -> ReLU -> 1x1 Conv -> Hardsigmoid -> mul);
    2 residual adds; global average pooling and a Linear classifier.
    """
    positive(
        "zoo:mobilenet",
        batch=batch,
        image_size=image_size,
        width=width,
        num_classes=num_classes,
        in_channels=in_channels,
    )
    with seeded(seed):
        model = MobileNet(in_channels, width, num_classes)
        realistic_batchnorm(model)
        return model.eval(), _images(batch, in_channels, image_size)


# --------------------------------------------------------------------------- largekernel


class LargeKernelNet(nn.Module):
    def __init__(self, in_channels: int, width: int, num_classes: int):
        super().__init__()
        w = width
        self.stem = nn.Conv2d(in_channels, w, 7, stride=2, padding=3, bias=False)  # dense 7x7
        self.stem_bn = nn.BatchNorm2d(w)
        self.stem_relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.dw13 = nn.Conv2d(w, w, 13, padding=6, groups=w)  # depthwise 13x13
        self.dw_bn = nn.BatchNorm2d(w)
        self.dense11 = nn.Conv2d(w, w, 11, padding=5)  # dense 11x11
        self.dense11_relu = nn.ReLU()
        self.conv5 = nn.Conv2d(w, 2 * w, 5, padding=2)  # 5x5: two stacked 3x3 see as far
        self.conv5_relu = nn.ReLU()
        self.avgpool = nn.AvgPool2d(2)
        self.dw7 = nn.Conv2d(2 * w, 2 * w, 7, padding=3, groups=2 * w)  # depthwise 7x7
        self.dw7_relu = nn.ReLU()
        self.adaptive_max = nn.AdaptiveMaxPool2d(4)
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(2 * w, 4 * w)
        self.fc_relu = nn.ReLU()
        self.fc2 = nn.Linear(4 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.stem_relu(self.stem_bn(self.stem(x))))  # [B, W, S/4, S/4]
        x = x + self.dw_bn(self.dw13(x))
        x = self.dense11_relu(self.dense11(x))
        x = self.avgpool(self.conv5_relu(self.conv5(x)))  # [B, 2W, S/8, S/8]
        x = self.adaptive_max(self.dw7_relu(self.dw7(x)))  # [B, 2W, 4, 4]
        x = torch.flatten(self.global_pool(x), 1)
        return self.fc2(self.fc_relu(self.fc1(x)))


def largekernel(
    batch: int = 2,
    image_size: int = 64,
    width: int = 16,
    num_classes: int = 10,
    in_channels: int = 3,
    seed: int = 0,
):
    """CNN with large kernels and every pooling flavour (chapters 5, 11, 13).

    Patterns: dense 7x7 stride-2 stem Conv+BN+ReLU; 13x13 depthwise Conv+BN in a
    residual; dense 11x11 Conv (FFT / large-kernel targets); a 5x5 Conv (stacked
    3x3 target); 7x7 depthwise Conv; MaxPool2d(3, stride 2), AvgPool2d(2),
    AdaptiveMaxPool2d(4), and a global AdaptiveAvgPool2d(1) + Linear-ReLU-Linear head.
    """
    positive(
        "zoo:largekernel",
        batch=batch,
        width=width,
        num_classes=num_classes,
        in_channels=in_channels,
    )
    if image_size < 32:
        raise SpecError(
            f"Override image_size for zoo:largekernel must be at least 32, got {image_size}."
        )
    with seeded(seed):
        model = LargeKernelNet(in_channels, width, num_classes)
        realistic_batchnorm(model)
        return model.eval(), _images(batch, in_channels, image_size)


# --------------------------------------------------------------------------- longconv


class LongConvBlock(nn.Module):
    """A long 1-D token-mixing conv then ReLU, a pointwise channel mix, and the residual."""

    def __init__(self, width: int, kernel: int) -> None:
        super().__init__()
        self.long = nn.Conv1d(width, width, kernel, padding=kernel // 2)
        self.long_relu = nn.ReLU()
        self.mix = nn.Conv1d(width, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.long_relu(self.long(x)))


class LongConvNet(nn.Module):
    def __init__(
        self, in_channels: int, width: int, kernel: int, depth: int, num_classes: int
    ) -> None:
        super().__init__()
        self.embed = nn.Conv1d(in_channels, width, 1)
        self.blocks = nn.Sequential(*(LongConvBlock(width, kernel) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embed(x))  # [B, W, L]
        return self.head(self.norm(x.mean(dim=-1)))


def longconv(
    batch: int = 2,
    length: int = 1024,
    width: int = 32,
    kernel: int = 127,
    depth: int = 2,
    num_classes: int = 10,
    in_channels: int = 4,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Long-convolution 1-D sequence classifier (CKConv / S4-style long kernels; chapters
    4, 11, 25).

    Patterns: a pointwise Conv1d embedding; `depth` blocks of a dense Conv1d whose kernel
    spans `kernel` steps (odd, 'same' padding) followed by ReLU (fusion.conv_relu's
    pattern, and conv.algorithm's: past some 31-127 taps an FFT conv beats the direct
    one on a CPU), a pointwise Conv1d channel mix and a residual add; a mean over the
    sequence, LayerNorm and a Linear head. Input [batch, in_channels, length].
    """
    positive(
        "zoo:longconv",
        batch=batch,
        length=length,
        width=width,
        kernel=kernel,
        depth=depth,
        num_classes=num_classes,
        in_channels=in_channels,
    )
    if kernel % 2 == 0:
        raise SpecError(
            f"Override kernel for zoo:longconv must be odd ('same' padding), got {kernel}."
        )
    with seeded(seed):
        model = LongConvNet(in_channels, width, kernel, depth, num_classes)
        return model.eval(), (torch.randn(batch, in_channels, length),)
