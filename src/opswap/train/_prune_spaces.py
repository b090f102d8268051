"""The bookkeeping of structured pruning's dependency graph (train/_prune_graph.py): sets
of channels that must be pruned together (`Space`, merged by union-find), where along a
value's dimension they lie (`Label` of `Segment`s, or `Inside` an attention module), and
which parameter or buffer slices each indexes (`members`), with why a set is left whole."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Segment:
    """A run of a space's channels along a tensor dim, each channel `inner` entries wide."""

    space: int
    inner: int = 1


@dataclass
class Space:
    """A set of channels that must be pruned together (a union-find root when merged)."""

    size: int
    origin: str  # where it was first seen: "conv1's output channels"
    unit: int = 1  # channels removed together: the head dim for attention heads
    heads: list[tuple[str, str]] = field(default_factory=list)  # (module path, head attr)
    blocked: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Label:
    """The dimension `dim` of a value carries `segments`, in order."""

    dim: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Inside:
    """A value inside attention module `path`, carrying its head space in some layout."""

    path: str
    space: int


Tag = Label | Inside | None


class Spaces:
    """Channel sets, merged by union-find, and the tensor slices that index them."""

    def __init__(self) -> None:
        self.spaces: list[Space] = []
        self.parent: list[int] = []
        self.members: dict[tuple[str, int], tuple[Segment, ...]] = {}

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def new_space(self, size: int, origin: str) -> int:
        self.spaces.append(Space(int(size), origin))
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        sa, sb = self.spaces[ra], self.spaces[rb]
        if sa.size != sb.size:
            self.spaces[ra].blocked.append(f"{sa.origin} ({sa.size}) meet {sb.origin} ({sb.size})")
        self.parent[rb] = ra
        sa.unit = math.lcm(sa.unit, sb.unit)
        sa.heads.extend(sb.heads)
        sa.blocked.extend(sb.blocked)

    def roots(self) -> list[int]:
        return [i for i in range(len(self.parent)) if self.find(i) == i]

    def space(self, i: int) -> Space:
        return self.spaces[self.find(i)]

    def block(self, tag: Tag, reason: str) -> None:
        if isinstance(tag, Label):
            for seg in tag.segments:
                self.space(seg.space).blocked.append(reason)
        elif isinstance(tag, Inside):
            self.space(tag.space).blocked.append(reason)

    def member(self, path: str, dim: int, segments: tuple[Segment, ...]) -> None:
        """Parameter or buffer `path` is indexed by `segments` along `dim`."""
        old = self.members.get((path, dim))
        if old is None:
            self.members[(path, dim)] = segments
        elif not self._unify(old, segments):
            self.block(Label(0, old + segments), f"{path} is used with two channel layouts")

    def _unify(self, a: tuple[Segment, ...], b: tuple[Segment, ...]) -> bool:
        if len(a) != len(b) or any(x.inner != y.inner for x, y in zip(a, b, strict=True)):
            return False
        for x, y in zip(a, b, strict=True):
            self.union(x.space, y.space)
        return True
