"""Which module and which source line a communication belongs to, looked up when it happens.

* site — ``file.py:LINE Qualified.function`` of the innermost frame outside torch, paraloom,
  the standard library and decorator shims (``typing_extensions``); the path relative to the
  working directory when it is below it. Whether a code object is skipped, and the text of each
  (code object, instruction), are computed once.
* module — a path from the outermost module's ``named_modules`` (``layers.0.mlp.fc1``). While a
  forward runs it is the innermost module whose ``__call__`` is on the stack: the frames of
  ``nn.Module._call_impl`` above the collective, each holding its module as ``self`` (so no
  module hook runs on the way, and a module call costs what it costs without the recorder). A
  module first seen below no named one is named from its nearest named parent and its class.
  In backward the autograd node being run tells (:mod:`.tracking`).

How the tracker learns and then runs lean is :class:`Attribution`'s (and :mod:`.tracking`'s
docstring says what it costs).
"""

from __future__ import annotations

import os
import sysconfig
import weakref

import torch
from torch import nn
from torch.nn.modules import module as nn_module

import paraloom

__all__ = ["Attribution", "Names", "locate", "mark", "KEY", "ACCUMULATE_GRAD"]

KEY = "paraloom.module"  # autograd node metadata: the module whose forward made the node
ACCUMULATE_GRAD = type(torch.zeros(1, requires_grad=True).expand(1).grad_fn.next_functions[0][0])
_CALL_IMPL = nn.Module._call_impl.__code__
_TORCH_PARALOOM = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, paraloom))
_SKIP_DIRS = (sysconfig.get_paths()["stdlib"] + os.sep,)  # runpy, contextlib, functools
_PACKAGES = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})
_SKIP_FILES = ("typing_extensions.py",)  # its @deprecated wraps Megatron-Core's functions
_REL: dict = {}  # code object -> its file as a site shows it, or None: skipped
_SITES: dict = {}  # (code object, instruction offset) -> site text (no line lookup when known)


def _rel(code) -> str | None:
    """The file of ``code`` as a site shows it, or None when its frames are skipped."""
    try:
        return _REL[code]
    except KeyError:
        pass
    filename = code.co_filename
    skip = (filename.startswith(_SKIP_DIRS) and not filename.startswith(_PACKAGES)) \
        or filename.startswith(_TORCH_PARALOOM) or filename.startswith("<") \
        or os.path.basename(filename) in _SKIP_FILES
    rel = None if skip else filename.removeprefix(os.getcwd() + os.sep)
    _REL[code] = rel
    return rel


def locate(frame, modules: bool) -> tuple[str, object]:
    """Walk out from ``frame``: the site, and (``modules``) the innermost frame of
    ``nn.Module._call_impl`` (``None``: no module's forward is running)."""
    site = call = None
    while frame is not None:
        code = frame.f_code
        if code is _CALL_IMPL:
            if modules and call is None:
                call = frame
                if site is not None:
                    break
        elif site is None:
            rel = _REL.get(code, _rel)  # inline: a walk passes ~20 frames of torch's code
            if rel is _rel:
                rel = _rel(code)
            if rel is not None:
                key = (code, frame.f_lasti)
                site = _SITES.get(key)
                if site is None:
                    site = _SITES[key] = f"{rel}:{frame.f_lineno} {code.co_qualname}"
                if call is not None or not modules:
                    break
        frame = frame.f_back
    return site or "<no Python caller>", call


class Names:
    """Module paths and parameter owners, learnt from each outermost module seen."""

    def __init__(self) -> None:
        self.paths: dict[int, str] = {}  # id(module) -> path
        self.params: dict[int, str] = {}  # id(parameter) -> path of the module that owns it
        self.modules: dict[str, list] = {}  # path -> weak references to the modules of it
        """Several outermost modules name their submodules alike (two ``Sequential`` roots
        both have a ``0``): a path can stand for several modules."""

    def name(self, module, parent: str | None) -> str:
        """The path of ``module``, called inside the module named ``parent`` (None: outermost;
        then it is a root, and its submodules and parameters are named from it)."""
        path = self.paths.get(id(module))
        if path is not None:
            return path
        if parent is not None:  # not below a module seen as a root: name it by its class
            path = self.paths[id(module)] = f"{parent}.{type(module).__name__}"
            self.modules.setdefault(path, []).append(weakref.ref(module))
            return path
        root = type(module).__name__
        for name, sub in module.named_modules():
            if id(sub) not in self.paths:
                self.paths[id(sub)] = name or root
                self.modules.setdefault(name or root, []).append(weakref.ref(sub))
        for name, param in module.named_parameters():
            owner = name.rpartition(".")[0]
            self.params.setdefault(id(param), owner or root)
        return self.paths[id(module)]

    def of_call(self, call) -> str:
        """The path of the module of ``call``, an ``nn.Module._call_impl`` frame (:func:`locate`);
        an unknown one is named from its outermost caller down, as a stack of calls would be."""
        module = call.f_locals.get("self")
        path = self.paths.get(id(module))
        if path is not None:
            return path
        chain = []
        frame = call
        while frame is not None:
            if frame.f_code is _CALL_IMPL:
                chain.append(frame.f_locals.get("self"))
            frame = frame.f_back
        parent = None
        for outer in reversed(chain):
            parent = self.name(outer, parent)
        return parent


