"""register_fsdp_forward_method on a method that calls the module itself (``generate``, a
Lightning step): same loss and gradients as one process, and training goes on."""

from __future__ import annotations

import pytest
import torch

from .harness import cases, section
from .models import batch, build, loss_fn


def _reference() -> tuple[float, dict[str, torch.Tensor], float]:
    model = build()
    x, y = batch(0)
    logits = model(x) + model(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, loss_fn(model, 1).item()


@pytest.mark.parametrize(("impl", "world", "key"), cases("forward_method"))
def test_a_registered_method_may_call_the_module_itself(impl: str, world: int, key: tuple) -> None:
    loss, grads, again = _reference()
    results = section(impl, world, key)
    assert sum(r["loss"] for r in results) / world == pytest.approx(loss, rel=1e-5)
    assert sum(r["again"] for r in results) / world == pytest.approx(again, rel=1e-5)
    for name, expected in grads.items():
        torch.testing.assert_close(
            results[0]["grads"][name],
            expected,
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )
