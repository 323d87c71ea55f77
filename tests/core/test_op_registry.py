"""The op registry: each op's definition is complete and consistent, and the core finds an op's
wrapper, tuner inputs and run extras through it (nothing in core lists the ops)."""

from __future__ import annotations

import pytest
import torch

import tactix
from tactix.ops import OPS
from tactix.plugin import OpDefinition


@pytest.mark.parametrize("name", list(OPS))
def test_every_op_is_fully_defined(name: str) -> None:
    op: OpDefinition = OPS[name]
    assert op.name == name == op.problem.op
    assert op.plan_hook in op.plan_arguments or hasattr(op.hookspecs, op.plan_hook)
    wrapper = op.wrapper()
    assert getattr(tactix, wrapper.__name__) is wrapper  # the wrapper is public API
    assert op.tuner_inputs is not None
    assert set(op.extras) == {extra.name for extra in op.run_extras}


def test_the_tuner_inputs_of_each_op_have_the_problems_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    decode = tactix.PagedDecode("NHD", device="cpu")
    decode.plan(i32(0, 2, 3), i32(7, 2, 9), i32(3, 8), 8, 2, 64, 8, q_data_type=torch.float32, return_lse=True)
    problem, batch = decode.problem, decode._batch
    inputs = OPS["decode"].tuner_inputs(problem, batch, torch.device("cpu"), gen)  # type: ignore[misc]
    q, k, _, out, lse = inputs.args
    assert q.shape == (2, 8, 64) and out.shape == (2, 8, 64) and lse.shape == (2, 8)
    assert k.shape == (3, 8, 2, 64)  # only the batch's three pages, renumbered densely
    assert inputs.batch is not None and sorted(inputs.batch.kv_indices.tolist()) == [0, 1, 2]
    gemm = tactix.Gemm(device="cpu")
    gemm.plan(5, 48, 32, a_dtype=torch.bfloat16)
    a, b, out, bias, *_ = OPS["gemm"].tuner_inputs(gemm.problem, None, torch.device("cpu"), gen).args  # type: ignore[misc]
    assert a.shape == (5, 32) and b.shape == (32, 48) and out.shape == (5, 48) and bias is None


@pytest.mark.parametrize("name", list(OPS))
def test_the_kit_finds_every_op_s_cases_through_its_definition(name: str) -> None:
    from tactix.registry import get_registry
    from tactix.testing.plugin import KIT_FIXTURES

    op = OPS[name]
    assert op.kit_family in {family for family, _ in KIT_FIXTURES.values()}
    cases = op.kit_cases(get_registry().get("torch").spec.implements[name])
    assert cases and all(case.op == name for case in cases)
    assert len({case.id for case in cases}) == len(cases)
