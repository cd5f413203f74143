"""OverfitTinySubset: an overfit run on a few fixed examples (the ``overfit`` phase)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader, default_collate
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_pilot.callbacks._shared import evaluating, step_loss
from lightning_pilot.core import overfit, validate
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.label_checks import find_encoder_head, infer_output_size
from lightning_pilot.core.overfit import error_text
from lightning_pilot.run import PilotCallback
from lightning_pilot.schemas import OVERFIT_SCHEMA, OVERFIT_SCHEMA_VERSION, OVERFIT_TABLE

PredictFn = Callable[[pl.LightningModule, Any], torch.Tensor]
_HOOK: Final = "on_before_batch_transfer"
_ABSENT: Final = object()  # the owner held no instance attribute of that name


class _Installed(NamedTuple):
    """The hook wrapped for one fit on ``owner``, and what to put back."""

    owner: Any
    original: Any  # the hook the wrapper calls
    held: Any  # the owner's own instance attribute, or _ABSENT
    wrapper: Any
    limit_val_batches: int | float | None  # None: left as it was


class OverfitTinySubset(PilotCallback):
    """CHANGES TRAINING: the fit trains and evaluates on a fixed tiny subset, then judges it.

    Every batch is replaced by ``num_examples`` seeded training examples until the loss target
    and the targets are reached, or ``max_steps`` (docs/data-and-overfit.md).

    Args:
        num_examples: size of the subset.
        seed: seed of the (``random.Random``) choice of indices.
        max_steps: update budget; training stops there.
        target_loss: absolute loss to reach (overrides ``target_fraction``).
        target_fraction: loss to reach as a fraction of the initial loss.
        required_recovery: accuracy / exact match required on the subset, in (0, 1].
        check_every: evaluate the subset every this many updates.
        batch_size: examples per subset batch (default: the whole subset in one batch).
        num_classes: classes (vocabulary size for an LM) for ``-log(1/C)`` and torchmetrics.
        shift_labels: token targets are aligned with the inputs and the model shifts (causal
            LMs); ``False`` for token classification. Default: ``False`` when the module holds
            a Hugging Face ``*ForMaskedLM``, ``*ForTokenClassification`` or
            ``*ForMultipleChoice`` (their labels are not shifted), else ``True``.
        init_tolerance: accepted factor between the initial loss and ``-log(1/C)``.
        predict_fn: ``fn(pl_module, batch) -> logits or predictions`` on a device batch.
            Default: the module's ``forward``; without one (``self.model = HFModel(...)``
            wrappers), the ``logits`` a child module returns inside the training step
            (docs/data-and-overfit.md, "Predictions").
        adapter: how to read batches (default :class:`BatchAdapter`).
        out_dir: the output folder; default ``<trainer.default_root_dir>/pilot``.

    Example:
        >>> import tempfile
        >>> from lightning_pilot.demo import ClassificationDataModule, TinyClassifier
        >>> overfit = OverfitTinySubset(max_steps=60)
        >>> trainer = pl.Trainer(max_epochs=100, callbacks=[overfit], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, default_root_dir=tempfile.mkdtemp())
        >>> trainer.fit(TinyClassifier(), datamodule=ClassificationDataModule(dataset_size=128))
        >>> overfit.verdict, overfit.subset_ids
        ('pass', ['5', '65', '70', '81', '83', '85', '94', '97'])
        >>> overfit.checks["targets_recovered"].detail.startswith("accuracy 1.000 on 8")
        True
    """

    def __init__(
        self,
        *,
        num_examples: int = 8,
        seed: int = 0,
        max_steps: int = 200,
        target_loss: float | None = None,
        target_fraction: float = 0.1,
        required_recovery: float = 1.0,
        check_every: int = 1,
        batch_size: int | None = None,
        num_classes: int | None = None,
        shift_labels: bool | None = None,
        init_tolerance: float = 2.0,
        predict_fn: PredictFn | None = None,
        adapter: BatchAdapter | None = None,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        owner = "OverfitTinySubset"
        super().__init__(out_dir=out_dir)
        self.num_examples = validate.integer(owner, "num_examples", num_examples, minimum=1)
        self.seed = validate.integer(owner, "seed", seed, minimum=0)
        self.max_steps = validate.integer(owner, "max_steps", max_steps, minimum=1)
        self.target_loss = validate.number(
            owner, "target_loss", target_loss, minimum=0, allow_minimum=False, optional=True
        )
        self.target_fraction = validate.number(
            owner, "target_fraction", target_fraction, minimum=0, maximum=1, allow_minimum=False
        )
        self.required_recovery = validate.number(
            owner, "required_recovery", required_recovery, minimum=0, maximum=1, allow_minimum=False
        )
        self.check_every = validate.integer(owner, "check_every", check_every, minimum=1)
        self.batch_size = validate.integer(
            owner, "batch_size", batch_size, minimum=1, optional=True
        )
        self.num_classes = validate.integer(
            owner, "num_classes", num_classes, minimum=2, optional=True
        )
        self.shift_labels = (
            None if shift_labels is None else validate.boolean(owner, "shift_labels", shift_labels)
        )
        self.init_tolerance = validate.number(
            owner, "init_tolerance", init_tolerance, minimum=1, allow_minimum=False
        )
        self.predict_fn = validate.callable_or_none(
            owner, "predict_fn", predict_fn, "a callable fn(pl_module, batch) -> logits"
        )
        validate.instance(owner, "adapter", adapter, BatchAdapter)
        self.adapter = adapter or BatchAdapter()
        self._reset()

    def _reset(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._installed: _Installed | None = None
        self._batches: list[Any] = []
        self._cursor = {"train": 0, "val": 0}
        self._loss = overfit.LossCurve()
        self._last: overfit.Recovery | None = None
        self._last_step: int | None = None
        self._done = False
        self._notes = overfit.Notes()
        self._shift = self.shift_labels is not False
        self._head: tuple[str, torch.nn.Module] | None = None  # a Hugging Face encoder head
        # Where the predictions come from: "predict_fn", "forward" or "training_step" (the
        # logits a submodule returned inside the user's training step, read by forward hooks).
        self._source: str | None = None
        self._handles: list[RemovableHandle] = []
        self._captured: tuple[str, torch.Tensor] | None = None
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masked = False  # the forward was called with the attention mask
        self._problem: str | None = None  # why the last attempt to predict gave nothing
        self._misaligned: str | None = None  # captured logits that do not fit the targets
        self.subset_ids: list[str] = []
        self.verdict: str | None = None
        self.checks: dict[str, CheckResult] = {}

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "num_examples": self.num_examples, "seed": self.seed}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._install(trainer, pl_module)

    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start afresh and put the subset in place of every batch (the hook wrapped)."""
        self._restore()
        self._reset()
        self._trainer = trainer
        self.run.register_table(OVERFIT_TABLE, OVERFIT_SCHEMA)
        self._head = head = find_encoder_head(pl_module)  # found once, read at every score
        if head is not None and self.shift_labels is None:  # labels aligned with the inputs
            self._shift = False
            self._notes.add(f"token labels scored unshifted: {type(head[1]).__name__}")
        rank_zero_warn(
            f"OverfitTinySubset changes training: this fit trains and validates on a fixed"
            f" subset of {self.num_examples} training examples (seed {self.seed}) for at most"
            f" {self.max_steps} updates; its results say whether the loop can learn, nothing"
            " about generalisation."
        )
        # trainer.datamodule is set at run time (mypy cannot see it); None is not overriding.
        datamodule = getattr(trainer, "datamodule", None)
        owner: Any = datamodule if is_overridden(_HOOK, datamodule) else pl_module
        original = getattr(owner, _HOOK)

        def on_before_batch_transfer(batch: Any, dataloader_idx: int) -> Any:
            return original(self._substitute(batch), dataloader_idx)

        # ``__wrapped__`` lets Lightning's is_overridden see the user's own hook, so which
        # object Lightning calls the hook on does not change.
        on_before_batch_transfer.__wrapped__ = original  # type: ignore[attr-defined]
        held = vars(owner).get(_HOOK, _ABSENT)
        setattr(owner, _HOOK, on_before_batch_transfer)
        limit = trainer.limit_val_batches
        self._installed = _Installed(owner, original, held, on_before_batch_transfer, limit or None)
        if limit:
            trainer.limit_val_batches = math.ceil(
                self.num_examples / (self.batch_size or self.num_examples)
            )

    def _substitute(self, batch: Any) -> Any:
        trainer = self._trainer
        if not self._batches or trainer is None or trainer.sanity_checking:
            return batch
        split = "train" if trainer.training else "val" if trainer.validating else None
        if split is None:
            return batch
        index = self._cursor[split] % len(self._batches)
        self._cursor[split] += 1
        # A fresh copy: a user hook may change the batch in place.
        return apply_to_collection(self._batches[index], torch.Tensor, torch.clone)

    def _restore(self) -> None:
        """Put back the hook and ``limit_val_batches`` (unless replaced since by someone else)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        installed, self._installed = self._installed, None
        if installed is None:
            return
        if vars(installed.owner).get(_HOOK) is installed.wrapper:
            if installed.held is _ABSENT:
                delattr(installed.owner, _HOOK)
            else:
                setattr(installed.owner, _HOOK, installed.held)
        if installed.limit_val_batches is not None and self._trainer is not None:
            self._trainer.limit_val_batches = installed.limit_val_batches

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader):
            self._notes.add("no single training DataLoader: the subset could not be built")
            return
        self._batches, indices = overfit.subset_batches(
            loader.dataset, self.num_examples, seed=self.seed,
            collate=loader.collate_fn or default_collate, batch_size=self.batch_size,
            notes=self._notes,
        )  # fmt: skip
        self.subset_ids = overfit.subset_ids(self._batches, indices, self.adapter, self._notes)
        rank_zero_info(f"OverfitTinySubset: subset ids {self.subset_ids}")
        if self.predict_fn is not None:
            self._source = "predict_fn"
        elif type(pl_module).forward not in (pl.LightningModule.forward, torch.nn.Module.forward):
            self._source = "forward"
        else:
            self._capture(pl_module, "the module has no forward")

    def _capture(self, pl_module: pl.LightningModule, why: str) -> None:
        """Read the predictions from the user's own training step from now on: a forward hook
        on each child of the module keeps the argmax of the last ``logits`` one returns."""
        self._source = "training_step"
        self._problem = why
        self._notes.add(overfit.capture_note(why))
        for name, child in pl_module.named_children():
            hook = functools.partial(self._on_child_output, name)
            self._handles.append(child.register_forward_hook(hook))

    def _on_child_output(self, name: str, module: Any, args: Any, output: Any) -> None:
        trainer = self._trainer
        if trainer is None or not trainer.training or trainer.sanity_checking:
            return
        try:
            predicted = overfit.captured_prediction(output)
            if predicted is not None:
                self._captured = (name, predicted)
        except Exception as err:  # reading predictions must never break the user's step
            self._notes.add(f"reading the logits of submodule '{name}' raised {error_text(err)}")

    def _keep_captured(self, batch: Any) -> None:
        """Pair the predictions captured in this training step with this batch's targets."""
        captured, self._captured = self._captured, None
        if captured is None:
            return
        name, predicted = captured
        targets = self.adapter.view(batch, count_tokens=False).targets
        if not isinstance(targets, torch.Tensor):
            self._notes.add("the training batches have no targets the adapter can read")
            return
        aligned = overfit.align_predictions(
            predicted, targets, shift=self._shift, ignore_index=self.adapter.ignore_index
        )
        if aligned is None:
            self._misaligned = (
                f"the logits of submodule '{name}' predict shape {tuple(predicted.shape)}, the"
                f" targets have shape {tuple(targets.shape)}"
            )
            self._notes.add(self._misaligned)
            return
        self._seen[(self._cursor["train"] - 1) % len(self._batches)] = aligned

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cursor["val"] = 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        if not self._batches:
            return
        if self._source == "training_step":
            self._keep_captured(batch)
        loss = step_loss(outputs)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._loss.add(float(loss.detach()) * trainer.accumulate_grad_batches)
        step = trainer.global_step
        closed = self._loss.close(step)
        if closed is None:
            return
        mean, micro = closed
        if step >= self.max_steps:
            trainer.should_stop = True  # first: the budget holds whatever follows
        result = self._evaluate(trainer, pl_module) if step % self.check_every == 0 else None
        row = overfit.overfit_row(
            step, mean, micro, target=self._target(), ids=self.subset_ids, result=result
        )
        self.run.append_rows(OVERFIT_TABLE, [{"schema_version": OVERFIT_SCHEMA_VERSION, **row}])
        done = overfit.overfit_done(mean, self._target(), result, required=self.required_recovery)
        if trainer.strategy.reduce_boolean_decision(done, all=False):
            trainer.should_stop = True

    def _target(self) -> float | None:
        return overfit.loss_target(
            self._loss.initial, target_loss=self.target_loss, target_fraction=self.target_fraction
        )

    def _evaluate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> overfit.Recovery | None:
        """Score the subset's predictions; ``None`` when there are none (the reason noted)."""
        if self._installed is None or not self._batches:
            return None
        try:
            return self._score(trainer, pl_module)
        except Exception as err:  # recorded (targets_recovered says it), never the fit's
            self._problem = f"scoring the subset raised {error_text(err)}"
            self._notes.add(self._problem)
            return None

    def _score(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> overfit.Recovery | None:
        if self._source != "training_step":
            scored = self._predict_subset(trainer, pl_module)
        elif len(self._seen) < len(self._batches):
            return None  # a subset batch not trained yet (or no logits captured)
        else:
            pairs = [self._seen[index] for index in range(len(self._batches))]
            scored = [(p.cpu(), t.cpu()) for p, t in pairs]
        if scored is None:
            return None
        joined = overfit.join_scored(
            scored, self.subset_ids, batch_size=self.batch_size,
            ignore_index=self.adapter.ignore_index, notes=self._notes,
        )  # fmt: skip
        if joined is None:
            return None
        self._last_step = trainer.global_step
        self._last = overfit.recovery(
            *joined, ignore_index=self.adapter.ignore_index, num_classes=self._classes(pl_module)
        )
        return self._last

    def _predict_subset(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """``(predictions, targets)`` on the CPU per subset batch, in eval mode without grad."""
        assert self._installed is not None
        original = self._installed.original
        scored = []
        with evaluating(pl_module), torch.no_grad():
            for cpu_batch in self._batches:
                batch = original(apply_to_collection(cpu_batch, torch.Tensor, torch.clone), 0)
                batch = trainer.strategy.batch_to_device(batch)
                view = self.adapter.view(batch, count_tokens=False)
                if not isinstance(view.targets, torch.Tensor):
                    self._notes.add("the subset's batches have no targets the adapter can read")
                    return None
                aligned = self._predict(pl_module, batch, view)
                if aligned is None:
                    return None
                scored.append((aligned[0].cpu(), aligned[1].cpu()))
        return scored

    def _predict(
        self, pl_module: pl.LightningModule, batch: Any, view: Any
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        try:
            if self.predict_fn is not None:
                out: Any = self.predict_fn(pl_module, batch)
            else:
                self._masked = view.attention_mask is not None
                masked = (view.attention_mask,) if self._masked else ()
                out = pl_module(view.inputs, *masked)
        except Exception as err:  # the user's forward or predict_fn: recorded, not raised
            self._fall_back(pl_module, f"{self._call_name(pl_module)} raised {error_text(err)}")
            return None
        aligned, problem = overfit.predicted_pair(
            out, view.targets, shift=self._shift, ignore_index=self.adapter.ignore_index,
            call=self._call_name(pl_module),
        )  # fmt: skip
        if problem is not None:
            self._fall_back(pl_module, problem)
        return aligned

    def _call_name(self, pl_module: pl.LightningModule) -> str:
        if self._source == "predict_fn":
            return "predict_fn(pl_module, batch)"
        return "forward(inputs, attention_mask)" if self._masked else "forward(inputs)"

    def _fall_back(self, pl_module: pl.LightningModule, problem: str) -> None:
        """``predict_fn`` failed: say so (the check is ``not_checked``). The forward failed:
        read the predictions from the training step from now on."""
        if self._source == "forward":
            self._capture(pl_module, problem)
        else:
            self._problem = problem
            self._notes.add(problem)

    def _unavailable(self) -> str | None:
        """Why ``targets_recovered`` has no predictions, with the remedy (said once)."""
        if self._last is not None or not self._batches:
            return None
        return overfit.unavailable_reason(
            self._source, seen=len(self._seen), batches=len(self._batches),
            problem=self._problem, misaligned=self._misaligned,
        )  # fmt: skip

    def _classes(self, pl_module: pl.LightningModule) -> int | None:
        size = self.num_classes or infer_output_size(pl_module)[0]
        head = self._head if size is None and self._batches else None
        if head is not None and type(head[1]).__name__.endswith("ForMultipleChoice"):
            # One logit per choice: the classes are the choices, input_ids [batch, choices, T].
            inputs = self.adapter.view(self._batches[0], count_tokens=False).inputs
            if isinstance(inputs, torch.Tensor) and inputs.ndim >= 3 and inputs.shape[1] >= 2:
                return int(inputs.shape[1])
        return size

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            if self._batches and self._loss.points and self._last_step != trainer.global_step:
                self._evaluate(trainer, pl_module)
        finally:
            self._finish(pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()
        super().teardown(trainer, pl_module, stage)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore()
        if self._run is not None and not self._run.closed:
            self._notes.add(f"the fit failed: {type(exception).__name__}: {exception}")
            self._finish(pl_module)
        super().on_exception(trainer, pl_module, exception)

    def _finish(self, pl_module: pl.LightningModule) -> None:
        if self._done or self._trainer is None:
            return
        self._done = True
        results = overfit.overfit_checks(
            self._loss, target=self._target(), last=self._last, last_step=self._last_step,
            num_classes=self._classes(pl_module), tolerance=self.init_tolerance,
            budget=self.max_steps, required=self.required_recovery,
            unavailable=self._unavailable(), subset=bool(self._batches), notes=self._notes,
            trainer_limits=(self._trainer.max_steps, self._trainer.max_epochs),
        )  # fmt: skip
        self.checks = {c.name: c for c in results}
        self.verdict, reason = self._put_checks(
            "overfit",
            results,
            **overfit.phase_columns(
                self._loss, self.subset_ids, self._notes, batch_size=self.batch_size
            ),
        )
        line = f"OverfitTinySubset: overfit verdict {self.verdict}"
        if self.verdict in ("fail", "warn"):
            rank_zero_warn(f"{line}: {reason}")
        else:
            rank_zero_info(f"{line}: {'; '.join(c.detail for c in results)}")