def mark(output, path: str | None) -> None:
    """Give the autograd nodes of a module's outputs the module's path (the node's own
    metadata: it lives and dies with the node; the innermost module marks first)."""
    for out in output if isinstance(output, (tuple, list)) else (output,):
        fn = getattr(out, "grad_fn", None)
        if fn is not None:
            fn.metadata.setdefault(KEY, path)


class Attribution:
    """The module side of the tracker: learning with global module hooks (``stack`` holds the
    running forwards' paths, every output's node is marked), then lean from step ``lean_from``
    (None: never): the global hooks off, forward hooks only on the modules whose nodes
    communicated in backward (``mark``), and a one-shot global pre-hook ``first``, armed after
    each optimizer step, for the next iteration's first forward. A backward collective at a
    node lean cannot attribute, of a kind learning could, makes the next iteration learn again
    (each kind at most once, so it settles)."""

    def __init__(self, *, lean_from: int | None, pre, post, first) -> None:
        self.names = Names()
        self.stack: list[str] = []  # while learning: the paths of the running forwards
        self.lean = False
        self._lean_from = lean_from
        self._pre, self._post, self._first = pre, post, first
        self._learning: list = []  # the global module hooks, while learning
        self._first_hook = None
        self._tag_hooks: list = []
        self._relearn = False
        self._tags: set[str] = set()  # modules whose nodes communicated in backward
        self._unattributed: set[type] = set()  # node kinds no module made, as learning saw

    def backward(self, node) -> str | None:
        """The module whose forward made ``node`` (or owns the parameter it accumulates into);
        learning remembers which modules and which node kinds that takes."""
        if node is None:
            return None
        if type(node) is ACCUMULATE_GRAD:  # a parameter's: never marked (leaves have no node)
            path = self.names.params.get(id(node.variable))
        else:
            path = node.metadata.get(KEY)
            if path is not None:
                if not self.lean:
                    self._tags.add(path)
                return path
        if path is None:
            if not self.lean:
                self._unattributed.add(type(node))
            elif type(node) not in self._unattributed:
                self._relearn = True
        return path

    def learn(self) -> None:
        self._untag()
        self.disarm()
        self.lean = False
        if not self._learning:
            self._learning = [
                nn_module.register_module_forward_pre_hook(self._pre),
                nn_module.register_module_forward_hook(self._post, always_call=True)]

    def at_iteration(self, step: int) -> None:
        """An iteration begins: learn again if lean met something new, else go lean once
        learning has seen its iterations."""
        if self._lean_from is None:
            return
        if self.lean and self._relearn:
            self._relearn = False
            self.learn()
            self._lean_from = step + 1
        elif not self.lean and step >= self._lean_from:
            self._unlearn()
            self.lean = True
            for path in sorted(self._tags):
                for ref in self.names.modules.get(path, ()):
                    module = ref()
                    if module is not None:
                        self._tag_hooks.append(module.register_forward_hook(self._tag))

    def arm(self) -> None:
        if self.lean and self._first_hook is None:
            self._first_hook = nn_module.register_module_forward_pre_hook(self._first)

    def disarm(self) -> None:
        if self._first_hook is not None:
            self._first_hook.remove()
            self._first_hook = None

    def close(self) -> None:
        self._unlearn()
        self._untag()
        self.disarm()

    def _tag(self, module, args, output) -> None:
        mark(output, self.names.paths.get(id(module)))

    def _unlearn(self) -> None:
        for handle in self._learning:
            handle.remove()
        self._learning = []
        self.stack = []

    def _untag(self) -> None:
        for handle in self._tag_hooks:
            handle.remove()
        self._tag_hooks = []
