"""BatchAdapter: reads the ids, inputs, targets, attention mask and sizes of any batch for the
pilot callbacks: dicts (the keys of ``_DEFAULT_KEYS``), tuples ``(x, y[, ids])`` or a bare tensor,
a dict key, tuple index or callable (or its import path) overriding any field. A field not found
is ``None``, named in :attr:`BatchView.missing`, so a callback records ``not_checked`` instead of
crashing the user's training."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from lightning_pilot.core import validate

#: How to find a field: a dict key, a tuple/list index, or a callable on the whole batch (a
#: string with a colon, ``"package.module:function"``, names the callable by import path).
FieldSpec = str | int | Callable[[Any], Any]

_FIELDS: Final = ("ids", "inputs", "targets", "attention_mask")
#: The dict keys read as a batch's inputs, the first present winning: token ids, generic names,
#: images, audio features (Whisper), waveforms (wav2vec2) and latents; every one present
#: identifies the example (:meth:`BatchAdapter.example_inputs`).
INPUT_KEYS: Final = (
    "input_ids",
    "inputs",
    "x",
    "input",
    "features",
    "pixel_values",
    "images",
    "image",
    "input_features",
    "input_values",
    "latents",
)
_DEFAULT_KEYS: Final[dict[str, tuple[str, ...]]] = {
    "ids": ("ids", "id", "idx", "index", "example_id", "example_ids"),
    "inputs": INPUT_KEYS,
    "targets": ("labels", "label", "targets", "target", "y"),
    "attention_mask": ("attention_mask",),
}
#: The dict key of an encoder-decoder's decoder inputs (the labels shifted right).
_DECODER_KEY: Final = "decoder_input_ids"
_DEFAULT_POSITIONS: Final[dict[str, int]] = {"inputs": 0, "targets": 1, "ids": 2}
_SPEC: Final = "a dict key (str), a tuple index (int), a callable batch -> value, or None"
_IMPORT_PATH: Final = (
    "'package.module:function', the import path of a callable batch -> value (a string with"
    " ':' names a function; a dict key is a string without ':')"
)


def is_int_tensor(value: Any) -> bool:
    """An integer tensor (not float, complex or bool): token ids, class labels."""
    return isinstance(value, torch.Tensor) and not (
        value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
    )


@dataclass(frozen=True)
class BatchView:
    """What an adapter read from one batch. ``None`` means "not found", never "zero"."""

    ids: Any = None
    inputs: Any = None
    targets: Any = None
    attention_mask: Any = None
    batch_size: int | None = None
    seq_len: int | None = None
    tokens: int | None = None
    loss_tokens: int | None = None
    missing: tuple[str, ...] = ()
    #: An encoder-decoder's decoder inputs (``decoder_input_ids``); not a required field, so
    #: never in :attr:`missing`.
    decoder_inputs: Any = None

    def ids_list(self) -> list[Any] | None:
        """The example ids as plain Python values (``None`` when the batch has none)."""
        if isinstance(self.ids, torch.Tensor):
            return list(self.ids.detach().cpu().reshape(-1).tolist())
        return None if self.ids is None else list(self.ids)


def _check_spec(name: str, spec: object) -> Any:
    """The spec checked; a string with a colon is the import path of the callable returned."""
    if isinstance(spec, str) and ":" in spec:
        return _imported(name, spec)
    if isinstance(spec, str) and not spec:
        raise ValueError(validate.invalid("BatchAdapter", name, spec, f"{_SPEC} (not '')"))
    if isinstance(spec, int) and not isinstance(spec, bool):
        validate.integer("BatchAdapter", name, spec, hint=_SPEC)
    elif not (spec is None or callable(spec) or isinstance(spec, str)):
        expected = f"{_SPEC} for the defaults, got {type(spec).__name__}"
        raise TypeError(validate.invalid("BatchAdapter", name, spec, expected))
    return spec


def _imported(name: str, spec: str) -> Callable[[Any], Any]:
    """The callable ``"package.module:function"`` names (:func:`pkgutil.resolve_name`)."""
    import pkgutil

    try:
        found = pkgutil.resolve_name(spec)
    except (ImportError, AttributeError, ValueError) as err:
        why = f"{_IMPORT_PATH}; this one does not import ({type(err).__name__}: {err})"
        raise ValueError(validate.invalid("BatchAdapter", name, spec, why)) from None
    if not callable(found):
        why = f"{_IMPORT_PATH}; this one names a {type(found).__name__}, which is not callable"
        raise TypeError(validate.invalid("BatchAdapter", name, spec, why))
    function: Callable[[Any], Any] = found
    return function


class BatchAdapter:
    """Read ids, inputs, targets, masks and sizes from a batch of any layout: ``ids``,
    ``inputs``, ``targets``, ``attention_mask`` (1 = real token) and ``decoder_inputs`` (default:
    the key ``decoder_input_ids``) say where each field is (``None``: the defaults);
    ``ignore_index`` is the target value the loss skips. A string with a colon is the import
    path of a callable, ``"package.module:function"``, as a LightningCLI YAML file names one
    (docs/lightning_cli.md).

    Raises:
        TypeError: a field spec that is not a str, int, callable or None (a bool is not an
            index), or an import path naming something not callable; ``ignore_index`` that is
            not an int.
        ValueError: an empty key, an import path that does not import, or an index or
            ``ignore_index`` beyond 64 bits.

    Example:
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7], [5, 6, 0]]),
        ...          "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        ...          "labels": torch.tensor([[-100, 6, 7], [-100, 6, -100]])}
        >>> view = BatchAdapter().view(batch)
        >>> view.batch_size, view.seq_len, view.tokens, view.loss_tokens, view.missing
        (2, 3, 5, 3, ('ids',))
        >>> whisper = {"input_features": torch.zeros(2, 8, 30),
        ...            "decoder_input_ids": torch.tensor([[1, 5, 6], [1, 7, 8]]),
        ...            "labels": torch.tensor([[5, 6, 2], [7, 8, 2]])}
        >>> view = BatchAdapter().view(whisper)
        >>> view.inputs.shape, view.decoder_inputs[0].tolist(), view.missing
        (torch.Size([2, 8, 30]), [1, 5, 6], ('ids', 'attention_mask'))
        >>> adapter = BatchAdapter(inputs="pixels", targets=lambda b: b["meta"]["cls"])
        >>> adapter.view({"pixels": torch.zeros(3, 8), "meta": {"cls": torch.ones(3)}}).missing
        ('ids', 'attention_mask')
        >>> BatchAdapter(targets="my_project.fields:labels")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: BatchAdapter(targets='my_project.fields:labels') is invalid: expected \
