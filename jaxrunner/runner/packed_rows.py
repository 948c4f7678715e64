"""Named fields packed into one int32 row, for one host-to-device transfer.

A new request's state (counts, sampling parameters, block ids, tokens, masks)
travels as one int32 row; float32 and uint32 fields are bit-cast. The same
``RowLayout`` packs on the host (NumPy) and unpacks on the device (in jit).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

_DTYPES = {"i32": (np.int32, jnp.int32), "f32": (np.float32, jnp.float32), "u32": (np.uint32, jnp.uint32)}


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Ordered ``(name, width, kind)`` fields; kind is "i32", "f32" or "u32"."""

    fields: tuple[tuple[str, int, str], ...]

    @property
    def width(self) -> int:
        """int32 words per packed row."""
        return sum(w for _, w, _ in self.fields)

    def _offsets(self) -> dict[str, tuple[int, int, str]]:
        out, start = {}, 0
        for name, width, kind in self.fields:
            out[name] = (start, width, kind)
            start += width
        return out

    def pack(self, values: dict[str, object]) -> np.ndarray:
        """One int32 row; missing fields are zero, short arrays are zero-padded on the right."""
        row = np.zeros(self.width, np.int32)
        for name, (start, width, kind) in self._offsets().items():
            if name not in values:
                continue
            data = np.asarray(values[name], _DTYPES[kind][0]).reshape(-1)
            if data.size > width:
                raise ValueError(f"Field {name!r} holds {data.size} values, more than its {width}.")
            row[start : start + data.size] = data.view(np.int32)
        return row

    def unpack(self, rows: Int[Array, "n width"]) -> dict[str, Array]:
        """Each field as ``[n, width]`` in its dtype (in jit)."""
        out = {}
        for name, (start, width, kind) in self._offsets().items():
            part = rows[:, start : start + width]
            if kind != "i32":
                part = jax.lax.bitcast_convert_type(part, _DTYPES[kind][1])
            out[name] = part
        return out
