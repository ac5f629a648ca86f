"""Padding-free ("packed") layout of a padded batch (docs/architecture.md, "Padding-free forwards").

A batch of B sequences padded to width T costs B·T positions in every linear layer, whatever the
real lengths: preference pairs of very different lengths are mostly padding. Packing lays the
real tokens of several sequences end to end in a row; each sequence's position ids restart at 0,
which is how a causal LM (transformers' mask utilities: no 2-D attention mask, position ids that
restart) keeps packed sequences from attending to each other. Rows are filled first-fit
decreasing up to ``capacity`` (default T), so no row is longer than the padded batch was and the
attention cost never exceeds the padded one; ``capacity=None`` with ``one_row=True`` puts
everything in one row (what varlen flash-attention kernels want).

Pure index arithmetic: no model, no Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Packed:
    """Where each real token of a padded (B, T) batch sits in the packed (R, C) rows."""

    input_ids: Tensor
    """(R, C) packed token ids; the tail of a row after its last sequence holds ``pad_id``."""
    position_ids: Tensor
    """(R, C) positions restarting at 0 for every sequence (and for a row's padded tail)."""
    source: Tensor
    """(N,) flat index into the padded (B·T) batch of each real token, in packed order."""
    target: Tensor
    """(N,) flat index into the packed (R·C) rows of the same tokens."""
    shape: tuple[int, int]
    """(B, T) of the padded batch."""

    def packed_index(self, padded_flat: Tensor) -> Tensor:
        """Flat packed indices (into R·C) of flat padded indices (into B·T) of real tokens."""
        lookup = torch.full((self.shape[0] * self.shape[1],), -1, dtype=torch.long, device=self.target.device)
        lookup[self.source] = self.target
        out = lookup[padded_flat]
        if bool((out < 0).any()):
            raise ValueError("packed_index: asked for a padding position of the padded batch")
        return out


def first_fit_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices grouped into rows of total length ≤ ``capacity``, first-fit decreasing
    (longest first; a sequence longer than ``capacity`` gets a row of its own)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def pack(
    input_ids: Tensor, attention_mask: Tensor, pad_id: int = 0, capacity: int | None = None, one_row: bool = False
) -> Packed:
    """Pack the real tokens (``attention_mask`` = 1, contiguous per row: left or right padding)
    of a (B, T) batch into rows of at most ``capacity`` (default T) positions, or one row.

    Naive equivalent: for each packed row, ``cat([ids[b][mask[b]] for b in row])`` with
    positions ``cat([arange(len_b) for b in row])``.
    """
    b, t = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(1).tolist()
    if one_row:
        groups = [[i for i in range(b) if lengths[i] > 0]]
        width = max(1, sum(lengths))
    else:
        cap = capacity or t
        groups = first_fit_rows([int(n) for n in lengths], cap)
        groups = [[i for i in g if lengths[i] > 0] for g in groups]
        groups = [g for g in groups if g] or [[]]
        width = max(1, max(max(sum(lengths[i] for i in g), 1) for g in groups))
    device = input_ids.device
    first = torch.where(mask.any(1), mask.long().argmax(1), 0).tolist()  # each row's first real column
    src, dst, tails = [], [], []
    for r, group in enumerate(groups):
        col = r * width
        for i in group:
            n = int(lengths[i])
            src.append(torch.arange(first[i], first[i] + n, device=device) + i * t)
            dst.append(torch.arange(col, col + n, device=device))
            col += n
        tails.append((col, (r + 1) * width))
    empty = torch.zeros(0, dtype=torch.long, device=device)
    source, target = (torch.cat(src), torch.cat(dst)) if src else (empty, empty)
    ids = torch.full((len(groups) * width,), pad_id, dtype=input_ids.dtype, device=device)
    ids[target] = input_ids.reshape(-1)[source]
    # positions restart at 0 for every sequence; a row's padded tail counts from 0 as one more sequence
    positions = torch.zeros(len(groups) * width, dtype=torch.long, device=device)
    positions[target] = source % t - torch.tensor(first, device=device)[source // t]
    for lo, hi in tails:
        positions[lo:hi] = torch.arange(hi - lo, device=device)
    return Packed(ids.view(len(groups), width), positions.view(len(groups), width), source, target, (b, t))


def unpack(values: Tensor, packed: Packed, fill: float = 0.0) -> Tensor:
    """(R, C, ...) per-position values of the packed rows → (B, T, ...) in the padded layout
    (``fill`` at padding positions)."""
    b, t = packed.shape
    flat = values.reshape(-1, *values.shape[2:])
    out = flat.new_full((b * t, *values.shape[2:]), fill)
    out[packed.source] = flat[packed.target]
    return out.view(b, t, *values.shape[2:])
