"""The dataset scan across splits: class histograms, group leakage and duplicate inputs over the
first items of each split's datasets; values in, ``CheckResult`` out, no Trainer
(docs/data-and-overfit.md)."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset

from lightning_pilot.core.batches import INPUT_KEYS, BatchAdapter
from lightning_pilot.core.checks import CheckResult, _judged, shown_names


def class_histogram(labels: Iterable[Any], *, ignore_index: int = -100) -> dict[int, int]:
    """Count examples per class (integer labels; ``ignore_index`` and non-integers skipped)."""
    counts: Counter[int] = Counter()
    for label in labels:
        value = label.item() if isinstance(label, torch.Tensor) and label.numel() == 1 else label
        if isinstance(value, bool) or not isinstance(value, int) or value == ignore_index:
            continue
        counts[value] += 1
    return dict(sorted(counts.items()))


def check_class_histograms(histograms: Mapping[str, Mapping[int, int]]) -> list[CheckResult]:
    """Compare the class histograms of the splits (``train`` first): ``class_histograms``,
    ``val_classes_in_train`` and ``label_ranges_agree`` (docs/data-and-overfit.md)."""
    present = {split: dict(h) for split, h in histograms.items() if h}
    if not present:
        return [CheckResult("class_histograms", "not_checked", "no class labels were read")]
    summary = "; ".join(
        f"{split}: " + ", ".join(f"{c}:{n}" for c, n in h.items()) for split, h in present.items()
    )
    results = [CheckResult("class_histograms", "pass", summary)]
    train = present.get("train")
    if train is None:
        why = "no training labels were read"
        return [*results, CheckResult("val_classes_in_train", "not_checked", why)]
    others = {split: h for split, h in present.items() if split != "train"}
    unseen = {split: sorted(set(h) - set(train)) for split, h in others.items()}
    text = "; ".join(f"{split} class(es) {shown_names(c)}" for split, c in unseen.items() if c)
    problem = f"{text} never occur in training: the model cannot learn them"
    results.append(_judged("val_classes_in_train", problem if text else None, "warn"))
    low, high = min(train), max(train)
    text = ", ".join(
        f"{split} [{min(h)}, {max(h)}]"
        for split, h in others.items()
        if min(h) < low or max(h) > high
    )
    problem = (
        f"label ranges differ between splits: train [{low}, {high}], {text} (labels"
        " shifted or numbered differently in one split?)"
    )
    results.append(_judged("label_ranges_agree", problem if text else None, "warn"))
    return results


def find_shared(keys_by_split: Mapping[str, Iterable[Hashable]]) -> dict[Hashable, list[str]]:
    """Keys found in more than one split, with the splits they are in (in split order)."""
    where: dict[Hashable, list[str]] = {}
    for split, keys in keys_by_split.items():
        for key in dict.fromkeys(keys):
            where.setdefault(key, []).append(split)
    return {key: splits for key, splits in where.items() if len(splits) > 1}


def check_leakage(
    keys_by_split: Mapping[str, Sequence[Hashable]] | None, *, scanned: Mapping[str, int]
) -> CheckResult:
    """Fail when a group key (``None``: no ``group_fn``) is in more than one split; ``scanned``:
    the examples scanned per split."""
    name = "split_leakage"
    if keys_by_split is None:
        detail = "no group_fn given: pass group_fn=lambda example: <conversation/patient/document>"
        return CheckResult(name, "not_checked", detail)
    if len(keys_by_split) < 2:
        detail = f"only {len(keys_by_split)} split(s) readable: nothing to compare"
        return CheckResult(name, "not_checked", detail)
    scope = ", ".join(f"{split} {n}" for split, n in scanned.items())
    shared = find_shared(keys_by_split)
    if not shared:
        groups = sum(len(set(k)) for k in keys_by_split.values())
        detail = f"{groups} group(s), none in two splits (examples scanned: {scope})"
        return CheckResult(name, "pass", detail)
    listed = [f"{key!r} ({'+'.join(splits)})" for key, splits in shared.items()]
    detail = (
        f"{len(shared)} group(s) found in more than one split: {shown_names(listed)} (examples"
        f" scanned: {scope}); split by group, not by example"
    )
    return CheckResult(name, "fail", detail)


def input_fingerprint(value: Any) -> str | None:
    """A stable digest of one example's input: tensor bytes with dtype and shape; for a dict
    (several inputs) or a list or tuple, the digests of its parts with their keys; else its repr."""
    if value is None:
        return None
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            digest.update(f"{key!r}={input_fingerprint(value[key])};".encode())
    elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        # A tensor's repr shortens it: each part by its own digest.
        parts = ",".join(str(input_fingerprint(part)) for part in value)
        digest.update(f"{type(value).__name__}({parts})".encode())
    else:
        digest.update(repr(value).encode())
    return digest.hexdigest()


def check_duplicates(
    fingerprints_by_split: Mapping[str, Sequence[str | None]], *, scanned: Mapping[str, int]
) -> CheckResult:
    """Report exact duplicate inputs found in more than one split (a warning); a fingerprint
    covers everything that identifies an example (:meth:`BatchAdapter.example_inputs`)."""
    name = "duplicate_inputs_across_splits"
    known = {s: [f for f in fps if f is not None] for s, fps in fingerprints_by_split.items()}
    known = {s: fps for s, fps in known.items() if fps}
    if len(fingerprints_by_split) < 2:
        detail = f"{len(fingerprints_by_split)} split(s) scanned: nothing to compare"
        return CheckResult(name, "not_checked", detail)
    if len(known) < 2:
        unread = [split for split in fingerprints_by_split if split not in known]
        detail = (
            f"the inputs of {', '.join(unread)} could not be read (a dict item needs one of the"
            f" keys {', '.join(INPUT_KEYS)}): give BatchAdapter(inputs=...) if they are"
            " elsewhere"
        )
        return CheckResult(name, "not_checked", detail)
    shared = find_shared(known)
    scope = ", ".join(f"{split} {n}" for split, n in scanned.items())
    if not shared:
        return CheckResult(name, "pass", f"no input in two splits (examples scanned: {scope})")
    pairs = Counter("+".join(splits) for splits in shared.values())
    text = ", ".join(f"{n} in {pair}" for pair, n in pairs.items())
    detail = (
        f"{len(shared)} exact duplicate input(s) across splits: {text} (examples scanned:"
        f" {scope}); an evaluation on them measures memory, not generalisation"
    )
    return CheckResult(name, "warn", detail)


def first_items(dataset: Any, limit: int) -> Iterator[Any]:
    """The first ``limit`` items of a dataset: by index, or iterated when it has no length."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        yield from itertools.islice(iter(dataset), limit)
        return
    for index in range(min(len(dataset), limit)):
        yield dataset[index]


