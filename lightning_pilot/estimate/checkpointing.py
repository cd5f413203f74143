"""Activation checkpointing for a trace: every block recomputed (Hugging Face's and diffusers'
own switches, or ``torch.utils.checkpoint`` around named block classes) or per operator.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch

from lightning_pilot.core import validate


def _hf_models(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost Hugging Face models inside ``module`` that support checkpointing:
    ``transformers`` models and ``diffusers`` models (UNets, transformers of images)."""
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside:
            continue
        transformers = getattr(sub, "supports_gradient_checkpointing", False) and hasattr(
            sub, "gradient_checkpointing_enable"
        )
        if transformers or _is_diffusers(sub):
            found.append(sub)
            inside.update(id(m) for m in sub.modules())
    return found


def _is_diffusers(model: torch.nn.Module) -> bool:
    """A ``diffusers`` model that supports checkpointing (``enable_gradient_checkpointing``)."""
    return bool(getattr(model, "_supports_gradient_checkpointing", False)) and hasattr(
        model, "enable_gradient_checkpointing"
    )


def selective_checkpoint_context() -> Any:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for per-operator selective
    activation checkpointing as torchtitan's ``op`` mode does it
    (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of matrix
    products (``aten.mm``, every other one: odd ones saved, even ones recomputed), of fused
    attention (flash, memory-efficient, cuDNN and the CPU stand-in :func:`cuda_attention`
    uses) and of ``aten.max`` are saved; everything else is recomputed in the backward pass."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    mm = aten.mm.default
    saved = {
        mm,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.max.default,
    }
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func is mm:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]


def _checkpointing_choice(owner: str, value: Any) -> bool | str:
    if isinstance(value, bool) or (isinstance(value, str) and value == "selective"):
        return value
    raise ValueError(validate.invalid(owner, "checkpointing", value, "False, True or 'selective'"))


@contextlib.contextmanager
def activation_checkpointing(
    module: torch.nn.Module, classes: tuple[type[torch.nn.Module], ...], selective: bool = False
) -> Iterator[str]:
    """Activation checkpointing on ``module`` for the duration, then exactly what was there:
    every instance of ``classes`` under non-reentrant ``torch.utils.checkpoint``, else the
    Hugging Face models inside switched with their own methods; ``selective`` per operator
    (:func:`selective_checkpoint_context`). Yields how."""
    undo: list[Callable[[], None]] = []
    try:
        if classes:
            how = "torch.utils.checkpoint around " + ", ".join(c.__name__ for c in classes)
            for sub in module.modules():
                if isinstance(sub, classes):
                    undo.append(_wrap_forward(sub, selective))
            if not undo:
                raise ValueError(f"no submodule is an instance of {[c.__name__ for c in classes]}")
        else:
            models = _hf_models(module)
            if not models:
                raise ValueError(
                    "activation checkpointing needs checkpoint_classes (the module classes to"
                    " wrap) for a module without a Hugging Face model inside: pass"
                    " estimate(checkpoint_classes=[YourBlock]) (TargetEstimator: the same"
                    " argument; the CLI: --checkpoint-class package.module:YourBlock)"
                )
            how = "Hugging Face gradient_checkpointing_enable(use_reentrant=False)"
            if all(_is_diffusers(model) for model in models):
                how = "diffusers enable_gradient_checkpointing (use_reentrant=False)"
            for model in models:
                if _hf_checkpointing(model):
                    continue
                undo.append(_hf_disable(model))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _hf_call(model, "enable", selective)
        if selective:
            how += (
                ", selective per operator (matrix products, every other one, and attention"
                " saved; the rest recomputed)"
            )
        yield how
    finally:
        for step in reversed(undo):
            step()


_HOOK_DICTS: Final = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def _hf_checkpointing(model: torch.nn.Module) -> bool:
    """Whether a Hugging Face model has activation checkpointing on (either spelling)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _hf_call(model: Any, what: str, selective: bool = False) -> None:
    """Switch checkpointing on (non-reentrant) or off: ``activation_checkpointing_*`` where it
    exists (transformers 5), else ``gradient_checkpointing_*``, or diffusers' methods."""
    if not hasattr(model, f"gradient_checkpointing_{what}") and _is_diffusers(model):
        if what != "enable":
            model.disable_gradient_checkpointing()
            return

        def run(block: Any, *args: Any) -> Any:
            return _checkpointed(block.__call__, selective)(*args)

        model.enable_gradient_checkpointing(gradient_checkpointing_func=run)
        return
    new = getattr(model, f"activation_checkpointing_{what}", None)
    old = getattr(model, f"gradient_checkpointing_{what}")
    kwargs: dict[str, Any] = {}
    if what == "enable":
        key = "activation_checkpointing_kwargs" if new else "gradient_checkpointing_kwargs"
        kwargs[key] = {"use_reentrant": False}
        if selective:
            kwargs[key]["context_fn"] = selective_checkpoint_context
    (new or old)(**kwargs)


def _hf_disable(model: torch.nn.Module) -> Callable[[], None]:
    """What switches checkpointing off again and removes what switching it on left: the
    input-gradient hook on the embeddings, new attributes, the ``use_cache`` setting."""
    kept = []
    for sub in model.modules():
        hooks = {name: set(getattr(sub, name, {})) for name in _HOOK_DICTS}
        kept.append((sub, set(vars(sub)), hooks))
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)

    def disable() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _hf_call(model, "disable")
        for sub, names, hooks in kept:
            for name in set(vars(sub)) - names:
                delattr(sub, name)
            for name, keys in hooks.items():
                table: Any = getattr(sub, name, None) or {}
                for key in set(table) - keys:
                    del table[key]
        if config is not None and use_cache is not None:
            config.use_cache = use_cache

    return disable


def _checkpointed(function: Callable[..., Any], selective: bool) -> Callable[..., Any]:
    """``function`` run under non-reentrant ``torch.utils.checkpoint`` (any keyword passes)."""
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    context_fn = selective_checkpoint_context if selective else noop_context_fn

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def _wrap_forward(sub: torch.nn.Module, selective: bool = False) -> Callable[[], None]:
    had = "forward" in sub.__dict__
    before = sub.__dict__.get("forward")
    sub.forward = _checkpointed(sub.forward, selective)

    def restore() -> None:
        if had:
            setattr(sub, "forward", before)  # noqa: B010
        else:
            del sub.forward

    return restore
