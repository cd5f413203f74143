"""The :class:`Session`: the user's module on fake tensors with its optimizer, for one
precision, and its phases (train, validation, optimizer step, checkpoint save) traced under a
:class:`~lightning_pilot.estimate.recorder.Recorder`. Also the third-party patches a session
needs: modules imported during it run outside the fake mode and the recorder, ``transformers``
reads the real values of shadowed fake tensors, and a factory builds its module under the fake
mode (:func:`_factory_build`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from lightning_pilot.core import validate
from lightning_pilot.estimate.batches import _fake_batch, reshape_batch
from lightning_pilot.estimate.blocks import (
    CUTS,
    MIN_BLOCKS,
    cut_blocks,
    extrapolate_blocks,
    repeated_blocks,
)
from lightning_pilot.estimate.checkpointing import _checkpointing_choice, activation_checkpointing
from lightning_pilot.estimate.cuda import cuda_attention, cuda_autocast, cuda_dropout
from lightning_pilot.estimate.optimizers import (
    cuda_optimizer_defaults,
    optimizer_implementation,
    optimizer_of,
)
from lightning_pilot.estimate.precision import PRECISIONS, param_dtype, precision_context
from lightning_pilot.estimate.recorder import PhaseTrace, Recorder, UntraceableError
from lightning_pilot.estimate.shadows import _SHADOW, _is_fake, _shadow_of, _shadowable
from lightning_pilot.vocabulary import MEASURED_CATEGORIES, phase_label

if TYPE_CHECKING:
    from lightning_pilot.estimate.job import GridJob


def check_source(owner: str, module: object, factory: object) -> None:
    """What a trace runs: a live ``module`` (a ``torch.nn.Module``) or a ``factory`` building
    one, exactly one of them; else a clear error naming ``owner``."""
    if (module is None) == (factory is None):
        raise ValueError(
            validate.invalid(owner, "module", module, "a LightningModule, or None with factory")
        )
    if module is not None:
        validate.instance(owner, "module", module, torch.nn.Module, optional=False)
        if not _steps(module):
            raise TypeError(validate.invalid(owner, "module", module, _STEPS))
    validate.callable_or_none(owner, "factory", factory, "factory() -> LightningModule")


#: What a traced module has: the steps the estimate runs.
_STEPS = "a LightningModule (a torch.nn.Module with training_step and configure_optimizers)"


def _steps(module: object) -> bool:
    return isinstance(module, torch.nn.Module) and all(
        callable(getattr(module, name, None)) for name in ("training_step", "configure_optimizers")
    )


def _loss_of(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, torch.Tensor) else None


class Session:
    """The user's module on fake tensors, with its optimizer, for one precision.

    ``module`` is a live LightningModule (its parameters and buffers are replaced by fake ones
    for the session and given back, with its training flags, when it ends) or ``factory``, a
    callable building one under the fake mode (a 70B shape never allocates). Use it as a
    context manager; trace phases inside. ``round_to`` is the allocator's rounding (512 for
    CUDA). ``cuda=True`` runs the step as on CUDA: the optimizer's ``foreach`` default, fused
    attention saving no T x T matrix (:func:`cuda_attention`), CUDA autocast's lists
    (:func:`cuda_autocast`) and fused dropout (:func:`cuda_dropout`). ``blocks=True``: with a
    repeated block list of :data:`MIN_BLOCKS` or more (:func:`repeated_blocks`: Llama's
    ``model.layers``, GPT-2's ``transformer.h``), ``train_phases`` and ``validation_phase``
    trace it cut to :data:`CUTS` blocks and extrapolate (:func:`extrapolate_blocks`), else
    trace in full with a note.

    Example:
        >>> from lightning_pilot.demo import TinyCausalLM
        >>> model = TinyCausalLM(max_length=32)
        >>> before = model.token_embedding.weight
        >>> with Session(model, precision="bf16-true") as session:
        ...     session.module.token_embedding.weight.dtype
        torch.bfloat16
        >>> model.token_embedding.weight is before
        True
    """

    def __init__(
        self,
        module: Any = None,
        *,
        factory: Callable[[], Any] | None = None,
        precision: str = "32-true",
        round_to: int = 1,
        cuda: bool = False,
        checkpoint_classes: Sequence[type[torch.nn.Module]] = (),
        blocks: bool = True,
        capacity_factor: float = 1.0,
    ) -> None:
        owner = "Session"
        check_source(owner, module, factory)
        self._prepare(
            module,
            factory,
            precision=validate.choice(owner, "precision", precision, PRECISIONS),
            round_to=validate.integer(owner, "round_to", round_to, minimum=1),
            cuda=validate.boolean(owner, "cuda", cuda),
            checkpoint_classes=tuple(checkpoint_classes),
            blocks=validate.boolean(owner, "blocks", blocks),
            capacity_factor=validate.number(owner, "capacity_factor", capacity_factor, minimum=1.0),
        )

    @classmethod
    def from_job(cls, job: GridJob, precision: str) -> Session:
        """The session that traces ``precision`` of ``job``, whose arguments
        :class:`~lightning_pilot.estimate.job.GridJob` checked already (not entered yet)."""
        session = cls.__new__(cls)
        session._prepare(
            job.module,
            job.factory,
            precision=precision,
            round_to=512 if job.device == "cuda" else 1,
            cuda=job.device == "cuda",
            checkpoint_classes=tuple(job.checkpoint_classes),
            blocks=job.blocks,
            capacity_factor=job.capacity_factor,
        )
        return session

    def _prepare(
        self,
        module: Any,
        factory: Callable[[], Any] | None,
        *,
        precision: str,
        round_to: int,
        cuda: bool,
        checkpoint_classes: tuple[type[torch.nn.Module], ...],
        blocks: bool,
        capacity_factor: float,
    ) -> None:
        self.precision = precision
        self.round_to = round_to
        self.cuda = cuda
        self.checkpoint_classes = checkpoint_classes
        self.by_blocks = blocks
        #: ``(name, container)`` of the repeated block list the phases are cut to, or ``None``.
        self.blocks: tuple[str, torch.nn.Module] | None = None
        self._hidden: list[torch.nn.Module] = []
        self._live = module
        self._factory = factory
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.recorder = Recorder(round_to, fake_only=True)
        self.recorder.capacity_factor = capacity_factor
        self.module: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._stack = contextlib.ExitStack()
        self._warm: set[tuple[int | None, int | None]] = set()
        self._cut: tuple[Any, int] | None = None
        # (phase kind, checkpointing) -> why cutting failed for it: traced in full after.
        self._uncut: dict[tuple[Any, ...], str] = {}
        #: The optimizer's implementation, for the notes of the optimizer phases.
        self.optimizer_note = ""

    def __enter__(self) -> Session:
        stack = self._stack
        stack.__enter__()
        try:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            stack.enter_context(self.mode)
            stack.enter_context(self.recorder)
            stack.enter_context(_transformers_sees_real_values())
            if self.cuda:
                stack.enter_context(cuda_attention())
                stack.enter_context(cuda_autocast())
                stack.enter_context(cuda_dropout())
            if self._factory is not None:
                with _factory_build():
                    self.module = self._factory()
                if not _steps(self.module):
                    built = type(self.module).__name__
                    raise TypeError(f"factory() returned a {built}: expected {_STEPS}")
            else:
                self.module = self._live
                stack.callback(_keeper(self.module))
            self._fake_parameters()
            # What exists now lives through the session: later collections skip it (fast).
            gc.freeze()
            stack.callback(gc.unfreeze)
            if self.by_blocks:
                self.blocks = repeated_blocks(self.module)
        except BaseException:
            stack.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.optimizer = None
        self._stack.__exit__(*exc)

    def _fake_parameters(self) -> None:
        """Replace every parameter and buffer by a fake one of the precision's dtype."""
        dtype = param_dtype(self.precision)
        made: dict[int, torch.Tensor] = {}
        for sub in self.module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, value in list(table.items()):
                    if value is None:
                        continue
                    if _is_fake(value) and (value.dtype == dtype or not value.is_floating_point()):
                        continue  # built by the factory under the fake mode: already fake
                    table[name] = self._fake_like(value, dtype, made, table is sub._parameters)
                    if not _is_fake(value):  # the live module's own tensor: given back
                        self._stack.callback(table.__setitem__, name, value)
        for value in [*made.values(), *self.module.parameters(), *self.module.buffers()]:
            self.recorder.record(value)

    def _fake_like(
        self, value: torch.Tensor, dtype: torch.dtype, made: dict[int, torch.Tensor], param: bool
    ) -> torch.Tensor:
        fake = made.get(id(value))
        if fake is not None:
            return fake
        want = dtype if value.is_floating_point() else value.dtype
        fake = torch.empty(value.shape, dtype=want, device="cpu")
        if param:
            fake = torch.nn.Parameter(fake, requires_grad=value.requires_grad)
        else:
            # Buffers the step may read (position ids, step counters) keep a real copy of their
            # values when small or integer, made outside the trace (neither fake nor recorded).
            with _disable_current_modes():
                shadow = _shadow_of(value) if _is_fake(value) else value.detach().to("cpu", want)
                if shadow is not None and _shadowable(shadow):
                    setattr(fake, _SHADOW, shadow.clone())
        made[id(value)] = fake
        return fake

    def _serials(self, tensors: Any) -> set[int]:
        return {
            serial
            for tensor in tensors
            if isinstance(tensor, torch.Tensor)
            and (serial := self.recorder.serial(tensor)) is not None
        }

    def _state_tensors(self) -> tuple[list[torch.Tensor], ...]:
        """The live state by category: parameters, buffers, gradients, optimizer state."""
        params = self._parameters()
        # Those of the blocks left out of a cut block list included: still on the device.
        buffers = [b for part in (self.module, *self._hidden) for b in part.buffers()]
        grads = [p.grad for p in params if p.grad is not None]
        state: list[torch.Tensor] = []
        if self.optimizer is not None:
            for per_param in self.optimizer.state.values():
                state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
        return params, buffers, grads, state

    def _classes(self, batch: Any) -> dict[str, set[int]]:
        state = zip(MEASURED_CATEGORIES, self._state_tensors(), strict=True)
        return {
            **{name: self._serials(tensors) for name, tensors in state},
            "batch": self._serials(tree_flatten(batch)[0]),
            "activations": self.recorder.saved | self.recorder.held,
        }

    def measure_state(self) -> dict[str, int]:
        """Bytes of parameters, buffers, gradients and optimizer state now live (by category:
        ``param``, ``buffer``, ``grad``, ``optimizer_state``)."""
        live = self.recorder.live

        def total(tensors: list[torch.Tensor]) -> int:
            seen: dict[int, int] = {}
            for tensor in tensors:
                self.recorder.record(tensor)
                key = id(tensor.untyped_storage())
                seen[key] = live[key][1]
            return sum(seen.values())

        state = zip(MEASURED_CATEGORIES, self._state_tensors(), strict=True)
        return {name: total(tensors) for name, tensors in state}

    def gradient_blocks(self) -> list[int]:
        """The bytes of each gradient now live, one per storage (what a later update's
        ``zero_grad`` frees; see :mod:`~lightning_pilot.estimate.cache`)."""
        storages = [grad.untyped_storage() for grad in self._state_tensors()[2]]
        return sorted({id(storage): storage.nbytes() for storage in storages}.values())

    def _parameters(self) -> list[torch.Tensor]:
        """The module's parameters, those of the blocks a cut leaves out included."""
        return [p for part in (self.module, *self._hidden) for p in part.parameters()]

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        for param in self._parameters():
            param.grad = None

    def _mirror_gradients(self, container: torch.nn.Module, kept: int) -> None:
        """After a backward pass through the first ``kept`` blocks: the other blocks get the
        gradients the first one got (as a backward pass through all of them leaves)."""
        blocks = [b for b in container._modules.values() if b is not None]
        first = list(blocks[0].parameters())
        for block in blocks[kept:]:
            for model, param in zip(first, block.parameters(), strict=True):
                if model.grad is not None and param.grad is None:
                    param.grad = torch.empty_like(param)

    def _batch(self, batch: Any, micro_batch: int, seq_len: int | None) -> Any:
        with unset_fake_temporarily():
            real = reshape_batch(batch, micro_batch, seq_len)
        fake = _fake_batch(real, self.mode, self.precision)
        for tensor in tree_flatten(fake)[0]:
            if isinstance(tensor, torch.Tensor):
                self.recorder.record(tensor)
        return fake

    def _run(self, run: Callable[[], dict[str, PhaseTrace]]) -> dict[str, PhaseTrace]:
        """``run()`` with Python's cyclic garbage collected first and none collected during:
        a storage is then freed exactly when its last reference goes, never at the moment a
        collection happens to run (which would make two traces of the same step differ)."""
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        self.recorder.routed = set()
        try:
            traced = run()
        finally:
            if enabled:
                gc.enable()
        return _noted(traced, self.routing_note())

    def routing_note(self) -> str | None:
        """What the last trace assumed of a router (a ``topk`` over the model's floats):
        ``None`` when nothing was routed."""
        routed = sorted(self.recorder.routed)
        if not routed:
            return None
        which = ", ".join(f"top-{k} of {e} experts" for e, k in routed)
        factor = self.recorder.capacity_factor
        how = "balanced: each expert given tokens x top-k / experts of the tokens"
        if factor > 1.0:
            how = (
                f"the busiest expert given {factor:g} x the balanced share (tokens x top-k /"
                " experts), the others the rest evenly"
            )
        return (
            f"routing: assumed, {how} ({which}); the router's real choice depends on the"
            " model's floats"
        )

    def _by_blocks(
        self, run: Callable[[], dict[str, PhaseTrace]], key: Any, *, train: bool = False
    ) -> dict[str, PhaseTrace]:
        """``run()`` on the whole module, or, with a repeated block list, on the list cut to
        :data:`CUTS` blocks, extrapolated to all (:func:`extrapolate_blocks`); traced in full,
        with a note saying why, when the cut traces do not follow the pattern or fail."""
        if self.blocks is None:
            note = (
                f"blocks: traced in full (no repeated block list of {MIN_BLOCKS} or more blocks"
                " of one class)"
            )
            return _noted(self._run(run), note if self.by_blocks else None)
        uncut = key[:1] + key[3:]
        if uncut in self._uncut:  # cut once without the pattern: trace in full
            return _noted(self._run(run), self._uncut[uncut])
        name, container = self.blocks
        count = len(container._modules)
        kind = type(next(iter(container._modules.values()))).__name__
        cut: list[dict[str, PhaseTrace]] = []
        reason: str | None = None
        try:
            for k in CUTS:
                with cut_blocks(container, k) as hidden:
                    self._hidden = hidden
                    self._cut = (key, k)
                    cut.append(self._run(run))
        except UntraceableError:
            raise
        except Exception as err:  # the cut module fails where the whole may not
            reason = f"the trace cut to {len(cut) + 1} blocks failed ({type(err).__name__}: {err})"
        finally:
            self._hidden = []
            self._cut = None
        if train and len(cut) == len(CUTS):
            self._mirror_gradients(container, CUTS[-1])
        made: dict[str, PhaseTrace] = {}
        if reason is None:
            for phase in cut[0]:
                extrapolated, reason = extrapolate_blocks([c[phase] for c in cut], count)
                if extrapolated is None:
                    break
                made[phase] = extrapolated
        if reason is None:
            note = (
                f"blocks: traced with {name} cut to {', '.join(map(str, CUTS))} of its {count}"
                f" {kind} blocks;"
                " every operator's live bytes, FLOPs and bytes moved extrapolated to"
                f" {count} (affine in the block count, checked on the three)"
            )
            return _noted(made, note)
        note = f"blocks: traced in full ({count} blocks of {name}): {reason}"
        self._uncut[uncut] = note
        return _noted(self._run(run), note)

    def train_phases(
        self,
        batch: Any,
        *,
        micro_batch: int,
        seq_len: int | None = None,
        checkpointing: bool | str = False,
    ) -> dict[str, PhaseTrace]:
        """Trace ``forward`` (``training_step``, loss included) and ``backward`` of one
        micro-batch, from no gradients (as the first update; later updates add the gradients
        and the optimizer state, live throughout). With a repeated block list (and
        ``blocks=True``), traced on the list cut to :data:`CUTS` blocks and extrapolated.
        ``checkpointing``: ``False``, ``True`` or ``"selective"`` (per operator, see
        :func:`selective_checkpoint_context`)."""
        checkpointing = _checkpointing_choice("Session.train_phases", checkpointing)
        return self._by_blocks(
            lambda: self._train_traced(batch, micro_batch, seq_len, checkpointing),
            ("train", micro_batch, seq_len, checkpointing),
            train=True,
        )

    def _train_traced(
        self, batch: Any, micro_batch: int, seq_len: int | None, checkpointing: bool | str
    ) -> dict[str, PhaseTrace]:
        recorder = self.recorder
        module = self.module
        if not getattr(module, "automatic_optimization", True):
            raise ValueError(
                "the module uses manual optimization (automatic_optimization=False): the"
                " estimate runs training_step, backward and the optimizer step itself"
            )
        self._zero_grad()
        # What of a later update's state is already live (the optimizer state, once built).
        included = {"grad": 0, "optimizer_state": self.measure_state()["optimizer_state"]}
        fake = self._batch(batch, micro_batch, seq_len)
        module.train()
        before = _cached_attributes(module)
        traces: dict[str, PhaseTrace] = {}
        with contextlib.ExitStack() as stack:
            if checkpointing:
                stack.enter_context(
                    activation_checkpointing(
                        module, self.checkpoint_classes, checkpointing == "selective"
                    )
                )
            recorder.saved = set()
            recorder.held = set()
            recorder.begin("forward")
            with recorder.saved_hooks(), precision_context(self.precision):
                output = module.training_step(fake, 0)
            loss = _loss_of(output)
            if loss is None:
                raise ValueError(
                    "training_step returned no loss (a tensor, or a dict with 'loss'): nothing"
                    " to back-propagate"
                )
            params, buffers = self._state_tensors()[:2]
            recorder.held = recorder.live_serials() - self._serials(
                [*params, *buffers, *tree_flatten(fake)[0]]
            )
            traces["forward"] = recorder.end(self._classes(fake))
            del output
            recorder.begin("backward")
            with recorder.saved_hooks():
                loss.backward()  # type: ignore[no-untyped-call]
            del loss
            traces["backward"] = recorder.end(self._classes(fake))
        recorder.saved = set()
        recorder.held = set()
        del fake
        warm = (seq_len, self._cut[1] if self._cut else None)
        cold = _cached_attributes(module) != before and warm not in self._warm
        self._warm.add(warm)
        if cold:
            # The first forward pass built a cache on the module (a mask, a positional
            # table) a later update reuses: trace again, as a later update does.
            return self._train_traced(batch, micro_batch, seq_len, checkpointing)
        for trace in traces.values():
            trace.included = dict(included)
        return traces

    def build_optimizer(self) -> torch.optim.Optimizer:
        """Call the module's ``configure_optimizers`` (CUDA's ``foreach`` default applied when
        ``cuda``)."""
        optimizer = optimizer_of(self.module.configure_optimizers())
        asked = optimizer_implementation(optimizer)
        if self.cuda:
            cuda_optimizer_defaults(optimizer)
        self.optimizer = optimizer
        used = optimizer_implementation(optimizer)
        why = "as configure_optimizers asked"
        if used != asked:
            why = "PyTorch's default on CUDA; left unset by the module"
        self.optimizer_note = (
            f"optimizer: {type(optimizer).__name__}, {used} implementation ({why})"
        )
        self.optimizer_note += {
            "foreach": ": temporaries for a whole parameter group at once",
            "fused": ": one kernel per group, no temporaries",
            "for-loop": ": one parameter's temporaries at a time",
        }.get(used, "")
        return optimizer

    def optimizer_phases(self) -> dict[str, PhaseTrace]:
        """Trace the first optimizer step (state allocated) and a later one, with gradients
        of every trainable parameter live (as after a backward pass); keyed by their
        :func:`~lightning_pilot.vocabulary.phase_label` (``optimizer_step_first``,
        ``optimizer_step``)."""
        optimizer = self.optimizer if self.optimizer is not None else self.build_optimizer()
        for param in self.module.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.empty_like(param)
        traces: dict[str, PhaseTrace] = {}
        for phase in (phase_label("optimizer_step", True), "optimizer_step"):
            self.recorder.begin(phase)
            with precision_context("32-true"):
                optimizer.step()
            traces[phase] = self.recorder.end(self._classes(()))
            traces[phase].notes.append(self.optimizer_note)
        return traces

    def validation_phase(
        self, batch: Any, *, micro_batch: int, seq_len: int | None = None
    ) -> PhaseTrace:
        """Trace ``validation_step`` in eval mode under ``torch.no_grad()`` (cut to blocks as
        :meth:`train_phases`)."""
        return self._by_blocks(
            lambda: {"validation": self._validation_traced(batch, micro_batch, seq_len)},
            ("validation", micro_batch, seq_len),
        )["validation"]

    def _validation_traced(self, batch: Any, micro_batch: int, seq_len: int | None) -> PhaseTrace:
        module = self.module
        fake = self._batch(batch, micro_batch, seq_len)
        module.eval()
        try:
            self.recorder.begin("validation")
            with torch.no_grad(), precision_context(self.precision):
                module.validation_step(fake, 0)
            trace = self.recorder.end(self._classes(fake))
        finally:
            module.train()
        return trace

    def save_phase(self) -> PhaseTrace:
        """Trace the state dicts a checkpoint holds (model and optimizer). Serializing them
        copies each storage to host memory one at a time on CUDA: no device memory."""
        self.recorder.begin("checkpoint_save")
        state = {"state_dict": self.module.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        trace = self.recorder.end(self._classes(()))
        del state
        trace.notes.append(
            "checkpoint_save: state_dict() traced; torch.save copies storages to host memory"
            " one at a time (no device memory), modelled, not traced"
        )
        return trace


def _noted(traces: dict[str, PhaseTrace], note: str | None) -> dict[str, PhaseTrace]:
    """``traces``, ``note`` (when given) appended to the notes of each."""
    if note:
        for trace in traces.values():
            trace.notes.append(note)
    return traces


def _cached_attributes(module: torch.nn.Module) -> dict[tuple[int, str], int]:
    """``(submodule, name) -> id(value)`` of the tensor attributes (not parameters or
    buffers) of every submodule: what a forward pass that caches a tensor changes."""
    return {
        (id(sub), name): id(value)
        for sub in module.modules()
        for name, value in vars(sub).items()
        if isinstance(value, torch.Tensor)
    }


def _keeper(module: torch.nn.Module) -> Callable[[], None]:
    """What gives back the training flags and the tensor (or ``None``) attributes of every
    submodule as they are now: a ``forward`` that caches a mask on ``self`` leaves no fake
    tensor behind."""
    kept = []
    for sub in module.modules():
        values = {k: v for k, v in vars(sub).items() if v is None or isinstance(v, torch.Tensor)}
        kept.append((sub, sub.training, values))

    def give_back() -> None:
        for sub, training, values in kept:
            sub.training = training
            for name, value in list(vars(sub).items()):
                if name in values:
                    if value is not values[name]:
                        setattr(sub, name, values[name])
                elif _is_fake(value):
                    delattr(sub, name)

    return give_back


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

        def exec_module(module: Any) -> None:
            if not self.active:
                execute(module)
                return
            with _disable_current_modes():
                execute(module)
            self.on_import(fullname, module)

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
