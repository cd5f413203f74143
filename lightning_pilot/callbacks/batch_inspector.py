"""BatchInspector: what the loss is really fed (the ``data`` phase)."""

from __future__ import annotations

import itertools
import os
import random
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, Final

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_pilot.core import validate
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.data_checks import (
    SplitInspection,
    check_causal_lm_labels,
    check_class_histograms,
    check_duplicates,
    check_leakage,
    class_histogram,
    example_rows,
    find_causal_lm,
    find_encoder_decoder,
    infer_output_size,
    input_fingerprint,
    label_relations,
)
from lightning_pilot.core.phases import judge
from lightning_pilot.run import PilotCallback
from lightning_pilot.schemas import EXAMPLES_SCHEMA, EXAMPLES_SCHEMA_VERSION, EXAMPLES_TABLE

__all__ = ["EXAMPLES_SCHEMA", "EXAMPLES_SCHEMA_VERSION", "EXAMPLES_TABLE", "BatchInspector"]

#: ``runs/<run_id>/examples.parquet``: the inspected examples (see the class docstring).

GroupFn = Callable[[Any], Hashable]


def _loaders(value: Any) -> list[DataLoader[Any]]:
    if isinstance(value, DataLoader):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [loader for item in value for loader in _loaders(item)]
    return []


def _items(dataset: Any, limit: int) -> Iterator[Any]:
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        yield from itertools.islice(iter(dataset), limit)
        return
    for index in range(min(len(dataset), limit)):
        yield dataset[index]


class _LabelWatch:
    """The forward pre-hook on a causal LM: hands its ``labels=`` to the inspector.

    A copy of the model made while it is watched (``copy.deepcopy``, ``pickle``: the resume
    check's in-process fallback, a user's ``torch.save(model)``) gets an inert hook, never a
    copy of the inspector and its run.
    """

    def __init__(self, inspector: BatchInspector | None) -> None:
        self.inspector = inspector

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.inspector is not None:
            self.inspector._on_lm_forward(args, kwargs)

    def __reduce__(self) -> tuple[type[_LabelWatch], tuple[None]]:
        return _LabelWatch, (None,)


