"""BatchInspector: what the loss is really fed (the ``data`` phase)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_pilot.core import validate
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.data_checks import DataInspection
from lightning_pilot.core.label_checks import (
    CausalLMWatch,
    EncoderHeadWatch,
    find_encoder_decoder,
    infer_output_size,
)
from lightning_pilot.core.prompt_checks import PromptSpec
from lightning_pilot.core.split_inspection import SplitInspection
from lightning_pilot.core.split_scan import DatasetScan
from lightning_pilot.run import PilotCallback
from lightning_pilot.schemas import EXAMPLES_SCHEMA, EXAMPLES_SCHEMA_VERSION, EXAMPLES_TABLE


class BatchInspector(PilotCallback):
    """Check the examples and what the loss is fed: ids, targets, labels, lengths, masks, splits.

    The first ``batches`` batches and ``max_examples`` items of each split give the ``data``
    row and ``examples.parquet`` (docs/data-and-overfit.md).

    Args:
        decode: ``fn(token_ids) -> str`` for the table (e.g. a tokenizer's ``decode``).
        group_fn: ``fn(dataset_item) -> key`` of the unit that must not span splits
            (conversation, patient, document, period); ``None``: leakage ``not_checked``.
        num_classes, vocab_size: the model's number of outputs (give one at most; default: read
            from the module).
        max_length: the maximum sequence length, for truncation.
        pad_token_id: the padding token, to check that masked positions hold it.
        padding_warn: warn above this fraction of padding positions.
        response_mask_key: where each prompt is, for ``instruction_masked``: a per-example
            field of the batch, 1 on response tokens and 0 on prompt tokens.
        prompt_length_key: or a per-example field of the batch giving the prompt's length in
            tokens (counted from the row's first real token).
        response_template: or the token ids that start the response: each row's tokens up to
            and including its first occurrence are the prompt. Give one of the three at most:
            a prompt with a label other than the ignore index then ``fail``s, naming the rows;
            without any, labels equal to ``input_ids`` on every token only ``warn``.
        adapter: how to read batches (default :class:`BatchAdapter`).
        out_dir: the output folder; default ``<trainer.default_root_dir>/pilot``.

    Example:
        >>> import tempfile
        >>> from lightning_pilot.demo import ClassificationDataModule, TinyClassifier
        >>> from lightning_pilot.demo.classifier import example_group
        >>> inspector = BatchInspector(group_fn=example_group)
        >>> trainer = pl.Trainer(max_steps=2, callbacks=[inspector], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, default_root_dir=tempfile.mkdtemp())
        >>> data = ClassificationDataModule(dataset_size=96, batch_size=8, split_by="example")
        >>> trainer.fit(TinyClassifier(), datamodule=data)
        >>> inspector.verdict
        'fail'
        >>> print(inspector.checks["split_leakage"].detail)
        11 group(s) found in more than one split: 0 (train+val+test), ...; split by group, not
        by example

        Where the prompt is, so that an unmasked prompt fails (the demo's batches carry no such
        field here, so the check says what it looked for):

        >>> from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
        >>> inspector = BatchInspector(prompt_length_key="prompt_length")
        >>> trainer = pl.Trainer(max_steps=1, callbacks=[inspector], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, default_root_dir=tempfile.mkdtemp())
        >>> trainer.fit(TinyCausalLM(d_model=16, n_heads=2, n_layers=1),
        ...             datamodule=InstructionDataModule(dataset_size=32, batch_size=8))
        >>> print(inspector.checks["train/instruction_masked"].detail)  # doctest: +ELLIPSIS
        field 'prompt_length' (prompt_length_key='prompt_length') not found in the batch (the
        batch's keys: ...)
    """

    def __init__(
        self,
        *,
        batches: int = 2,
        examples: int = 4,
        decode: Callable[[Any], str] | None = None,
        group_fn: Callable[[Any], Hashable] | None = None,
        max_examples: int = 5000,
        num_classes: int | None = None,
        vocab_size: int | None = None,
        max_length: int | None = None,
        pad_token_id: int | None = None,
        padding_warn: float = 0.5,
        response_mask_key: str | None = None,
        prompt_length_key: str | None = None,
        response_template: Sequence[int] | None = None,
        adapter: BatchAdapter | None = None,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "BatchInspector"
        super().__init__(out_dir=out_dir)
        self.batches = validate.integer(owner, "batches", batches, minimum=1)
        self.examples = validate.integer(owner, "examples", examples, minimum=0)
        self.max_examples = validate.integer(owner, "max_examples", max_examples, minimum=1)
        self.decode = validate.callable_or_none(
            owner, "decode", decode, "a callable fn(ids) -> str"
        )
        self.group_fn = validate.callable_or_none(
            owner, "group_fn", group_fn, "a callable fn(item) -> key"
        )
        # Each is checked under its own name: the message names the argument that was given.
        sizes = {
            name: validate.integer(owner, name, value, minimum=2, optional=True)
            for name, value in (("num_classes", num_classes), ("vocab_size", vocab_size))
        }
        if None not in sizes.values():
            raise ValueError(
                f"BatchInspector(num_classes={num_classes!r}, vocab_size={vocab_size!r}) is"
                " invalid: expected one of them, not both (both name the model's number of"
                " outputs)."
            )
        self.output_size = sizes["num_classes"] or sizes["vocab_size"]
        self.max_length = validate.integer(
            owner, "max_length", max_length, minimum=1, optional=True
        )
        self.pad_token_id = validate.integer(
            owner, "pad_token_id", pad_token_id, minimum=0, optional=True
        )
        self.padding_warn = validate.number(
            owner, "padding_warn", padding_warn, minimum=0, maximum=1, hint="a fraction"
        )
        self.prompt = _prompt_spec(response_mask_key, prompt_length_key, response_template)
        validate.instance(owner, "adapter", adapter, BatchAdapter)
        self.adapter = adapter or BatchAdapter()
        self._watch: CausalLMWatch | None = None
        self._reset()

    def _reset(self) -> None:
        self._unwatch()
        self._watch = None
        self._inspection: DataInspection | None = None
        self._dataset_checks: list[CheckResult] | None = None  # None: not scanned yet
        self._val_done = self._done = False
        self.verdict: str | None = None
        self.checks: dict[str, CheckResult] = {}

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.remove()

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "batches": self.batches}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self._reset()
        self.run.register_table(EXAMPLES_TABLE, EXAMPLES_SCHEMA)
        size, source = self.output_size, "num_classes/vocab_size given"
        if size is None:
            size, source = infer_output_size(pl_module)
        ignore_index = self.adapter.ignore_index
        # A few calls decide; later ones (a verdict waiting for validation) cost one call each.
        calls = 4 * self.batches
        watch = self._watch = CausalLMWatch.attach(
            pl_module, ignore_index=ignore_index, max_calls=calls
        ) or EncoderHeadWatch.attach(pl_module, ignore_index=ignore_index, max_calls=calls)
        inspect_split = functools.partial(
            SplitInspection,
            ignore_index=ignore_index,
            output_size=size,
            size_source=source,
            max_length=self.max_length or _max_length(trainer, pl_module),
            pad_token_id=self.pad_token_id,
            padding_warn=self.padding_warn,
            causal_lm=watch.name if watch is not None and watch.shifts_labels else None,
            encoder_decoder=find_encoder_decoder(pl_module),
            prompt=self.prompt,
            encoder_head=(
                f"{watch.name} ({watch.check_name})"
                if isinstance(watch, EncoderHeadWatch)
                else None
            ),
        )
        self._inspection = DataInspection(
            {split: inspect_split(split) for split in ("train", "val")},
            batches=self.batches,
            examples=self.examples,
            decode=self.decode,
        )
        has_val = trainer.limit_val_batches != 0 and is_overridden("validation_step", pl_module)
        self._val_done = not has_val

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._inspection is None:
            return
        try:
            self._dataset_checks = self._scan(trainer, self._inspection)
        except Exception as err:  # never the user's fit: the scan is left out, with why
            detail = (
                f"the dataset scan raised {type(err).__name__}: {err}; split leakage,"
                " duplicates and class histograms not checked"
            )
            self._dataset_checks = [CheckResult("datasets_scanned", "not_checked", detail)]
        self._maybe_finish()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._inspect("train", batch)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any
    ) -> None:
        self._inspect("val", batch)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_done = True
        self._maybe_finish()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._run is not None and not self._run.closed:
            self._finish(failed=exception)
        self._unwatch()
        super().on_exception(trainer, pl_module, exception)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unwatch()
        super().teardown(trainer, pl_module, stage)

    def _inspect(self, split: str, batch: Any) -> None:
        inspection = self._inspection
        if inspection is None or self._done or inspection.done(split):
            if split == "train":  # nothing more to read from training batches in this fit
                self._mute("on_train_batch_start")
            return
        inspection.add(split, batch, self.adapter)
        if split == "val" and inspection.done(split):
            self._val_done = True
        self._maybe_finish()

    def _scan(self, trainer: pl.Trainer, inspection: DataInspection) -> list[CheckResult]:
        """Leakage, duplicates and histograms over the splits' datasets (bounded)."""
        problems: list[CheckResult] = []
        sources = {"train": _loaders(trainer.train_dataloader)}
        sources["val"] = _loaders(trainer.val_dataloaders)
        datamodule = _datamodule(trainer)
        for split in ("val", "test"):
            if datamodule is None or sources.get(split):
                continue
            if is_overridden(f"{split}_dataloader", datamodule):
                sources[split], problem = _split_loaders(datamodule, split)
                problems += [problem] if problem is not None else []
        scan = DatasetScan(self.adapter, max_examples=self.max_examples, group_fn=self.group_fn)
        datasets = {split: [loader.dataset for loader in ls] for split, ls in sources.items()}
        results = scan.run(datasets, problems)
        inspection.raised += scan.raised
        return results

    def _maybe_finish(self) -> None:
        started = self._dataset_checks is not None
        if started and self._val_done and self._inspection and self._inspection.done("train"):
            self._finish()

    def _finish(self, failed: BaseException | None = None) -> None:
        inspection = self._inspection
        if self._done or inspection is None or self._run is None:
            return
        self._done = True
        self._unwatch()
        results = inspection.results(
            self._watch, dataset_checks=self._dataset_checks, failed=failed
        )
        self.checks = {c.name: c for c in results}
        self.verdict, reason = self._put_checks("data", results)
        meta = {"schema_version": EXAMPLES_SCHEMA_VERSION}
        self.run.append_rows(EXAMPLES_TABLE, [meta | row for row in inspection.table_rows()])
        line = f"BatchInspector: data verdict {self.verdict}"
        if self.verdict in ("fail", "warn"):
            rank_zero_warn(f"{line}: {reason}")
        elif inspection.raised:  # user code that raised: said even when the rest passes
            raised = "; ".join(f"{c.name}: {c.detail}" for c in inspection.raised)
            rank_zero_warn(f"{line}; {raised}")
        else:
            rank_zero_info(line)


def _prompt_spec(
    response_mask_key: object, prompt_length_key: object, response_template: object
) -> PromptSpec | None:
    """Where each prompt is, from the options checked (one at most), or ``None``."""
    owner, hint = "BatchInspector", "a key of the batch dict"
    mask_key = validate.text(
        owner, "response_mask_key", response_mask_key, optional=True, hint=hint
    )
    length_key = validate.text(
        owner, "prompt_length_key", prompt_length_key, optional=True, hint=hint
    )
    template = None
    if response_template is not None:
        tokens = response_template
        expected = "a non-empty list of token ids (integers >= 0), or None"
        problem = validate.invalid(owner, "response_template", tokens, expected)
        if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
            raise TypeError(problem)
        if not tokens:
            raise ValueError(problem)
        for index, token in enumerate(tokens):
            validate.integer(
                owner, f"response_template[{index}]", token, minimum=0, hint="a token id"
            )
        template = tuple(int(token) for token in tokens)
    given: dict[str, object] = {"response_mask_key": mask_key, "prompt_length_key": length_key}
    given["response_template"] = template
    named = [name for name, value in given.items() if value is not None]
    if len(named) > 1:
        shown = ", ".join(f"{name}={given[name]!r}" for name in named)
        raise ValueError(
            f"BatchInspector({shown}) is invalid: expected one of {', '.join(given)}"
            " at most (each says where the prompt is)."
        )
    return PromptSpec(mask_key, length_key, template) if named else None


def _loaders(value: Any) -> list[DataLoader[Any]]:
    if isinstance(value, DataLoader):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [loader for item in value for loader in _loaders(item)]
    return []


def _datamodule(trainer: pl.Trainer) -> pl.LightningDataModule | None:
    """The fit's DataModule (``trainer.datamodule``, set at run time; ``None`` without one)."""
    datamodule = getattr(trainer, "datamodule", None)
    return datamodule if isinstance(datamodule, pl.LightningDataModule) else None


def _split_loaders(
    datamodule: pl.LightningDataModule, split: str
) -> tuple[list[DataLoader[Any]], CheckResult | None]:
    """The loaders of another split during ``fit``, or why they cannot be read (a DataModule
    may build a split only in the ``setup`` of its own stage)."""
    method = f"{split}_dataloader"
    left_out = (
        f"split_leakage and duplicate_inputs_across_splits leave {split} out: build the {split}"
        " split in setup() for every stage (or in __init__) to check it during fit too"
    )
    try:
        value = getattr(datamodule, method)()
    except Exception as err:  # the user's DataModule: report it, keep training
        built = ""
        if isinstance(err, AttributeError):  # the attribute its setup(stage) would have set
            stage = {"val": "validate", "test": "test"}[split]
            built = f"the {split} split is built in setup('{stage}'), not for fit; "
        problem = f"{built}{method}() raised {type(err).__name__} during fit: {err}"
    else:
        if loaders := _loaders(value):
            return loaders, None
        problem = f"{method}() returned {type(value).__name__} during fit, not a DataLoader"
    return [], CheckResult(f"{split}/split_leakage", "not_checked", f"{problem}; {left_out}")


def _max_length(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int | None:
    """``max_length`` of the datamodule, else of the module's hyper-parameters."""
    for value in (
        getattr(_datamodule(trainer), "max_length", None),
        pl_module.hparams.get("max_length") if hasattr(pl_module, "hparams") else None,
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
