"""Zoo models trained on a real task: scikit-learn's digits (8x8 grey images, 10 classes).

The data ships inside scikit-learn (`sklearn.datasets.load_digits`, 1797 images), so no
download happens. The split is fixed (stratified, 20% held out, `random_state=0`), and the
pixels are standardised with the training split's mean and standard deviation. Each model
is trained once with a fixed seed, on one CPU thread with deterministic algorithms, in a
few seconds; the weights are cached (`cache_dir()`, keyed by the recipe and the torch and
scikit-learn versions, written atomically), so later loads take milliseconds. Where the
cache cannot be written, the model is trained in memory on every load.

Each builder returns the module, a batch of the held-out split as its example input, and a
`Task` whose `evaluate(fn)` is the top-1 accuracy of `fn` on the held-out split.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import SpecError
from opswap.models._common import positive, seeded
from opswap.models.task import Task, top1_accuracy

TEST_FRACTION = 0.2
SPLIT_SEED = 0
CALIBRATION_SAMPLES = 256  # at least 8 batches
_FORMAT = 1  # bumped when what a recipe trains changes in a way its fields do not show


def cache_dir() -> Path:
    """Where trained zoo weights are kept: $OPSWAP_CACHE/zoo, else the cache directory
    the CPU target uses (targets.cpu.cache_dir: $OPSWAP_CACHE_DIR, else ~/.cache/opswap)
    with zoo/ under it."""
    from opswap.targets.cpu import cache_dir as opswap_cache

    env = os.environ.get("OPSWAP_CACHE")
    return (Path(env) if env else opswap_cache()) / "zoo"


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Digits:
    """The fixed split, standardised: images [N, 64] float32, labels [N] int64."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    sklearn_version: str


def _sklearn(spec: str) -> Any:
    try:
        import sklearn
        import sklearn.datasets
        import sklearn.model_selection
    except ImportError:
        raise SpecError(
            f"{spec} trains on scikit-learn's digits data set, and scikit-learn is not "
            "installed; pip install scikit-learn (or opswap[tasks])."
        ) from None
    return sklearn


def digits(spec: str = "zoo:digits_mlp") -> Digits:
    """The digits data set, split and standardised (read once per process); without
    scikit-learn, a SpecError naming `spec` and what to install."""
    _sklearn(spec)
    return _split()


@lru_cache(maxsize=1)
def _split() -> Digits:
    sklearn = _sklearn("the digits task")
    x, y = sklearn.datasets.load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = sklearn.model_selection.train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    train = torch.tensor(x_train, dtype=torch.float32)
    mean, std = train.mean(), train.std()
    return Digits(
        (train - mean) / std,
        torch.tensor(y_train, dtype=torch.int64),
        (torch.tensor(x_test, dtype=torch.float32) - mean) / std,
        torch.tensor(y_test, dtype=torch.int64),
        sklearn.__version__,
    )


# --------------------------------------------------------------------------- models