class BatchInspector(PilotCallback):
    """Check the examples and what the loss is fed: ids, targets, labels, lengths, masks, splits.

    Reads the first ``batches`` training and validation batches the fit itself fetches (in
    ``on_train_batch_start`` / ``on_validation_batch_start``, sanity check included: the batches
    after the transfer hooks, as ``training_step`` receives them) through the
    :class:`BatchAdapter`, and at ``on_train_start`` scans the datasets of the train,
    validation and test loaders (at most ``max_examples`` each, in index order, with the
    torch and Python random states restored afterwards). Checks, each named
    ``<split>/<check>`` in the ``data`` row's ``checks``:

    * ``ids_present_unique``, ``targets_present`` (``not_checked`` naming a missing field);
    * ``label_range``: counted labels inside the model's outputs, ``ignore_index`` kept apart.
      The output size is ``num_classes``/``vocab_size`` if given, else read from the module
      (:func:`~lightning_pilot.core.data_checks.infer_output_size`: the output embeddings, a
      child named ``lm_head``/``head``/``classifier``/..., else the last ``nn.Linear``);
    * ``truncation`` (sequences reaching ``max_length``: given, else the datamodule's or the
      module's ``max_length``), ``padding`` (fraction), ``attention_mask_*`` and
      ``padding_not_in_loss`` (the mask fits the inputs, padding is not a target);
    * ``instruction_masked`` (token targets aligned with the inputs: warns when the labels equal
      ``input_ids`` on every real token) and ``loss_positions_present``;
    * ``label_shift``: the relation of token labels to ``input_ids`` (``identical``, ``shifted
      by 1``, ``shifted by -1``, ``other``); warns when they are already shifted left by one,
      which trains a model that shifts internally (Hugging Face ``*ForCausalLM``) two tokens
      ahead. When the module holds such a model, a forward pre-hook watches the ``labels=`` it is
      given until the verdict: ``causal_lm_labels`` fails when they are shifted left by one;
    * dataset level: ``class_histograms`` with ``val_classes_in_train`` and
      ``label_ranges_agree`` (one label per example), ``split_leakage`` (``group_fn`` keys in
      more than one split: ``fail``) and ``duplicate_inputs_across_splits`` (``warn``). A split
      whose loader cannot be read during ``fit`` (a DataModule that builds its test split in
      ``setup("test")``) is left out with ``<split>/split_leakage`` ``not_checked`` and why.

    User code that raises (the DataModule's loaders, the datasets, ``group_fn``, ``decode``,
    the adapter's field functions) never stops the fit: the check it served is ``not_checked``
    with the error and what to fix.

    The verdict goes to the phase table's ``data`` row (``first=True``, shared with
    ``PhaseMemoryMonitor``'s timing of the data fetch), once: when the training and validation
    batches are inspected, else at train end or on an exception. Nothing here stops training.

    Table ``<out_dir>/runs/<run_id>/examples.parquet`` (:data:`EXAMPLES_SCHEMA`), ``examples``
    rows per split, written with the verdict:

    ==============================  ==============  ============================================
    column                          dtype           meaning
    ==============================  ==============  ============================================
    run_id, attempt, attempt_id,    str/int32       identity
    rank, world_size
    split, batch_index, position    str/int64       ``train``/``val``, batch number, row in it
    example_id                      str             the example's id (null: none in the batch)
    input_text                      str             ``decode(tokens)`` of the real tokens
    input_tokens / input_values     list<int64/f64> token ids (real tokens) / float features
                                                    (flattened, at most 256)
    target                          str             the class, or the decoded counted targets
    target_tokens, loss_positions   list<int64>     token targets as given; positions counted
    loss_tokens                     int64           how many positions count in the loss
    length, seq_len, truncated      int64/bool      real tokens, padded width, ``length >=
                                                    max_length`` (null when unknown)
    label_relation                  str             token labels vs ``input_ids``: ``identical``,
                                                    ``shifted by 1`` (``labels[t] ==
                                                    input_ids[t+1]``), ``shifted by -1``,
                                                    ``other`` (null: not token sequences)
    notes, schema_version,          str/...         why a value is null; file metadata
    written_at
    ==============================  ==============  ============================================

    Ranks: every rank inspects its own batches and writes its own row and examples (``rank``).

    Args:
        batches: batches inspected per split.
        examples: examples per split written to the table.
        decode: ``fn(token_ids) -> str`` for the table (e.g. a tokenizer's ``decode``).
        group_fn: ``fn(dataset_item) -> key`` of the unit that must not span splits
            (conversation, patient, document, period); ``None``: leakage ``not_checked``.
        max_examples: examples scanned per split for leakage, duplicates and histograms.
        num_classes: the model's number of outputs (overrides the module heuristic).
        vocab_size: the same for a language model (give one of the two).
        max_length: the maximum sequence length, for truncation.
        pad_token_id: the padding token, to check that masked positions hold it.
        padding_warn: warn above this fraction of padding positions.
        adapter: how to read batches and items (default :class:`BatchAdapter`).
        out_dir: the output folder; default ``<trainer.default_root_dir>/pilot``.

    Raises:
        ValueError: a count out of range, ``padding_warn`` outside [0, 1] or not finite, or
            ``num_classes`` and ``vocab_size`` both given.
        TypeError: a count that is not an int (a bool is not), ``padding_warn`` not a number,
            ``decode``/``group_fn`` not callable, ``adapter`` not a BatchAdapter.

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
    """

    def __init__(
        self,
        *,
        batches: int = 2,
        examples: int = 4,
        decode: Callable[[Any], str] | None = None,
        group_fn: GroupFn | None = None,
        max_examples: int = 5000,
        num_classes: int | None = None,
        vocab_size: int | None = None,
        max_length: int | None = None,
        pad_token_id: int | None = None,
        padding_warn: float = 0.5,
        adapter: BatchAdapter | None = None,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "BatchInspector"
        validate.path(owner, "out_dir", out_dir)
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
        validate.instance(owner, "adapter", adapter, BatchAdapter)
        self.adapter = adapter or BatchAdapter()
        self._reset()

    def _reset(self) -> None:
        self._unwatch()
        self._splits: dict[str, SplitInspection] = {}
        self._rows: list[dict[str, Any]] = []
        self._dataset_checks: list[CheckResult] = []
        # Per split: the batch the adapter could not read (the split's batch checks stop there).
        self._errors: dict[str, CheckResult] = {}
        self._decode_errors: list[str] = []
        # Every check left ``not_checked`` because user code raised (warned at the verdict).
        self._raised: list[CheckResult] = []
        # A Hugging Face causal LM of the module and what its forward calls were given.
        self._causal_lm: str | None = None
        self._lm_calls = 0
        self._lm_relations: Counter[str] = Counter()
        self._lm_error: str | None = None
        self._val_done = False
        self._started = False
        self._done = False
        self.verdict: str | None = None
        self.checks: dict[str, CheckResult] = {}

    def _unwatch(self) -> None:
        handle: RemovableHandle | None = self.__dict__.get("_lm_handle")
        if handle is not None:
            handle.remove()
        self._lm_handle: RemovableHandle | None = None

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
        max_length = self.max_length or _max_length(trainer, pl_module)
        self._watch(pl_module)
        for split in ("train", "val"):
            self._splits[split] = SplitInspection(
                split,
                ignore_index=self.adapter.ignore_index,
                output_size=size,
                size_source=source,
                max_length=max_length,
                pad_token_id=self.pad_token_id,
                padding_warn=self.padding_warn,
                causal_lm=self._causal_lm,
                encoder_decoder=find_encoder_decoder(pl_module),
            )
        has_val = trainer.limit_val_batches != 0 and is_overridden("validation_step", pl_module)
        self._val_done = not has_val

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._splits:
            try:
                self._dataset_checks = self._scan(trainer)
            except Exception as err:  # never the user's fit: the scan is left out, with why
                self._dataset_checks = [
                    CheckResult(
                        "datasets_scanned",
                        "not_checked",
                        f"the dataset scan raised {type(err).__name__}: {err}; split leakage,"
                        " duplicates and class histograms not checked",
                    )
                ]
            self._started = True
            self._maybe_finish()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._inspect("train", batch)

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
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

    # -- the causal LM's labels ----------------------------------------------------------------

    def _watch(self, pl_module: nn.Module) -> None:
        """Watch the ``labels=`` given to a Hugging Face causal LM of the module, if any."""
        found = find_causal_lm(pl_module)
        if found is None:
            return
        path, model = found
        self._causal_lm = f"{type(model).__name__} at '{path}'" if path else type(model).__name__
        self._lm_handle = model.register_forward_pre_hook(_LabelWatch(self), with_kwargs=True)

    def _on_lm_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # A few calls decide; later ones (a verdict waiting for validation) cost one call each.
        if self._done or self._lm_calls >= 4 * self.batches:
            return
        try:
            self._lm_calls += 1
            labels = kwargs.get("labels")
            if labels is None:
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            relations = label_relations(ids, labels, ignore_index=self.adapter.ignore_index)
            self._lm_relations.update(r for r in relations or [] if r is not None)
        except Exception as err:  # inside the user's forward: record, never raise
            self._lm_error = f"{type(err).__name__}: {err}"

    # -- inspecting --------------------------------------------------------------------------

    def _inspect(self, split: str, batch: Any) -> None:
        inspection = self._splits.get(split)
        if (
            inspection is None
            or self._done
            or inspection.batches >= self.batches
            or split in self._errors
        ):
            if split == "train":  # nothing more to read from training batches in this fit
                self._mute("on_train_batch_start")
            return
        try:
            view = self.adapter.view(batch)
            kept = sum(1 for r in self._rows if r["split"] == split)
            rows = []
            if kept < self.examples:
                rows = example_rows(
                    view,
                    split=split,
                    batch_index=inspection.batches,
                    limit=self.examples - kept,
                    ignore_index=self.adapter.ignore_index,
                    max_length=inspection.max_length,
                    decode=self.decode,
                    errors=self._decode_errors,
                )
            inspection.add(view)
            self._rows += rows
        except Exception as err:  # a field function of the adapter, an odd batch: not the fit
            self._errors[split] = error = CheckResult(
                f"{split}/batch_read",
                "not_checked",
                f"reading a {split} batch raised {type(err).__name__}: {err}; the {split} batch"
                " checks stop there: give adapter=BatchAdapter(...) field specs that fit the"
                " batch",
            )
            self._raised.append(error)
        if split == "val" and (inspection.batches >= self.batches or split in self._errors):
            self._val_done = True
        self._maybe_finish()

    def _scan(self, trainer: pl.Trainer) -> list[CheckResult]:
        """Leakage, duplicates and histograms over the splits' datasets (bounded).

        Every read of user code (another split's loader, a dataset item, ``group_fn``) is
        guarded: a split that cannot be read is left out with ``<split>/split_leakage``
        ``not_checked`` and the reason, and the fit goes on.
        """
        problems: list[CheckResult] = []
        sources = {"train": _loaders(trainer.train_dataloader)}
        sources["val"] = _loaders(trainer.val_dataloaders)
        datamodule = _datamodule(trainer)
        for split in ("val", "test"):
            if sources.get(split) or datamodule is None:
                continue
            if not is_overridden(f"{split}_dataloader", datamodule):
                continue
            loaders, problem = _split_loaders(datamodule, split)
            if problem is not None:
                problems.append(problem)
            sources[split] = loaders
        keys: dict[str, list[Hashable]] = {}
        prints: dict[str, list[str | None]] = {}
        labels: dict[str, dict[int, int]] = {}
        scanned: dict[str, int] = {}
        group_error: CheckResult | None = None
        python_state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):
                for split, loaders in sources.items():
                    try:
                        items = [
                            item
                            for loader in loaders
                            for item in _items(loader.dataset, self.max_examples)
                        ]
                        views = [self.adapter.view(item, count_tokens=False) for item in items]
                    except Exception as err:  # the user's dataset or adapter: report it
                        self._raised.append(
                            CheckResult(
                                f"{split}/split_leakage",
                                "not_checked",
                                f"reading the {split} dataset raised {type(err).__name__}:"
                                f" {err}; split leakage, duplicates and class histograms leave"
                                f" {split} out: check the dataset's items (dataset[i]) and the"
                                " adapter's field specs",
                            )
                        )
                        problems.append(self._raised[-1])
                        continue
                    if not items:
                        continue
                    scanned[split] = len(items)
                    prints[split] = [input_fingerprint(v.inputs) for v in views]
                    labels[split] = class_histogram(
                        (v.targets for v in views if _is_scalar(v.targets)),
                        ignore_index=self.adapter.ignore_index,
                    )
                    if self.group_fn is not None and group_error is None:
                        try:
                            keys[split] = [self.group_fn(item) for item in items]
                        except Exception as err:  # the user's function: report it, keep training
                            group_error = CheckResult(
                                "split_leakage",
                                "not_checked",
                                f"group_fn raised {type(err).__name__}: {err} on a {split} item:"
                                " fix group_fn (it receives one dataset item, as dataset[i]"
                                " returns it)",
                            )
        finally:
            random.setstate(python_state)
        results: list[CheckResult] = []
        if any(labels.values()):
            results += check_class_histograms(labels)
        if group_error is not None:
            self._raised.append(group_error)
            results.append(group_error)
        else:
            results.append(check_leakage(keys if self.group_fn else None, scanned=scanned))
        results.append(check_duplicates(prints, scanned=scanned))
        return results + problems

    # -- the verdict ---------------------------------------------------------------------------

    def _maybe_finish(self) -> None:
        train = self._splits.get("train")
        full = train is not None and (train.batches >= self.batches or "train" in self._errors)
        if self._started and full and self._val_done:
            self._finish()

    def _finish(self, failed: BaseException | None = None) -> None:
        if self._done or not self._splits or self._run is None:
            return
        self._done = True
        self._unwatch()
        results = [c for s in self._splits.values() for c in s.checks()]
        results += self._errors.values()
        if self._decode_errors:
            self._raised.append(
                CheckResult(
                    "decode",
                    "not_checked",
                    f"{self._decode_errors[0]} ({len(self._decode_errors)} call(s)): input_text"
                    " and target stay null in examples.parquet; fix decode= (it receives a 1-d"
                    " LongTensor of token ids, e.g. a tokenizer's decode)",
                )
            )
            results.append(self._raised[-1])
        if self._causal_lm is not None:
            if self._lm_error is not None:
                self._raised.append(
                    CheckResult(
                        "causal_lm_labels",
                        "not_checked",
                        f"reading the labels given to {self._causal_lm} raised {self._lm_error}",
                    )
                )
                results.append(self._raised[-1])
            else:
                results.append(
                    check_causal_lm_labels(self._causal_lm, self._lm_relations, self._lm_calls)
                )
        if not self._started:
            results.append(
                CheckResult(
                    "datasets_scanned",
                    "not_checked",
                    f"the fit ended ({type(failed).__name__}) before training started",
                )
            )
        results += self._dataset_checks
        self.checks = {c.name: c for c in results}
        self.verdict, reason = judge("data", ((c.name, c.verdict, c.detail) for c in results))
        if reason is None and self.verdict == "not_checked":
            reason = "; ".join(f"{c.name}: {c.detail}" for c in results)
        self.run.put_phase_row(
            {
                "phase": "data",
                "first": True,
                "verdict": self.verdict,
                "checks": [c.as_row() for c in results],
                "reason": reason,
            },
            source=type(self).__name__,
        )
        meta = {"schema_version": EXAMPLES_SCHEMA_VERSION}
        order = {"train": 0, "val": 1}
        rows = sorted(
            self._rows, key=lambda r: (order[r["split"]], r["batch_index"], r["position"])
        )
        self.run.append_rows(EXAMPLES_TABLE, [meta | row for row in rows])
        line = f"BatchInspector: data verdict {self.verdict}"
        if self.verdict in ("fail", "warn"):
            rank_zero_warn(f"{line}: {reason}")
        elif self._raised:  # user code that raised: said even when the rest passes
            raised = "; ".join(f"{c.name}: {c.detail}" for c in self._raised)
            rank_zero_warn(f"{line}; {raised}")
        else:
            rank_zero_info(line)


