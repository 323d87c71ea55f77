"""The cache-layout helpers every backend and the kit read sizes and strides through."""

from __future__ import annotations

import pytest
import torch

from tactix.plugin import cache_axes, dense_strides, page_shape


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_axes_of_a_real_cache(layout: str) -> None:
    pages, page_size, heads, dim = 5, 16, 3, 8
    cache = torch.zeros(pages, *page_shape(layout, page_size, heads, dim))
    assert cache_axes(cache.shape, layout) == (pages, page_size, heads, dim)
    axes = cache_axes(cache.stride(), layout)
    assert tuple(axes) == tuple(dense_strides(layout, page_size, heads, dim))
    # element (page 2, token 7, head 1, dim 4) sits where the axis strides say
    index = (2, 7, 1, 4) if layout == "NHD" else (2, 1, 7, 4)
    cache[index] = 1.0
    flat = 2 * axes.page + 7 * axes.token + 1 * axes.head + 4 * axes.dim
    assert cache.view(-1)[flat] == 1.0


def test_axes_of_a_fused_cache_view() -> None:
    # one [pages, 2, heads, page, dim] tensor: k and v are strided views, HND
    fused = torch.zeros(4, 2, 2, 16, 8)
    k = fused[:, 0]
    axes = cache_axes(k.stride(), "HND")
    assert axes.page == 2 * 2 * 16 * 8
    assert (axes.token, axes.head, axes.dim) == (8, 16 * 8, 1)