@dataclass(eq=False)
class DatasetScan:
    """Class histograms, leakage and duplicates over the first ``max_examples`` items of each split
    (user code that raises is listed in :attr:`raised`)."""

    adapter: BatchAdapter
    _: KW_ONLY
    max_examples: int
    group_fn: Callable[[Any], Hashable] | None = None
    raised: list[CheckResult] = field(default_factory=list, init=False)

    def run(
        self, datasets: Mapping[str, Sequence[Any]], problems: Sequence[CheckResult] = ()
    ) -> list[CheckResult]:
        """The checks over the datasets of each split; ``problems`` (splits left out) last. The
        random states are restored afterwards: random transforms do not change the fit."""
        keys: dict[str, list[Hashable]] = {}
        prints: dict[str, list[str | None]] = {}
        labels: dict[str, dict[int, int]] = {}
        scanned: dict[str, int] = {}
        left_out: list[CheckResult] = []
        group_error: CheckResult | None = None
        python_state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):
                for split, sets in datasets.items():
                    try:
                        items = [i for d in sets for i in first_items(d, self.max_examples)]
                        views = [self.adapter.view(item, count_tokens=False) for item in items]
                        # Everything that identifies an example: a CLIP pair is its caption and
                        # its image together (a caption shared by two images is no duplicate).
                        found = [self.adapter.example_inputs(item) for item in items]
                    except Exception as err:  # the user's dataset or adapter: report it
                        detail = (
                            f"reading the {split} dataset raised {type(err).__name__}: {err};"
                            f" split leakage, duplicates and class histograms leave {split} out:"
                            " check the dataset's items (dataset[i]) and the adapter's field specs"
                        )
                        left_out.append(
                            CheckResult(f"{split}/split_leakage", "not_checked", detail)
                        )
                        continue
                    if not items:
                        continue
                    scanned[split] = len(items)
                    prints[split] = [input_fingerprint(value) for value in found]
                    labels[split] = class_histogram(
                        (v.targets for v in views), ignore_index=self.adapter.ignore_index
                    )
                    if self.group_fn is not None and group_error is None:
                        try:
                            keys[split] = [self.group_fn(item) for item in items]
                        except Exception as err:  # the user's function: report it
                            detail = (
                                f"group_fn raised {type(err).__name__}: {err} on a {split} item:"
                                " fix group_fn (it receives one dataset item, as dataset[i]"
                                " returns it)"
                            )
                            group_error = CheckResult("split_leakage", "not_checked", detail)
        finally:
            random.setstate(python_state)
        self.raised += [*left_out, *([group_error] if group_error else [])]
        results = check_class_histograms(labels) if any(labels.values()) else []
        leakage = group_error or check_leakage(keys if self.group_fn else None, scanned=scanned)
        results += [leakage, check_duplicates(prints, scanned=scanned)]
        return [*results, *problems, *left_out]
