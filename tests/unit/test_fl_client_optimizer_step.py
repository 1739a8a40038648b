"""The lean step's optimiser calls without torch's profiler scope.

:func:`speechbrain_fl.fl.lean_step._optimizer_step` and ``_zero_grad_to_none`` must do what
``opt.step()`` and ``opt.zero_grad(set_to_none=True)`` do (the same parameters and state, bit
for bit), and hand over to them where a hook or a profiler observes the step.
"""

from __future__ import annotations

import pytest
import torch
import torch.optim.optimizer as optim_module

from speechbrain_fl.fl.lean_step import _optimizer_step, _zero_grad_to_none


def _setup(opt_class, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    return model, opt_class(model.parameters())


def _train(model, opt, step, zero, steps=5):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=gen)
        model(x).pow(2).mean().backward()
        step(opt)
        zero(opt)


OPTIMISERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
}


@pytest.mark.parametrize("name", OPTIMISERS)
def test_same_parameters_and_state_as_torchs_calls(name):
    ref_model, ref_opt = _setup(OPTIMISERS[name])
    _train(ref_model, ref_opt, lambda o: o.step(), lambda o: o.zero_grad(set_to_none=True))
    model, opt = _setup(OPTIMISERS[name])
    _train(model, opt, _optimizer_step, _zero_grad_to_none)
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q) and q.grad is None
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        for key, value in ref_opt.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt.state[q][key]))


def test_hooks_are_called():
    model, opt = _setup(OPTIMISERS["sgd"])
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    _train(model, opt, _optimizer_step, _zero_grad_to_none, steps=2)
    assert seen == ["pre", "post", "pre", "post"]
    handle = optim_module.register_optimizer_step_post_hook(
        lambda o, args, kwargs: seen.append("global")
    )
    try:
        model, opt = _setup(OPTIMISERS["sgd"])
        _train(model, opt, _optimizer_step, _zero_grad_to_none, steps=1)
    finally:
        handle.remove()
    assert seen[-1] == "global"


def test_a_profiler_sees_the_optimisers_scopes():
    model, opt = _setup(OPTIMISERS["sgd"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train(model, opt, _optimizer_step, _zero_grad_to_none, steps=1)
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#SGD.step" in names
    assert "Optimizer.zero_grad#SGD.zero_grad" in names


def test_an_optimisers_own_zero_grad_is_called():
    class Own(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none=True):
            Own.calls += 1
            super().zero_grad(set_to_none=set_to_none)

    model, opt = _setup(lambda p: Own(p, lr=0.1))
    _train(model, opt, _optimizer_step, _zero_grad_to_none, steps=3)
    assert Own.calls == 3


def test_an_lr_schedulers_step_wrapper_is_called():
    """An LR scheduler wraps ``opt.step`` on the instance to note that it ran: kept."""
    import warnings

    model, opt = _setup(OPTIMISERS["sgd"])
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(model, opt, _optimizer_step, _zero_grad_to_none, steps=1)
    assert getattr(opt, "_opt_called", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" if not
        scheduler.step()
