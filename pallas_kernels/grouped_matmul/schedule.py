"""The tile schedule of the grouped matmul (megablox style), computed from group_sizes in jnp.

x's rows [A] are sorted by group: group e owns rows [start_e, end_e), end_e = min(start_e + group_sizes[e], A).
The kernel walks row tiles of tm rows aligned to multiples of tm. A tile that straddles a group boundary is
visited once per group it intersects (each visit writes only that group's rows), so the number of visits is at
most A_pad / tm + E: every boundary between two non-empty groups adds one visit. The rows past the last group
([total, A_pad)) form one more pseudo-group, number E, whose visits write zeros (ragged_dot's rows past
sum(group_sizes) are 0). Visits past the last real one are inactive (group E + 1) and do nothing.

    visit_group [V] int32  group of visit v: 0..E-1 a real group, E the zero tail, E + 1 inactive
    visit_tile  [V] int32  row tile of visit v (rows [tile * tm, tile * tm + tm))
    starts      [E + 1] int32  first row of each group (the tail last)
    ends        [E + 1] int32  one past its last row

V = A_pad / tm + E is static (the grid bound); A_pad is A rounded up to tm.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TileSchedule(NamedTuple):
    """Which row tile and group each visit of the grouped-matmul kernel covers (shapes: the module docstring)."""

    visit_group: jax.Array
    visit_tile: jax.Array
    starts: jax.Array
    ends: jax.Array


def group_bounds(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(starts, ends) [E] of each group's rows, clipped to num_rows (a total past num_rows is cut, as ragged_dot
    does). group_sizes [E] must be non-negative."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def num_visits(num_rows_padded: int, num_groups: int, tm: int) -> int:
    """V, the static bound on the visits (grid size along the rows)."""
    return num_rows_padded // tm + num_groups


def make_schedule(group_sizes: jax.Array, num_rows_padded: int, tm: int) -> TileSchedule:
    """The visits over rows [0, num_rows_padded) (a multiple of tm) for group_sizes [E]."""
    if num_rows_padded % tm:
        raise ValueError(f"make_schedule: {num_rows_padded} rows is not a multiple of the row tile {tm}")
    num_groups = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, num_rows_padded)
    starts = jnp.concatenate([starts, ends[-1:]])  # + the zero tail [total, A_pad)
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows_padded, jnp.int32)])
    first = starts // tm
    visits = jnp.where(ends > starts, (ends + tm - 1) // tm - first, 0)  # [E + 1] row tiles each group touches
    visit_end = jnp.cumsum(visits)
    visit_start = visit_end - visits
    v = jnp.arange(num_visits(num_rows_padded, num_groups, tm), dtype=jnp.int32)
    group = jnp.searchsorted(visit_end, v, side="right").astype(jnp.int32)  # E + 1 past the last visit
    g = jnp.minimum(group, num_groups)
    tile = jnp.where(group <= num_groups, first[g] + v - visit_start[g], 0)
    return TileSchedule(group, tile.astype(jnp.int32), starts, ends)


__all__ = ["TileSchedule", "group_bounds", "make_schedule", "num_visits"]
