"""One callback through which Lightning reaches every per-batch hook of ae's callbacks.

Lightning dispatches each hook to each callback on its own: a profiler context, the callback's
state key, its `lightning_module` looked up again, about a dozen Python calls (~4 us here) before
the hook's first line (docs/BENCHMARKS.md). For ae's callbacks, with 13 per-batch hooks doing work
a step, that dispatch cost more than most of the work. `BatchHooks` takes the
per-batch hooks (`PER_BATCH_HOOKS`) of the callbacks it is given off Lightning's dispatch and calls
them itself, in the callbacks' order: Lightning then dispatches each per-batch hook once, to this
callback, and only the hooks that some callback does work in. The callbacks stay in the
trainer's list for their other hooks (setup, resume, epoch ends, what they add to a checkpoint),
which run once per epoch or per run.

Lightning skips a hook attribute that is not callable, so each routed hook is set to None on the
callback instance (its class keeps the method: a callback used alone, outside `route`, is
unchanged). A hook called through here runs while Lightning's `_current_fx_name` is that same
hook, so a `self.log` inside it is checked as Lightning would check it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L

# The hooks Lightning calls on every callback at every training batch (and validation batch).
PER_BATCH_HOOKS = (
    "on_train_batch_start", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end",
    "on_validation_batch_start", "on_validation_batch_end",
)  # fmt: skip


def _overrides(callback: L.Callback, hook: str) -> bool:
    return getattr(type(callback), hook) is not getattr(L.Callback, hook)


class BatchHooks(L.Callback):
    """Calls the per-batch hooks of `callbacks` in their order; placed after them (built by
    `route`), so a callback outside them that comes later still sees their work done."""

    def __init__(self, callbacks: list[L.Callback]) -> None:
        self.calls: dict[str, list[Callable[..., Any]]] = {}
        for hook in PER_BATCH_HOOKS:
            doers = [getattr(cb, hook) for cb in callbacks if _overrides(cb, hook)]
            for cb in callbacks:
                setattr(cb, hook, None)
            if doers:
                self.calls[hook] = doers
            else:  # nobody does work there: Lightning skips it for this callback too
                setattr(self, hook, None)


def _dispatcher(hook: str) -> Callable[..., None]:
    """The method for `hook`: a loop over its doers, with no shared helper in between (that
    would be one more Python call per hook per batch)."""

    def call(self: BatchHooks, *args: Any, **kwargs: Any) -> None:
        for fn in self.calls[hook]:
            fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = hook
    return call


for _hook in PER_BATCH_HOOKS:  # one method per hook, from the one list of them
    setattr(BatchHooks, _hook, _dispatcher(_hook))


def route(callbacks: list[L.Callback]) -> list[L.Callback]:
    """`callbacks`, their per-batch hooks taken off Lightning's dispatch, and the `BatchHooks`
    that calls those hooks, last."""
    return [*callbacks, BatchHooks(callbacks)]
