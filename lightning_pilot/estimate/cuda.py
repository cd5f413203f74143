"""The step as it behaves on CUDA, traced on CPU: attention through a fused kernel that saves
no T x T matrix (:func:`cuda_attention`), CUDA autocast's lists under the mixed precisions
(:func:`cuda_autocast`) and CUDA's fused dropout (:func:`cuda_dropout`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Final
from unittest import mock

import torch
from torch.utils._pytree import tree_flatten, tree_map


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` through the fused CPU kernel (:func:`cuda_attention`)."""
    if query.dim() != 4:
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)
    if enable_gqa and key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    if torch.is_autocast_enabled("cpu"):
        # scaled_dot_product_attention is on autocast's lower-precision list (CPU and CUDA);
        # the kernel called directly here is not, so cast as autocast would.
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (
            t.to(dtype) if t.is_floating_point() else t for t in (query, key, value)
        )
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(
            ~attn_mask, float("-inf")
        )
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        # A learned bias (T5's relative positions): the CPU kernel has no gradient for it.
        full = (*query.shape[:-1], key.shape[-2])
        biased: torch.Tensor = _BiasedAttention.apply(  # type: ignore[no-untyped-call]
            query, key, value, attn_mask.expand(full), scale
        )
        return biased
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out  # type: ignore[no-any-return]