'package.module:function', the import path of a callable batch -> value (a string with ':' \
names a function; a dict key is a string without ':'); this one does not import \
(ModuleNotFoundError: No module named 'my_project').
    """

    def __init__(
        self,
        *,
        ids: FieldSpec | None = None,
        inputs: FieldSpec | None = None,
        targets: FieldSpec | None = None,
        attention_mask: FieldSpec | None = None,
        decoder_inputs: FieldSpec | None = None,
        ignore_index: int = -100,
    ) -> None:
        given = {
            "ids": ids,
            "inputs": inputs,
            "targets": targets,
            "attention_mask": attention_mask,
            "decoder_inputs": decoder_inputs,
        }
        self._specs = {name: _check_spec(name, spec) for name, spec in given.items()}
        self.ignore_index = validate.integer(
            "BatchAdapter", "ignore_index", ignore_index, hint="such as -100"
        )
        # Dict batches: the default key of each field, searched once per layout (set of keys).
        self._keys: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self._specs.items() if v is not None)
        return f"BatchAdapter({given})"

    def view(self, batch: Any, *, count_tokens: bool = True) -> BatchView:
        """Every field and size of ``batch`` (``None``: not found); ``count_tokens`` also counts
        real tokens and loss positions, which waits for the device."""
        _, inputs, targets, mask = values = self.fields(batch)
        tokens = loss_tokens = None
        if count_tokens:
            count, _ = _token_count(inputs, mask)
            tokens = None if count is None else int(count)
            if isinstance(targets, torch.Tensor) and not targets.is_floating_point():
                loss_tokens = int((targets != self.ignore_index).sum().item())
        sizes = (_batch_size(values), _seq_len(inputs, mask), tokens, loss_tokens)
        missing = tuple(name for name, v in zip(_FIELDS, values, strict=True) if v is None)
        return BatchView(*values, *sizes, missing, self.decoder_inputs(batch))

    def decoder_inputs(self, batch: Any) -> Any:
        """An encoder-decoder's decoder inputs in ``batch`` (``decoder_input_ids`` in a dict, or
        the ``decoder_inputs=`` spec); ``None`` when there are none.

        Example:
            >>> BatchAdapter().decoder_inputs({"decoder_input_ids": torch.tensor([[0, 5]])})
            tensor([[0, 5]])
        """
        spec = self._specs["decoder_inputs"]
        if spec is not None:
            return _lookup(batch, spec)
        return batch.get(_DECODER_KEY) if isinstance(batch, Mapping) else None

    def example_inputs(self, batch: Any) -> Any:
        """What identifies the examples of ``batch`` (or a dataset item): the ``inputs=`` field
        when given; else, in a dict, every key of :data:`INPUT_KEYS` present (a CLIP caption and
        image together); else the inputs; ``None`` when there are none.

        Example:
            >>> pair = {"input_ids": torch.tensor([5, 6]), "pixel_values": torch.zeros(3, 4, 4),
            ...         "attention_mask": torch.tensor([1, 1])}
            >>> sorted(BatchAdapter().example_inputs(pair))
            ['input_ids', 'pixel_values']
            >>> BatchAdapter(inputs="pixel_values").example_inputs(pair).shape
            torch.Size([3, 4, 4])
        """
        if self._specs["inputs"] is None and isinstance(batch, Mapping):
            found = {key: batch[key] for key in INPUT_KEYS if key in batch}
            if len(found) > 1:
                return found
        return self.fields(batch)[1]

    def size_and_tokens(
        self, batch: Any
    ) -> tuple[int | None, torch.Tensor | int | None, str | None]:
        """The batch size, the real tokens and where they were counted, without a device wait:
        the attention mask's sum left on the device, else every position of integer ``[B, T]``
        inputs, else ``None``.

        Example:
            >>> BatchAdapter().size_and_tokens({"attention_mask": torch.tensor([[1, 1], [1, 0]])})
            (2, tensor(3), 'attention_mask')
        """
        return size_and_tokens_of(self.fields(batch))

    def fields(self, batch: Any) -> tuple[Any, Any, Any, Any]:
        """The fields of ``batch`` as found (the same objects): ids, inputs, targets, attention
        mask (``None``: not found).

        Example:
            >>> ids, inputs, targets, mask = BatchAdapter().fields({"input_ids": torch.ones(2, 3)})
            >>> inputs.shape, mask
            (torch.Size([2, 3]), None)
        """
        if isinstance(batch, Mapping):
            keys = self._keys.get(layout := tuple(batch))
            if keys is None:
                keys = tuple(
                    next((k for k in _DEFAULT_KEYS[name] if k in batch), None) for name in _FIELDS
                )
                if len(self._keys) < 64:  # a bounded cache: layouts are few
                    self._keys[layout] = keys
            found = [None if k is None else batch[k] for k in keys]
        elif isinstance(batch, Sequence) and not isinstance(batch, str):
            positions = [_DEFAULT_POSITIONS.get(name, len(batch)) for name in _FIELDS]
            found = [batch[p] if p < len(batch) else None for p in positions]
        else:
            found = [None, batch if isinstance(batch, torch.Tensor) else None, None, None]
        ids, inputs, targets, mask = (
            found[i] if (spec := self._specs[name]) is None else _lookup(batch, spec)
            for i, name in enumerate(_FIELDS)
        )
        return ids, inputs, targets, mask


def size_and_tokens_of(
    fields: tuple[Any, Any, Any, Any],
) -> tuple[int | None, torch.Tensor | int | None, str | None]:
    """:meth:`BatchAdapter.size_and_tokens` of the fields :meth:`BatchAdapter.fields` found."""
    return (_batch_size(fields), *_token_count(fields[1], fields[3]))


def _lookup(batch: Any, spec: FieldSpec) -> Any:
    if callable(spec):
        return spec(batch)
    try:
        return batch[spec]
    except (KeyError, IndexError, TypeError):
        return None


def _batch_size(values: Sequence[Any]) -> int | None:
    """The leading dimension of the first field that has one."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.ndim >= 1:
                return int(value.shape[0])
        elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
            return len(value)
    return None


def _is_token_tensor(value: Any) -> bool:
    """Integer (or bool) ``[batch, length]`` inputs: token ids; float features have no length."""
    return (
        isinstance(value, torch.Tensor)
        and value.ndim == 2
        and not value.is_floating_point()
        and not value.is_complex()
    )


def _seq_len(inputs: Any, mask: Any) -> int | None:
    if isinstance(mask, torch.Tensor) and mask.ndim >= 2:
        return int(mask.shape[1])
    return int(inputs.shape[1]) if _is_token_tensor(inputs) else None


def _token_count(inputs: Any, mask: Any) -> tuple[torch.Tensor | int | None, str | None]:
    if isinstance(mask, torch.Tensor):
        # Summed now (a loader may refill the buffer); integer and bool masks sum to int64 already.
        exact = mask.is_floating_point() or mask.is_complex()
        return (mask.detach().sum(dtype=torch.int64) if exact else mask.sum()), "attention_mask"
    if _is_token_tensor(inputs):
        return int(inputs.numel()), "input_ids"
    return None, None
