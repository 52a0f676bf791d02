"""Lifecycle tagging from PyTorch's hooks, for the live allocator and for
recorders alike: a :class:`Tracker` tags parameters and buffers (at
``track``), gradients (post-accumulate-grad hooks), optimizer states (after
each step), activations saved for backward (``saved_tensors_hooks`` around
the forward), everything else ``temp`` (the default kind), and marks the
phases forward / backward / optimizer / step_end with the step number.

A *sink* receives the tags: ``retag(tensor, kind)``, ``key(tensor)`` (a
storage's identity), ``phase(name, step)``, ``set_default_kind(kind)``, and
the optimizer hooks ``before_step()`` / ``after_step()``.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

try:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
except ImportError:  # older torch

    def is_traceable_wrapper_subclass(t: Any) -> bool:  # type: ignore[misc]
        return False


def storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The untyped storages behind ``t`` (those of a wrapper subclass such as
    a DTensor's local shard)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for a in attrs:
            yield from storages(getattr(t, a))
    else:
        yield t.untyped_storage()


class Tracker:
    """The hooks :func:`wasmem.torch.track` installs (see the module
    documentation); ``remove()`` takes them off."""

    def __init__(self, sink: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"wasmem.torch.track: expected a torch.nn.Module, got {type(model).__name__}")
        params = list(model.parameters())
        if not params:
            raise ValueError(
                f"wasmem.torch.track: {type(model).__name__} has no parameters, so there is nothing to tag "
                "(track the model whose parameters train, after building it)"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"wasmem.torch.track: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.sink = sink
        self.model = model
        self.optimizer = optimizer
        self.step = 0
        self._in_forward = False
        self._in_backward = False
        self._handles: list[Any] = []
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._param_keys: set[Any] = set()
        sink.set_default_kind("temp")
        for t in params + list(model.buffers()):
            self._param_keys.update(sink.keys(t))
            sink.retag(t, "param")
        self._handles.append(model.register_forward_pre_hook(self._forward_pre))
        self._handles.append(model.register_forward_hook(self._forward_post))
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._step_pre))
            self._handles.append(optimizer.register_step_post_hook(self._step_post))

    # -- forward and backward ---------------------------------------------
    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._in_forward:
            return
        if self._in_backward and self.optimizer is None:
            # Without an optimizer, a forward after a backward starts a step.
            self._end_step()
        self._in_backward = False
        self.sink.phase("forward", self.step)
        self._saved.__enter__()
        self._in_forward = True

    def _forward_post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if not self._in_forward:
            return
        self._in_forward = False
        self._saved.__exit__(None, None, None)
        leaves, _ = tree_flatten(out)
        if hasattr(out, "values") and not leaves:
            leaves = list(out.values())
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_reached)
                break

    def _backward_reached(self, grad: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            self.sink.phase("backward", self.step)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and not any(k in self._param_keys for k in self.sink.keys(t)):
            self.sink.retag(t, "activation")
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def _grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.sink.retag(p.grad, "grad")

    # -- the optimizer -----------------------------------------------------
    def _step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.sink.phase("optimizer", self.step)
        self.sink.before_step()

    def _step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.sink.after_step()
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self.sink.retag(v, "optim")
        self._end_step()

    def _end_step(self) -> None:
        self.sink.phase("step_end", self.step)
        self.step += 1
        self._in_backward = False

    def remove(self) -> None:
        """Takes the hooks off (the default kind stays ``temp``)."""
        if self._in_forward:
            self._saved.__exit__(None, None, None)
            self._in_forward = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