class _BiasedAttention(torch.autograd.Function):
    """Fused attention whose additive bias requires a gradient, as CUDA's memory-efficient
    kernel runs it (flash attention takes no mask): the same saved tensors as the fused CPU
    kernel (the inputs, the bias, the output, one log-sum-exp per query) and, in the
    backward pass, a gradient of the full bias's shape (B x H x T x S; autograd sums it down
    to the bias's own shape). The CPU kernel computes the inputs' gradients; the bias's is
    ``P * (dO V^T - rowsum(dO * O))`` with ``P`` recomputed from the log-sum-exp, so the
    backward pass holds one T x S temporary beside it that the fused kernel keeps on chip."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: torch.Tensor,
        scale: float | None,
    ) -> torch.Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=bias, scale=scale
        )
        ctx.save_for_backward(query, key, value, bias, out, lse)
        ctx.scale = scale
        return out  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, bias, out, lse = ctx.saved_tensors
        scale = ctx.scale if ctx.scale is not None else query.shape[-1] ** -0.5
        grad = grad.contiguous()
        d_query, d_key, d_value = (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, query, key, value, out, lse, 0.0, False, attn_mask=bias, scale=ctx.scale
            )
        )
        probs = torch.matmul(query, key.transpose(-2, -1)).to(lse.dtype)
        probs.mul_(scale).add_(bias).sub_(lse.unsqueeze(-1)).exp_()
        rows = (grad.to(lse.dtype) * out).sum(-1, keepdim=True)
        d_bias = torch.matmul(grad, value.transpose(-2, -1)).to(lse.dtype)
        d_bias.sub_(rows).mul_(probs)
        del probs
        return d_query, d_key, d_value, d_bias.to(bias.dtype), None


_SDPA: Final = torch.nn.functional.scaled_dot_product_attention


def cuda_attention() -> contextlib.AbstractContextManager[Any]:
    """Attention as CUDA runs it, on CPU fake tensors, for the duration.

    CUDA's flash and memory-efficient kernels (dropout inside) save the inputs, the output and
    one log-sum-exp per query, never the T x T weights that CPU's math path saves. Every call
    of ``torch.nn.functional.scaled_dot_product_attention`` (swapped for the duration, so
    checkpointing's recomputation sees it too) goes to the fused CPU kernel
    ``_scaled_dot_product_flash_attention_for_cpu`` (the same saved tensors); dropout's
    randomness is not modelled (no memory); grouped-query attention repeats the key and value
    heads first."""
    return mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _fused_attention)


# CUDA autocast's operators per policy (PyTorch's aten/src/ATen/autocast_mode.h, the lists
# documented under "CUDA Ops that can autocast to float16 / float32" in
# https://pytorch.org/docs/stable/amp.html). Every other operator with a CUDA autocast kernel
# in the installed torch is ``fp32``. CPU autocast's lists differ (softmax, log_softmax,
# layer_norm, exp, pow, ... stay in the lower precision there).
_CUDA_LISTS: Final = {
    "lower": frozenset(
        {
            "_convolution",
            "_convolution.deprecated",
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_tbc",
            "conv_transpose1d",
            "conv_transpose2d.input",
            "conv_transpose3d.input",
            "convolution",
            "cudnn_convolution",
            "cudnn_convolution_transpose",
            "prelu",
            "addmm",
            "addmv",
            "addr",
            "matmul",
            "einsum",
            "mm",
            "mv",
            "linalg_vecdot",
            "linear",
            "addbmm",
            "baddbmm",
            "bmm",
            "chain_matmul",
            "linalg_multi_dot",
            "_thnn_fused_lstm_cell",
            "_thnn_fused_gru_cell",
            "lstm_cell",
            "gru_cell",
            "rnn_tanh_cell",
            "rnn_relu_cell",
            "_scaled_dot_product_flash_attention",
            "scaled_dot_product_attention",
        }
    ),
    "fp32_set_opt_dtype": frozenset(
        {
            "prod",
            "prod.dim_int",
            "softmax.int",
            "log_softmax.int",
            "cumprod",
            "cumsum",
            "linalg_vector_norm",
            "linalg_matrix_norm",
            "linalg_matrix_norm.str_ord",
            "sum",
            "sum.dim_IntList",
        }
    ),
    "promote": frozenset(
        {
            "addcdiv",
            "addcmul",
            "atan2",
            "bilinear",
            "cross",
            "dot",
            "vdot",
            "grid_sampler",
            "index_put",
            "tensordot",
            "scatter_add",
        }
    ),
    "banned": frozenset({"binary_cross_entropy"}),  # the message is CUDA autocast's own
}
_BANNED_MESSAGE: Final = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast."
    " Many models use a sigmoid layer right before the binary cross entropy layer. In this"
    " case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits"
    " or torch.nn.BCEWithLogitsLoss (CUDA autocast refuses binary_cross_entropy)"
)


def _autocast_ops(key: str) -> set[str]:
    names = torch._C._dispatch_get_all_op_names()
    return {
        name[len("aten::") :]
        for name in names
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    }


def cuda_autocast_policy() -> dict[str, str]:
    """``operator -> policy`` of CUDA autocast in the installed torch, for every operator with
    an autocast kernel on CPU or CUDA: ``lower`` (cast to the autocast dtype), ``fp32``,
    ``fp32_set_opt_dtype`` (``dtype=float32`` when unset: softmax, log_softmax, sum, cumsum,
    ...), ``promote`` (the widest input type), ``banned`` (CUDA autocast refuses it) or
    ``none`` (CUDA autocast leaves it alone; CPU autocast casts it).

    Example:
        >>> policy = cuda_autocast_policy()
        >>> policy["mm"], policy["softmax.int"], policy["layer_norm"], policy["cat"]
        ('lower', 'fp32_set_opt_dtype', 'fp32', 'none')
    """
    return dict(_cuda_autocast_policy())


@functools.lru_cache(maxsize=1)
def _cuda_autocast_policy() -> tuple[tuple[str, str], ...]:
    cuda = _autocast_ops("AutocastCUDA")
    policy: dict[str, str] = {}
    for name in cuda | _autocast_ops("AutocastCPU"):
        listed = (kind for kind, names in _CUDA_LISTS.items() if name in names)
        policy[name] = next(listed, "fp32") if name in cuda else "none"
    return tuple(sorted(policy.items()))


_NO_AUTOCAST_CPU: Final = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _eligible(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype is not torch.float64
    )


def _cast_all(values: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda v: v.to(dtype) if _eligible(v) and v.dtype is not dtype else v, values)


def _autocast_kernel(op: Any, policy: str) -> Callable[..., Any]:
    """A CPU autocast kernel for ``op`` that casts as CUDA autocast does (``policy``), then
    runs ``op`` with autocast off for the call (as autocast's own kernels do)."""
    dtype_index = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == "banned":
            raise RuntimeError(_BANNED_MESSAGE)
        if policy == "lower":
            args, kwargs = _cast_all((args, kwargs), torch.get_autocast_dtype("cpu"))
        elif policy == "fp32":
            args, kwargs = _cast_all((args, kwargs), torch.float32)
        elif policy == "promote":
            found = [v for v in tree_flatten((args, kwargs))[0] if _eligible(v)]
            if found:
                widest = functools.reduce(torch.promote_types, (v.dtype for v in found))
                args, kwargs = _cast_all((args, kwargs), widest)
        elif policy == "fp32_set_opt_dtype" and args and _eligible(args[0]):
            if dtype_index is not None and dtype_index < len(args):
                if args[dtype_index] is None:
                    args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST_CPU):
            return op(*args, **kwargs)

    return kernel


def _op(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


@contextlib.contextmanager
def _registered(key: str, kernels: dict[str, Callable[..., Any]]) -> Iterator[None]:
    """``kernels`` (``aten`` operator name -> kernel) registered for ``key`` for the duration."""
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name, kernel in kernels.items():
                library.impl(name, kernel, key)  # type: ignore[no-untyped-call]
        yield
    finally:
        library._destroy()  # type: ignore[no-untyped-call]


def cuda_autocast() -> contextlib.AbstractContextManager[None]:
    """CPU autocast casts each operator's inputs as CUDA autocast would
    (:func:`cuda_autocast_policy`: softmax, layer_norm, the losses ... in float32) for the
    duration, process-wide. The matrix products keep CPU autocast's own kernels (the same
    policy, and its cache of the parameters' casts); every other listed operator gets a kernel
    registered with ``torch.library`` for the ``AutocastCPU`` key, removed on exit."""
    kernels = {
        name: _autocast_kernel(_op(name), policy)
        for name, policy in cuda_autocast_policy().items()
        # CPU autocast's own kernel does the same
        if name not in _CUDA_LISTS["lower"]
        or not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCPU")
    }
    return _registered("AutocastCPU", kernels)


def _cuda_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as CUDA runs it (``aten/src/ATen/native/Dropout.cpp``): the fused
    ``native_dropout`` (its backward keeps a one-byte mask) in training with ``0 < p < 1`` and
    a non-empty input; else as on CPU."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]  # type: ignore[no-any-return]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype, device=input.device)


def cuda_dropout() -> contextlib.AbstractContextManager[None]:
    """``torch.nn.functional.dropout`` runs CUDA's fused kernel (:func:`_cuda_dropout`, a
    one-byte mask saved where CPU saves a noise tensor of the input's dtype) for the duration,
    process-wide (a ``torch.library`` kernel for ``AutogradCPU``, removed on exit)."""
    return _registered("AutogradCPU", {"dropout": _cuda_dropout})
