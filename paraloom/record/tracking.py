"""Where the program is when it communicates: phase, step, module and source site.

* phase — ``setup`` before the program's first iteration (see step); ``optimizer`` between a
  ``torch.optim.Optimizer``'s step pre- and post-hooks (global hooks, so every optimizer is
  seen) or inside a region a framework adapter marks (:meth:`Tracker.enter`: Megatron-Core's
  optimizer ``step()`` and ``finalize_model_grads``, see :mod:`.megatron_step`); ``backward``
  while the autograd engine runs a graph task on this thread
  (``torch._C._current_graph_task_id() != -1``; true on autograd's device threads too, and
  during activation recomputation); ``forward`` while an ``nn.Module``'s forward runs; else
  ``other`` (pipeline schedules' sends and receives get the role of the schedule code that made
  them, see :mod:`.pipeline`). Nothing is guessed from names.
* step — the training-loop iteration, counted from 1 (Megatron's iteration numbers). An
  iteration is everything the loop does from its first forward to the first forward after its
  optimizer step, so what runs after torch's inner
  ``step()`` (an optimizer wrapper's parameter all-gathers, the loop's agreement on the update
  and its loss reduction) belongs to the step it follows. It begins at the first module forward
  after an optimizer step (or at the entry into Megatron-Core's schedule, which calls the data
  iterator before the model). Communication before the first iteration is phase ``setup`` of
  step 0. A step without any module forward (a program of bare collectives) ends at its
  optimizer step, as the hooks see it. Loops that fit neither rule (several optimizers stepped at
  different times, evaluation forwards between steps that must not start a step) call
  :func:`paraloom.record.mark_step` at the top of each iteration instead: from the first call
  on, only the calls move the step (the first ends ``setup``).
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
                 on_optimizer_done=None, on_setup_end=None, ledger=None) -> None:
        self.step = 0  # setup; the first iteration is step 1
        self.setup = True  # before the first iteration
        self._optimizer = 0
        self._regions: list[str] = []  # phases of framework regions (Megatron's optimizer)
        self._stepped = False  # the optimizer stepped: the next forward begins an iteration
        self._forwarded = False  # a module forward ran in this iteration
        self._explicit = False  # the program marks its iterations (mark_step)
        self._on_setup_end = on_setup_end
        self._on_optimizer_done = on_optimizer_done
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
        """Where the program is now (the module docstring); ``setup`` is the caller's to apply
        (:attr:`setup`), as a setup may end without a forward and keep its true phases."""
        if self._optimizer:
            return "optimizer"
        if self._regions:
            return self._regions[-1]
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

    def param_grad(self) -> bool:
        """Whether backward is accumulating a parameter's gradient right now (the autograd node
        is an ``AccumulateGrad``: where DDP's bucket hooks fire)."""
        node = torch._C._current_autograd_node()
        return node is not None and type(node).__name__ == "AccumulateGrad"

    # -- iterations ------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """A framework region of ``phase`` begins (nested regions: the innermost wins)."""
        self._regions.append(phase)

    def leave(self) -> None:
        if self._regions:
            self._regions.pop()

    def in_region(self) -> bool:
        """Inside an optimizer step or a framework region."""
        return bool(self._regions or self._optimizer)

    def iteration_begins(self, explicit: bool = False) -> None:
        """An iteration may begin here: the first forward after an optimizer step, a schedule's
        entry, or (``explicit``) the program's own mark."""
        if explicit:
            self._explicit = True
        elif self._explicit:
            return
        if self.setup:
            self._end_setup(True)
        elif self._stepped or explicit:
            self._stepped = False
            self.step += 1
            if self._on_step is not None:
                self._on_step(self.step)
        self._forwarded = True

    def _end_setup(self, by_forward: bool) -> None:
        """Setup is over: step 1 begins (``by_forward``) or, at an optimizer step without any
        forward, it was step 1 all along (``on_setup_end`` is told which)."""
        self.setup = False
        self.step = 1
        if self._on_setup_end is not None:
            self._on_setup_end(by_forward)

    def _optimizer_stepped(self) -> None:
        if self._explicit or self._stepped:  # a second optimizer of the same iteration
            return
        if not self._forwarded:  # no forward in this iteration: the step ends right here
            if self.setup:  # what looked like setup was step 1
                self._end_setup(False)
            self.step += 1
            if self._on_step is not None:
                self._on_step(self.step)
            return
        self._stepped = True
        self._forwarded = False

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
        if not self._stack and not self._optimizer:
            if self._stepped or self.setup:
                self.iteration_begins()
            self._forwarded = True
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
                span["t_wait"] = span["t_end"] = self._ledger.stamp()
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
                event["t_wait"] = event["t_end"] = self._ledger.stamp()
                break

    def _opt_pre(self, optimizer, args, kwargs) -> None:
        self._optimizer += 1
        if self._on_optimizer is not None:
            self._on_optimizer()

    def _opt_post(self, optimizer, args, kwargs) -> None:
        self._optimizer -= 1
        if self._optimizer == 0:
            self._optimizer_stepped()
            if self._on_optimizer_done is not None:
                self._on_optimizer_done()
