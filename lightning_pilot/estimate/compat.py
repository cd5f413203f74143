"""Third-party patches a session needs: modules imported during a session run outside the
fake mode and the recorder (:class:`_ImportsOutsideTheTrace`), ``transformers`` reads the
real values of shadowed fake tensors, and a factory builds and converts its module under
the fake mode (:func:`_factory_build`).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from lightning_pilot.estimate.shadows import _SHADOW

_IMPORT_UTILS: Final = "transformers.utils.import_utils"


class _ImportsOutsideTheTrace(importlib.abc.MetaPathFinder):
    """A module imported during a session runs its body outside the fake mode and the recorder
    (its module-level tensors real, not counted), then ``on_import(name, module)`` is called;
    the other finders find it, only their loader's ``exec_module`` is wrapped."""

    def __init__(self, on_import: Callable[[str, Any], None]) -> None:
        self.on_import = on_import
        self.active = True
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not self.active or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._finding.discard(fullname)
        loader = getattr(spec, "loader", None)
        execute = getattr(loader, "exec_module", None)
        if spec is None or execute is None:
            return spec
        finder = self

        def exec_module(module: Any) -> None:
            if not finder.active:
                execute(module)
                return
            with _disable_current_modes():
                execute(module)
            finder.on_import(fullname, module)

        # A loader that takes no attribute: imported as it is.
        with contextlib.suppress(AttributeError):
            loader.exec_module = exec_module  # type: ignore[union-attr]
        return spec


@contextlib.contextmanager
def _transformers_sees_real_values() -> Iterator[None]:
    """For the session, ``transformers`` does not see a fake tensor carrying its real values as
    fake (it would build the causal mask a real run skips after ``attention_mask.all()``),
    whether it is imported before the session or during it; nothing imports it here."""
    patched: list[tuple[Any, Any]] = []

    def patch(utils: Any) -> None:
        original = getattr(utils, "is_fake_tensor", None)
        if original is None or any(u is utils for u, _ in patched):
            return

        def is_fake_tensor(value: Any) -> bool:
            return bool(original(value)) and getattr(value, _SHADOW, None) is None

        utils.is_fake_tensor = is_fake_tensor
        patched.append((utils, original))

    def on_import(name: str, module: Any) -> None:
        if name == _IMPORT_UTILS:
            patch(module)

    utils: Any = sys.modules.get(_IMPORT_UTILS)
    if utils is not None:
        patch(utils)
    with _disable_current_modes():  # imports what it needs now, not from the hook
        pass
    hook = _ImportsOutsideTheTrace(on_import)
    sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        hook.active = False
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        for module, original in reversed(patched):
            module.is_fake_tensor = original


@contextlib.contextmanager
def _factory_build() -> Iterator[None]:
    """What a factory needs to build its module under the fake mode, for the duration.

    ``torch.nn.init``'s truncated normal redraws until ``mask.any()`` is false, a value a fake
    tensor lacks: on a fake tensor it draws once and clamps (patched in the module's globals,
    so copies taken at import, as ``transformers.initialization``'s, run it too).

    ``torch.utils.swap_tensors`` (what ``Module.to`` does on fake parameters) refuses a tensor
    with a weak reference, which the fake mode's memo holds ("Couldn't swap Linear.weight"):
    the memo's entries for the two tensors are dropped first."""
    from torch.nn import init

    original = getattr(init, "_no_grad_trunc_normal_", None)
    swap = torch.utils.swap_tensors

    def trunc_normal(
        tensor: Any, mean: float, std: float, a: float, b: float, generator: Any = None
    ) -> Any:
        if not isinstance(tensor, FakeTensor):
            assert original is not None
            return original(tensor, mean, std, a, b, generator=generator)
        with torch.no_grad():
            return tensor.normal_(mean, std, generator=generator).clamp_(min=a, max=b)

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for tensor in (t1, t2):
            if isinstance(tensor, FakeTensor) and weakref.getweakrefcount(tensor):
                memo = tensor.fake_mode.fake_tensor_converter.tensor_memo
                for key in [k for k, v in list(memo.items()) if v is tensor]:
                    del memo[key]
        swap(t1, t2)  # type: ignore[no-untyped-call]

    if original is not None:
        init._no_grad_trunc_normal_ = trunc_normal
    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap
        if original is not None:
            init._no_grad_trunc_normal_ = original