def _datamodule(trainer: pl.Trainer) -> pl.LightningDataModule | None:
    """The fit's DataModule (``trainer.datamodule``, set at run time; ``None`` without one)."""
    datamodule = getattr(trainer, "datamodule", None)
    return datamodule if isinstance(datamodule, pl.LightningDataModule) else None


#: The stage whose ``setup`` builds a split that ``fit`` does not.
_STAGES: Final = {"val": "validate", "test": "test"}


def _split_loaders(
    datamodule: pl.LightningDataModule, split: str
) -> tuple[list[DataLoader[Any]], CheckResult | None]:
    """The loaders of another split during ``fit``, or the reason they cannot be read.

    A DataModule may build a split only in the ``setup`` of its own stage (Lightning's
    ``BoringDataModule`` builds its test split in ``setup("test")``), so during ``fit`` its
    ``<split>_dataloader()`` may raise: the split is then left out, never the fit.
    """
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
            built = f"the {split} split is built in setup('{_STAGES[split]}'), not for fit; "
        return [], CheckResult(
            f"{split}/split_leakage",
            "not_checked",
            f"{built}{method}() raised {type(err).__name__} during fit: {err}; {left_out}",
        )
    loaders = _loaders(value)
    if loaders:
        return loaders, None
    return [], CheckResult(
        f"{split}/split_leakage",
        "not_checked",
        f"{method}() returned {type(value).__name__} during fit, not a DataLoader; {left_out}",
    )


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 or value.numel() == 1
    return isinstance(value, int) and not isinstance(value, bool)


def _max_length(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int | None:
    """``max_length`` of the datamodule, else of the module's hyper-parameters."""
    for value in (
        getattr(_datamodule(trainer), "max_length", None),
        pl_module.hparams.get("max_length") if hasattr(pl_module, "hparams") else None,
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
