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
  innermost module whose forward is running (:mod:`.attribution`); in backward, the module whose
  forward produced the autograd node being run (its output's ``grad_fn``), or the owner of the
  parameter whose gradient is being accumulated (DDP's bucket hooks fire there).
* site — see :mod:`.attribution`.

What it costs. Global module hooks would push every ``Module.__call__`` of the program onto
torch's slow path (measured: +6 us a call). They are installed only while the tracker learns:
during setup and step 1 (and for one more iteration whenever a backward collective meets an
autograd node of a kind it has not learnt), and always with ``compute``. Outside, the program
runs its modules hook-free: a forward's module is read from the frames at the collective, the
first module call after an optimizer step (which begins an iteration) is caught by a one-shot
global pre-hook that removes itself, and the backward attribution is kept by forward hooks on
just the modules whose nodes communicated in backward while learning.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim

from .attribution import Attribution, locate, mark

__all__ = ["Tracker"]


class Tracker:
    """Module and optimizer hooks that keep phase, step and module current."""

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
        self._on_step = on_step
        self._on_optimizer = on_optimizer
        self._compute = compute
        self._ledger = ledger
        self._spans: list = []
        self._handles: list = []  # optimizer (and compute's backward) hooks: always on
        self.modules = Attribution(lean_from=None if compute else 2, pre=self._pre,
                                   post=self._post, first=self._first)

    def install(self) -> None:
        self._handles = [optim.register_optimizer_step_pre_hook(self._opt_pre),
                         optim.register_optimizer_step_post_hook(self._opt_post)]
        if self._compute:  # our own hooks make torch warn about modules without grad inputs
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            self._handles += [
                nn_module.register_module_full_backward_pre_hook(self._bwd_pre),
                nn_module.register_module_full_backward_hook(self._bwd_post)]
        self.modules.learn()

    def uninstall(self) -> None:
        self.modules.close()
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
        if not self.modules.lean:
            return "forward" if self.modules.stack else "other"
        return "forward" if locate(sys._getframe(1), True)[1] is not None else "other"

    def where(self, frame) -> tuple[str, str | None, str, object]:
        """Phase, module, site and (in backward) autograd node of a communication launched now
        by ``frame``'s code."""
        if self._optimizer:
            phase = "optimizer"
        elif self._regions:
            phase = self._regions[-1]
        elif torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            return "backward", self.modules.backward(node), locate(frame, False)[0], node
        else:
            phase = None  # forward or other
        modules = self.modules
        if not modules.lean:
            module = modules.stack[-1] if modules.stack else None
            return phase or ("forward" if module else "other"), module, \
                locate(frame, False)[0], None
        site, call = locate(frame, True)
        module = None if call is None else modules.names.of_call(call)
        return phase or ("forward" if call is not None else "other"), module, site, None

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
            self.modules.at_iteration(self.step)
        elif self._stepped or explicit:
            self._stepped = False
            self.step += 1
            self.modules.at_iteration(self.step)
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
            self.modules.at_iteration(self.step)
            self.modules.arm()
            if self._on_step is not None:
                self._on_step(self.step)
            return
        self._stepped = True
        self._forwarded = False
        self.modules.arm()

    # -- hooks -----------------------------------------------------------------------------
    def _first(self, module, args) -> None:
        """Lean: the first module call since an optimizer step (a one-shot global hook)."""
        if not self._optimizer:
            self.modules.disarm()
            self._pre(module, args)

    def _pre(self, module, args) -> None:
        modules = self.modules
        if not modules.stack and not self._optimizer:
            if self._stepped or self.setup:
                self.iteration_begins()  # may switch between learning and lean
            self._forwarded = True
        if modules.lean:
            return
        path = modules.names.name(module, modules.stack[-1] if modules.stack else None)
        modules.stack.append(path)
        if self._compute and self._ledger is not None and not module._modules:
            self._spans.append(self._ledger.record(
                op="compute", phase=self.phase(), kind="compute",
                site=f"{type(module).__name__}.forward", module=path))

    def _post(self, module, args, output) -> None:
        if self.modules.stack:
            path = self.modules.stack.pop()
            if self._spans and self._spans[-1]["module"] == path and not module._modules:
                span = self._spans.pop()
                span["t_wait"] = span["t_end"] = self._ledger.stamp()
            mark(output, path)

    def _bwd_pre(self, module, grad_output) -> None:
        if self._compute and self._ledger is not None and not module._modules:
            path = self.modules.names.paths.get(id(module))
            self._ledger.record(op="compute", phase="backward", kind="compute",
                                site=f"{type(module).__name__}.backward", module=path)

    def _bwd_post(self, module, grad_input, grad_output) -> None:
        if self._ledger is None or module._modules:
            return
        path = self.modules.names.paths.get(id(module))
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
