"""Where the program is when it communicates: phase, step, module and source site.

* phase — ``optimizer`` between a ``torch.optim.Optimizer``'s step pre- and post-hooks (global
  hooks, so every optimizer is seen), ``backward`` while the autograd engine runs a graph task on
  this thread (``torch._C._current_graph_task_id() != -1``; true on autograd's device threads
  too, and during activation recomputation), ``forward`` while an ``nn.Module``'s forward runs,
  else ``other`` (``torch.distributed.pipelining``'s sends and receives: the role of the stage
  method that made them, see :mod:`.pipeline`). Nothing is guessed from names.
* step — optimizer steps seen so far (post-hooks).
* module — the path (``layers.0.mlp.fc1``, from the outermost module's ``named_modules``) of the
  innermost module whose forward is running; in backward, the module whose forward produced the
  autograd node being run (its output's ``grad_fn``), or the owner of the parameter whose
  gradient is being accumulated (DDP's bucket hooks fire there).
* site — ``file.py:LINE Qualified.function`` of the innermost frame outside torch, paraloom,
  the standard library and decorator shims (``typing_extensions``).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim

import paraloom

__all__ = ["Tracker", "site"]

_TORCH_PARALOOM = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, paraloom))
_SKIP_DIRS = (sysconfig.get_paths()["stdlib"] + os.sep,)  # runpy, contextlib, functools
_PACKAGES = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})
_SKIP_FILES = ("typing_extensions.py",)  # its @deprecated wraps Megatron-Core's functions
_SKIP: dict[str, bool] = {}
_KEY = "paraloom.module"  # autograd node metadata: the module whose forward made the node


def _skipped(filename: str) -> bool:
    skip = _SKIP.get(filename)
    if skip is None:
        skip = _SKIP[filename] = (filename.startswith(_SKIP_DIRS)
                                  and not filename.startswith(_PACKAGES)) \
            or filename.startswith(_TORCH_PARALOOM) or filename.startswith("<") \
            or os.path.basename(filename) in _SKIP_FILES
        if not skip:
            cwd = os.getcwd() + os.sep
            _SKIP[filename + "\0rel"] = filename.removeprefix(cwd)
    return skip


def site(depth: int = 1) -> str:
    """The innermost caller outside torch and paraloom, as ``path:LINE Qualified.function``
    (the path relative to the working directory when it is below it)."""
    frame = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        if not _skipped(code.co_filename):
            return f"{_SKIP[code.co_filename + chr(0) + 'rel']}:{frame.f_lineno} " \
                   f"{code.co_qualname}"
        frame = frame.f_back
    return "<no Python caller>"


class Tracker:
    """Global module and optimizer hooks that keep phase, step and module current."""

    def __init__(self, *, compute: bool = False, on_step=None, on_optimizer=None,
                 ledger=None) -> None:
        self.step = 0
        self._optimizer = 0
        self._stack: list[str] = []
        self._names: dict[int, str] = {}
        self._params: dict[int, str] = {}
        self._on_step = on_step
        self._on_optimizer = on_optimizer
        self._compute = compute
        self._ledger = ledger
        self._spans: list = []
        self._handles: list = []

    def install(self) -> None:
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._pre),
            nn_module.register_module_forward_hook(self._post, always_call=True),
            optim.register_optimizer_step_pre_hook(self._opt_pre),
            optim.register_optimizer_step_post_hook(self._opt_post),
        ]
        if self._compute:  # our own hooks make torch warn about modules without grad inputs
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            self._handles += [
                nn_module.register_module_full_backward_pre_hook(self._bwd_pre),
                nn_module.register_module_full_backward_hook(self._bwd_post)]

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stop_compute(self) -> None:
        """Record no more compute spans (the spans already open still get their end)."""
        self._compute = False

    def phase(self) -> str:
        if self._optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward" if self._stack else "other"

    def module(self, phase: str) -> str | None:
        if phase != "backward":
            return self._stack[-1] if self._stack else None
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        path = node.metadata.get(_KEY)
        if path is None and type(node).__name__ == "AccumulateGrad":
            path = self._params.get(id(node.variable))
        return path

    # -- hooks -----------------------------------------------------------------------------
    def _name(self, module) -> str:
        path = self._names.get(id(module))
        if path is not None:
            return path
        if self._stack:  # not below a module seen as a root: name it by its class
            path = f"{self._stack[-1]}.{type(module).__name__}"
            self._names[id(module)] = path
            return path
        root = type(module).__name__
        for name, sub in module.named_modules():
            self._names.setdefault(id(sub), name or root)
        for name, param in module.named_parameters():
            owner = name.rpartition(".")[0]
            self._params.setdefault(id(param), owner or root)
        return self._names[id(module)]

    def _pre(self, module, args) -> None:
        path = self._name(module)
        self._stack.append(path)
        if self._compute and self._ledger is not None and not module._modules:
            self._spans.append(self._ledger.record(
                op="compute", phase=self.phase(), kind="compute",
                site=f"{type(module).__name__}.forward", module=path))

    def _post(self, module, args, output) -> None:
        if self._stack:
            path = self._stack.pop()
            if self._spans and self._spans[-1]["module"] == path and not module._modules:
                span = self._spans.pop()
                span["t_wait"] = span["t_end"] = self._ledger.now()
            for out in output if isinstance(output, (tuple, list)) else (output,):
                fn = getattr(out, "grad_fn", None)
                if fn is not None:  # the node's own metadata: it lives and dies with the node
                    fn.metadata.setdefault(_KEY, path)

    def _bwd_pre(self, module, grad_output) -> None:
        if self._compute and self._ledger is not None and not module._modules:
            path = self._names.get(id(module))
            self._ledger.record(op="compute", phase="backward", kind="compute",
                                site=f"{type(module).__name__}.backward", module=path)

    def _bwd_post(self, module, grad_input, grad_output) -> None:
        if self._ledger is None or module._modules:
            return
        path = self._names.get(id(module))
        for event in reversed(self._ledger.events):
            if event["op"] == "compute" and event["module"] == path \
                    and event["site"].endswith(".backward"):
                event["t_wait"] = event["t_end"] = self._ledger.now()
                break

    def _opt_pre(self, optimizer, args, kwargs) -> None:
        self._optimizer += 1
        if self._on_optimizer is not None:
            self._on_optimizer()

    def _opt_post(self, optimizer, args, kwargs) -> None:
        self._optimizer -= 1
        if self._optimizer == 0:
            self.step += 1
            if self._on_step is not None:
                self._on_step(self.step)
