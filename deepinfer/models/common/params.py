"""A tree of preallocated tensors whose dotted paths are the checkpoint's keys."""

from __future__ import annotations

import torch


class ParamTree:
    """Named tensors plus named children; ``named_parameters`` flattens them with dots."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}
        self._children: dict[str, ParamTree] = {}

    def param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Allocate (uninitialised) the tensor a checkpoint key ``name`` loads into."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self._tensors[name] = t
        return t

    def alias(self, name: str, view: torch.Tensor) -> None:
        """Expose ``view`` (a view into a larger tensor) under the checkpoint key ``name``."""
        self._tensors[name] = view

    def child(self, name: str, tree: "ParamTree") -> "ParamTree":
        """Add ``tree`` under ``name`` (``""``: its keys join this tree's own, for a part a checkpoint names at the top)."""
        self._children[name] = tree
        return tree

    def named_parameters(self, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {prefix + k: v for k, v in self._tensors.items()}
        for name, tree in self._children.items():
            out.update(tree.named_parameters(f"{prefix}{name}." if name else prefix))
        return out

