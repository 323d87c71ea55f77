"""Paged KV-cache layouts: where a page's tokens, heads and head-dim elements sit, written once.

A 4-D cache tensor is ``[num_pages, page_size, num_kv_heads, head_dim]`` in the ``"NHD"``
layout and ``[num_pages, num_kv_heads, page_size, head_dim]`` in ``"HND"``. Code that needs a
cache's sizes or strides by meaning (page, token, head, dim) reads them through `cache_axes`
instead of indexing by layout itself; code that makes a cache or a page-shaped buffer asks
`page_shape` for the trailing three sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

__all__ = ["CacheAxes", "KVLayout", "cache_axes", "dense_strides", "page_shape"]

KVLayout = Literal["NHD", "HND"]


class CacheAxes(NamedTuple):
    """One value per axis of a 4-D paged cache, named by meaning whatever the layout: sizes
    (``page`` = number of pages, ``token`` = page size, ...) or strides in elements."""

    page: int
    token: int
    head: int
    dim: int


def cache_axes(values: Sequence[int], layout: KVLayout | str) -> CacheAxes:
    """The sizes (``t.shape``) or strides (``t.stride()``) of a 4-D cache tensor, by axis."""
    if layout == "NHD":  # [pages, page_size, heads, dim]
        return CacheAxes(values[0], values[1], values[2], values[3])
    return CacheAxes(values[0], values[2], values[1], values[3])  # HND: [pages, heads, page_size, dim]


def page_shape(layout: KVLayout | str, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """The shape of one page (a cache tensor's last three sizes) in ``layout``."""
    if layout == "NHD":
        return (page_size, num_kv_heads, head_dim)
    return (num_kv_heads, page_size, head_dim)


def dense_strides(layout: KVLayout | str, page_size: int, num_kv_heads: int, head_dim: int) -> CacheAxes:
    """The strides, by axis, of a contiguous cache tensor in ``layout``."""
    block = page_size * num_kv_heads * head_dim
    if layout == "NHD":
        return CacheAxes(block, num_kv_heads * head_dim, head_dim, 1)
    return CacheAxes(block, head_dim, page_size * head_dim, 1)