class DigitsMLP(nn.Module):
    def __init__(self, hidden: int = 256):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 64]
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # the last conv's stride halves 8x8 to 4x4 (a max pool would take 9x9 as well,
        # which the 512-wide head does not: the model takes 8x8 only, as its data is)
        self.features = nn.Sequential(
            _conv_bn_relu(1, 8), _conv_bn_relu(8, 16), _conv_bn_relu(16, 32, stride=2)
        )
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 1, 8, 8]
        return self.head(self.features(x).flatten(1))


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Recipe:
    """What decides the trained weights besides the architecture; its hash, with the
    architecture's repr and the versions, keys the cache."""

    model: str
    seed: int
    epochs: int = 15
    batch: int = 128
    lr: float = 2e-3
    weight_decay: float = 1e-4

    def key(self, data: Digits, model: nn.Module) -> str:
        fields = {
            **asdict(self),
            "architecture": repr(model),
            "split": [TEST_FRACTION, SPLIT_SEED],
            "torch": torch.__version__,
            "sklearn": data.sklearn_version,
            "format": _FORMAT,
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """One intra-op thread and deterministic kernels, restored after: float sums over
    threads are ordered differently from run to run, and so would the weights be."""
    threads = torch.get_num_threads()
    strict = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(strict)
        torch.set_num_threads(threads)


def _train(model: nn.Module, recipe: Recipe, x: torch.Tensor, y: torch.Tensor) -> None:
    """AdamW with a cosine-decayed learning rate over `recipe.epochs` shuffled epochs."""
    g = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    steps = recipe.epochs * math.ceil(len(y) / recipe.batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    model.train()
    for _ in range(recipe.epochs):
        order = torch.randperm(len(y), generator=g)
        for start in range(0, len(y), recipe.batch):
            rows = order[start : start + recipe.batch]
            loss = F.cross_entropy(model(x[rows]), y[rows])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()


def _write_atomically(state: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save into a file beside `path`, renamed over it; a cache that cannot be
    written is skipped (the model was trained in memory and is used as it is)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


def trained(
    build: Callable[[], nn.Module], recipe: Recipe, data: Digits, cache: bool = True
) -> nn.Module:
    """`build()` with the weights `recipe` trains: read from the cache, or trained now (and
    cached); eval mode. `cache=False` trains in memory and touches no file."""
    with seeded(recipe.seed):
        model = build()
    path = cache_dir() / f"digits_{recipe.model}-{recipe.key(data, model)}.pt"
    if cache:
        with contextlib.suppress(OSError, RuntimeError, ValueError, EOFError):
            model.load_state_dict(torch.load(path, weights_only=True))
            return model.eval()
    with seeded(recipe.seed), _deterministic():
        x = data.train_x.view(-1, 1, 8, 8) if recipe.model == "cnn" else data.train_x
        _train(model, recipe, x, data.train_y)
    if cache:
        _write_atomically(model.state_dict(), path)
    return model


def _task(data: Digits, shape: tuple[int, ...], batch: int, seed: int) -> Task:
    """Top-1 on the held-out split in batches of `batch`, and calibration batches of the
    same size drawn from the training split (as many as hold CALIBRATION_SAMPLES)."""
    test_x = data.test_x.view(-1, *shape)
    order = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(seed))
    count = max(8, math.ceil(CALIBRATION_SAMPLES / batch))
    calibration: list[tuple[torch.Tensor, ...]] = []
    for i in range(count):
        rows = order[torch.arange(i * batch, (i + 1) * batch) % len(order)]
        calibration.append((data.train_x[rows].view(-1, *shape),))
    return Task(
        metric="top1",
        evaluate=lambda fn: top1_accuracy(fn, test_x, data.test_y, batch),
        calibration=calibration,
        description=(
            f"the {len(data.test_y)} held-out images (a stratified {TEST_FRACTION:.0%} of "
            f"scikit-learn's 8x8 digits), in batches of {batch}"
        ),
    )


def _example(data: Digits, shape: tuple[int, ...], batch: int) -> tuple[torch.Tensor, ...]:
    rows = torch.arange(batch) % len(data.test_y)
    return (data.test_x[rows].view(-1, *shape),)


def digits_mlp(batch: int = 32, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...], Task]:
    """MLP classifier of scikit-learn's 8x8 digits, trained (chapter 6: accuracy of low precision).

    Input: a batch of the held-out split, [batch, 64] standardised pixels. Task: top-1 on
    the 360 held-out images (about 0.97 in float32).
    Patterns: three Linears, 64 -> 256 -> 256 -> 10, with ReLU between them (the first
    two are wide enough for int8 Linear schemes; the 10-way head is not).
    """
    positive("zoo:digits_mlp", batch=batch)
    data = digits("zoo:digits_mlp")
    model = trained(DigitsMLP, Recipe("mlp", seed), data)
    return model, _example(data, (64,), batch), _task(data, (64,), batch, seed)


def digits_cnn(batch: int = 32, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...], Task]:
    """Small CNN classifier of scikit-learn's 8x8 digits, trained (chapter 6).

    Input: a batch of the held-out split, [batch, 1, 8, 8] standardised pixels. Task: top-1
    on the 360 held-out images (about 0.98 in float32).
    Patterns: three Conv2d 3x3 (no bias) + BatchNorm2d + ReLU (1 -> 8 -> 16 channels at
    8x8, then 16 -> 32 with stride 2 to 4x4), flatten, a Linear 512 -> 10 head.
    """
    positive("zoo:digits_cnn", batch=batch)
    data = digits("zoo:digits_cnn")
    model = trained(DigitsCNN, Recipe("cnn", seed, lr=4e-3), data)
    shape = (1, 8, 8)
    return model, _example(data, shape, batch), _task(data, shape, batch, seed)
