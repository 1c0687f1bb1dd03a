"""``PPProxyTensors``: the named token-major tensors one PP stage hands to the next."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

__all__ = ["PPProxyTensors"]


class PPProxyTensors(Mapping[str, torch.Tensor]):
    """A read-only mapping of names (``hidden_states``, ``residual``, ``topk_indices``, ...) to tensors
    whose leading dim is the token dim.

    ``proxies[key]`` gives one tensor; ``proxies[a:b]`` slices every tensor along tokens.
    The backend itself does not need this type: a plain dict or any pytree of tensors works too.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    def __getitem__(self, key: str) -> torch.Tensor:
        if isinstance(key, slice):
            return PPProxyTensors({k: v[key] for k, v in self.tensors.items()})
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PPProxyTensors):
            return NotImplemented
        return self.tensors.keys() == other.tensors.keys() and all(
            torch.equal(v, other.tensors[k]) for k, v in self.tensors.items()
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        body = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        return f"PPProxyTensors({body})"
