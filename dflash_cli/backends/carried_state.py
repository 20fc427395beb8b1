"""Graph state a host session hands from one call's outputs to the next call's inputs, whole.

A hybrid target's linear-attention layers (modeling/hybrid_target.py) take `past_conv.i`,
`past_recurrent.i`, `past_delta.i` and `past_delta_positions` and return their next values as
`present_*`: the states at the call's start and the call's pending rows. Unlike K/V they are not rows
at positions, so the session keeps the last outputs and feeds them back as they are (no copy). The
graph folds in what its start position says was accepted and ignores all of it at position 0, so
`reset` only has to put arrays of the right shapes there.
"""

from __future__ import annotations

import numpy as np

from dflash_cli.backends.base import is_cache_input, is_kv_input

_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


class CarriedState:
    def __init__(self, inputs, present_prefix: str = "present_") -> None:
        """`inputs`: the session's input NodeArgs; the carried ones are its non-K/V cache inputs."""
        self._initial = {}
        for i in inputs:
            if is_cache_input(i.name) and not is_kv_input(i.name):
                shape = [d if isinstance(d, int) else 1 for d in i.shape]  # a symbolic row count: one row
                dtype = _DTYPES[i.type]
                self._initial[i.name] = np.full(shape, -1 if dtype == np.int64 else 0, dtype)
        self.present = {n: present_prefix + n.removeprefix("past_") for n in self._initial}
        self.values = {n: v.copy() for n, v in self._initial.items()}

    def __bool__(self) -> bool:
        return bool(self._initial)

    def reset(self, fill: float = 0.0) -> None:
        for name, first in self._initial.items():
            value = first.copy()
            if np.issubdtype(value.dtype, np.floating):
                value.fill(fill)
            self.values[name] = value

    def bind(self, binding) -> None:
        for name, value in self.values.items():
            binding.bind_cpu_input(name, value)

    def update(self, outputs: dict[str, np.ndarray]) -> None:
        """Take the call's `present_*` outputs as the next call's inputs."""
        for name, present in self.present.items():
            self.values[name] = outputs[present]
