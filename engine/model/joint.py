"""Parameters a step reads as one matrix while the checkpoint names them apart: the q/k/v projections of an
attention layer, a pair of heads, a pair of biases. One linear over their rows is one GEMM where three
projections are three.

`JointParams` keeps each listed group of parameters in one tensor, stacked along dim 0, and every parameter
a view of its rows: the checkpoint's names, shapes and loading (in place, `copy_`) are unchanged, and there is
no second copy of the weights. Moving or casting the module (`to`, `to_empty`, ...) makes each parameter a
tensor of its own, so the group is joined again after every such move. Knows modules and parameters; nothing
of the model's maths.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


class JointParams(nn.Module):
    """Mixin: call `self.join_params({joint name: (parameter path, ...)})` once the parameters exist, then
    read a group whole with `self.joint(name)` ([sum of the parameters' first dims, ...])."""

    def join_params(self, groups: Mapping[str, tuple[str, ...]]) -> None:
        self._joint_groups = dict(groups)
        self._joint: dict[str, torch.Tensor] = {}
        self._join()

    def joint(self, name: str) -> torch.Tensor:
        return self._joint[name]

    @torch.no_grad()
    def _join(self) -> None:
        for name, paths in self._joint_groups.items():
            params = [self.get_parameter(p) for p in paths]
            rest = params[0].shape[1:]
            if any(p.shape[1:] != rest or p.dtype != params[0].dtype for p in params):
                raise ValueError(f"{name}: parameters {paths} differ beyond their first dim or in dtype")
            whole = torch.cat([p.detach() for p in params])
            first = 0
            for p in params:
                p.data = whole[first : first + p.shape[0]]
                first += p.shape[0]
            self._joint[name] = whole

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (torch's signature)
        out = super()._apply(fn, recurse)
        if getattr(self, "_joint_groups", None):
            self._join()
        return out
