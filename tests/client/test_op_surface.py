"""The op table reaches every place derived from it: each elementwise op is a Tensor method (unary),
a function of the `emberlink` namespace and an export; every op says whether it takes a gradient;
each unary op has a case row. A new elementwise primitive that misses one of these fails here."""

from __future__ import annotations

import inspect

import pytest

import emberlink as el
from emberlink.client import autograd, functions
from emberlink.client.tensor import Tensor
from emberlink.graph_replay import fusion
from emberlink.graph_replay.numpy_backend import INTO_TABLE, OP_TABLE
from emberlink.graph_replay.ops import OPS, names
from emberlink.graph_replay.plan import REUSE_OPS, VIEW_OPS
from tests.graph_replay.cases import UNARY

ELEMENTWISE = [*names("unary"), *names("binary")]


@pytest.mark.parametrize("op", ELEMENTWISE)
def test_each_elementwise_op_is_a_function_of_the_namespace_and_exported(op: str) -> None:
    fn = getattr(el, op, None)
    assert fn is not None and fn is getattr(functions, op), f"el.{op} is missing (client/functions.py)"
    assert op in el.__all__, f"{op} is missing from emberlink.__all__"
    assert fn.__name__ == op


@pytest.mark.parametrize("op", names("unary"))
def test_each_unary_op_is_a_tensor_method(op: str) -> None:
    method = inspect.getattr_static(Tensor, op, None)
    assert callable(method) and method.__name__ == op, f"Tensor.{op} is missing (client/tensor.py)"


def test_every_unary_op_but_logical_not_has_a_case_row() -> None:
    assert set(UNARY) == set(names("unary")) - {"logical_not"}


def test_the_namespace_exports_exactly_what_it_defines() -> None:
    assert sorted(el.__all__) == sorted(set(el.__all__))
    assert all(hasattr(el, name) for name in el.__all__)


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_states_its_gradient(op: str) -> None:
    d = OPS[op]
    # `grad` is a required field: an entry cannot leave it out; None says "not differentiable".
    if d.grad is None:
        assert op not in autograd.DIFFERENTIABLE
        return
    assert autograd.RULES[op] is d.grad.rule
    assert (op in autograd.SAVES_INPUTS) == d.grad.saves_inputs
    assert (op in autograd.SAVES_OUTPUT) == d.grad.saves_output


def test_derived_sets_follow_the_table() -> None:
    assert set(OP_TABLE) == set(OPS)
    assert set(INTO_TABLE) == REUSE_OPS == {n for n, d in OPS.items() if d.into}
    assert VIEW_OPS == {"reshape", "permute_dims", "broadcast_to", "expand_dims", "squeeze", "getitem"}
    assert fusion.FUSABLE_OPS == {n for n, d in OPS.items() if d.expr is not None}
    assert {n for n, d in OPS.items() if d.ref is not None} == set(ELEMENTWISE)
