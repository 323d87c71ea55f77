"""Run extras (k_scale, v_scale): validated once in core, handed by keyword only to backends that
declare them, refused with a reason naming the extra for those that do not."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import tactix
from tactix.testing.oracle import attention_reference, relative_error
from tests.plugin_fixtures import plugins_on_path, write_distribution

i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731

# a backend that serves decode through the torch backend's plan but declares no run extras; its
# plans' run takes exactly the five positional arguments and records every call
NO_EXTRAS = """
import tactix
from tactix.backends import torch as _torch

CALLS = []

class _Plan:
    def __init__(self, inner):
        self.inner, self.tactic, self.built = inner, tactix.Tactic(backend="plain", kernel="k"), False

    def run(self, q, k_cache, v_cache, out, lse):
        CALLS.append("run")
        self.inner.run(q, k_cache, v_cache, out, lse)

@tactix.hookimpl
def tactix_backends():
    decode = _torch.tactix_backends()[0].decode.model_copy(update={"run_extras": frozenset()})
    return [tactix.BackendSpec(name="plain", version="1.0", decode=decode, preference=100)]

@tactix.hookimpl
def tactix_plan_decode(problem, batch, tactic, options):
    return _Plan(_torch.tactix_plan_decode(problem, batch, tactix.Tactic.default("torch"), options))
"""


def _decode_batch() -> tuple[tuple[torch.Tensor, ...], torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    meta = (i32(0, 2, 3), i32(1, 0, 2), i32(5, 3))  # kv lengths 13 and 3, page size 8
    q = torch.randn(2, 4, 32, generator=gen)
    cache = torch.randn(3, 2, 8, 32, generator=gen), torch.randn(3, 2, 8, 32, generator=gen)  # HND
    return meta, q, cache


def _reference(meta: tuple[torch.Tensor, ...], q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
               k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return attention_reference(q, *cache, i32(0, 1, 2), *meta, kv_layout="HND", causal=False,
                               sm_scale=1 / math.sqrt(32), k_scale=k_scale, v_scale=v_scale)  # fmt: skip


@pytest.mark.parametrize("form", ["float", "tensor"])
def test_torch_backend_dequantizes_with_the_scales(form: str) -> None:
    meta, q, cache = _decode_batch()
    wrapper = tactix.PagedDecode("HND", device="cpu", backend="torch")
    wrapper.plan(*meta, 4, 2, 32, 8, q_data_type=torch.float32, return_lse=True)
    scales = (0.5, 3.0) if form == "float" else (torch.tensor(0.5), torch.tensor([3.0]))
    out, lse = wrapper.run(q, cache, k_scale=scales[0], v_scale=scales[1])
    ref, ref_lse = _reference(meta, q, cache, 0.5, 3.0)
    assert relative_error(out, ref) < 1e-5
    assert float((lse - ref_lse).abs().max()) < 1e-4  # k_scale changes the LSE, v_scale does not


@pytest.mark.parametrize(
    ("value", "given"),
    [
        (-1.0, "-1.0"),
        (float("nan"), "nan"),
        (0.0, "0.0"),
        (True, "bool"),
        ("0.5", "str"),
        (torch.tensor(0.5, dtype=torch.float64), "torch.float64 tensor"),
        (torch.tensor([0.5, 0.5]), "shape (2,)"),
        (torch.tensor(0.5, device="meta"), "on meta"),
    ],
)
def test_bad_scales_name_the_argument(value: object, given: str) -> None:
    meta, q, cache = _decode_batch()
    wrapper = tactix.PagedDecode("HND", device="cpu", backend="torch")
    wrapper.plan(*meta, 4, 2, 32, 8, q_data_type=torch.float32)
    for name in ("k_scale", "v_scale"):
        with pytest.raises(tactix.InvalidArgumentError, match=name) as info:
            wrapper.run(q, cache, **{name: value})  # type: ignore[arg-type]
        assert given in str(info.value)


@pytest.fixture
def plain_backend(tmp_path: Path):  # type: ignore[no-untyped-def]
    write_distribution(tmp_path, "tactix-plain", "1.0", {"plain": "tx_plain_mod"}, {"tx_plain_mod": NO_EXTRAS})
    with plugins_on_path(tmp_path):
        import tx_plain_mod  # type: ignore[import-not-found]

        yield tx_plain_mod


def test_a_backend_that_does_not_declare_an_extra_is_never_handed_one(plain_backend) -> None:  # type: ignore[no-untyped-def]
    meta, q, cache = _decode_batch()
    wrapper = tactix.PagedDecode("HND", device="cpu")
    wrapper.plan(*meta, 4, 2, 32, 8, q_data_type=torch.float32)
    assert wrapper.backend == "plain"
    # a scale of 1.0 changes nothing: dropped, and the backend serves the call
    out = wrapper.run(q, cache, k_scale=1.0, v_scale=1.0)
    assert relative_error(out, _reference(meta, q, cache, 1.0, 1.0)[0]) < 1e-5
    assert plain_backend.CALLS == ["run"]
    with pytest.raises(tactix.InvalidArgumentError, match="k_scale") as info:
        wrapper.run(q, cache, k_scale=0.5)
    message = str(info.value)
    # only the backends that take it and can serve this problem here (a GPU-only one cannot)
    assert "'plain' does not take k_scale" in message
    assert "backends that take it and can serve this problem: torch (make the wrapper with run_extras=" in message
    assert plain_backend.CALLS == ["run"]  # refused before the plan ran
    # the backends that take it serve it when asked for
    wrapper.plan(*meta, 4, 2, 32, 8, q_data_type=torch.float32, backend="torch")
    out = wrapper.run(q, cache, k_scale=0.5)
    assert relative_error(out, _reference(meta, q, cache, 0.5, 1.0)[0]) < 1e-5


def test_a_declaration_naming_an_unknown_extra_is_refused() -> None:
    from tactix.backends import torch as torch_backend

    decode = torch_backend.tactix_backends()[0].decode
    unknown = frozenset({"alibi_slopes"})
    with pytest.raises(ValueError, match="run_extras names alibi_slopes, not a run extra of decode"):
        tactix.BackendSpec(name="x", version="1", decode=decode.model_copy(update={"run_extras": unknown}))
