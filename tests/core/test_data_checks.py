"""Pure data checks: ids, targets, label ranges, masks, lengths, histograms and leakage."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_pilot.core.batch_checks import (
    check_attention_mask,
    check_ids,
    check_padding,
    check_targets_present,
    check_truncation,
    row_lengths,
    target_kind,
)
from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.checks import CheckResult
from lightning_pilot.core.data_checks import DataInspection, example_rows
from lightning_pilot.core.label_checks import (
    SHIFTED_LABELS_ADVICE,
    CausalLMWatch,
    check_causal_lm_labels,
    check_label_range,
    check_label_shift,
    find_causal_lm,
    find_encoder_decoder,
    infer_output_size,
    label_relations,
)
from lightning_pilot.core.prompt_checks import check_instruction_masking, check_loss_positions
from lightning_pilot.core.split_inspection import SplitInspection
from lightning_pilot.core.split_scan import (
    DatasetScan,
    check_class_histograms,
    check_duplicates,
    check_leakage,
    class_histogram,
    find_shared,
    first_items,
    input_fingerprint,
)
from lightning_pilot.demo import InstructionCollator, InstructionDataset, TinyCausalLM, decode


@pytest.mark.parametrize(
    ("ids", "size", "verdict", "detail"),
    [
        ([1, 2, 3], 3, "pass", "3 unique id(s)"),
        ([1, 2, 2], 3, "fail", "1 id(s) repeated within one batch: 2"),
        ([1, None], 2, "fail", "1 example(s) without an id at batch position(s) 1"),
        ([1, 2], 3, "fail", "2 id(s) for 3 example(s)"),
        (None, 3, "not_checked", "field 'ids' not found"),
    ],
)
def test_check_ids(ids: Any, size: int, verdict: str, detail: str) -> None:
    result = check_ids(ids, size)
    assert (result.name, result.verdict) == ("ids_present_unique", verdict)
    assert detail in result.detail


def test_targets_present_names_the_missing_field() -> None:
    assert check_targets_present(None).verdict == "not_checked"
    assert "field 'targets' not found" in check_targets_present(None).detail
    assert check_targets_present(torch.zeros(0)).verdict == "fail"
    assert check_targets_present(torch.tensor([1])).verdict == "pass"


@pytest.mark.parametrize(
    ("labels", "size", "verdict", "detail"),
    [
        ([0, 3, -100, -100], 4, "pass", "labels in [0, 3] within 4 outputs"),
        ([1, 2, 3, 4], 4, "fail", "1 of 4 label value(s) outside [0, 3]"),
        ([0, 1, 2, 3], 3, "fail", "values 3"),
        ([0, -1, 2], 4, "fail", "negative labels other than the ignore index -100"),
        ([0, 5], None, "not_checked", "labels span [0, 5] but the model's output size is unknown"),
        ([-100, -100], 4, "not_checked", "every target is the ignore index -100"),
    ],
)
def test_label_range(labels: list[int], size: int | None, verdict: str, detail: str) -> None:
    result = check_label_range(torch.tensor(labels), output_size=size, ignore_index=-100)
    assert result.verdict == verdict
    assert detail in result.detail


def test_label_range_hints_a_shift_and_skips_float_targets() -> None:
    shifted = check_label_range(torch.tensor([1, 2, 3, 4]), output_size=4, ignore_index=-100)
    assert "shifted by one class" in shifted.detail
    assert check_label_range(torch.rand(3), output_size=4, ignore_index=-100).verdict == (
        "not_checked"
    )


def test_infer_output_size_heuristic_order() -> None:
    assert infer_output_size(TinyCausalLM(d_model=16, n_heads=2, n_layers=1))[0] == 23
    assert infer_output_size(TinyCausalLM(d_model=16, n_heads=2, n_layers=1))[1] == (
        "out_features of the head 'head'"
    )
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 5))
    assert infer_output_size(mlp) == (5, "out_features of the last nn.Linear '1'")

    class WithEmbeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = nn.Linear(4, 11)
            self.other = nn.Linear(11, 2)

        def get_output_embeddings(self) -> nn.Module:
            return self.decoder

    assert infer_output_size(WithEmbeddings())[0] == 11
    assert infer_output_size(nn.Conv1d(2, 3, 1)) == (None, "no nn.Linear head found in the module")


def test_target_kind() -> None:
    tokens = torch.zeros(2, 5, dtype=torch.long)
    assert target_kind(tokens, tokens) == "sequence"
    assert target_kind(torch.zeros(2, 3), torch.tensor([0, 1])) == "classification"
    assert target_kind(torch.zeros(2, 3), torch.zeros(2)) == "regression"
    assert target_kind(tokens, None) == "unknown"


def test_truncation_and_padding() -> None:
    assert check_truncation([5, 8, 8, 3], 8).verdict == "warn"
    assert "2 of 4 sequence(s) (50%) reach max_length=8" in check_truncation([5, 8, 8, 3], 8).detail
    assert check_truncation([5, 7], 8).verdict == "pass"
    assert check_truncation([5, 7], None).verdict == "not_checked"
    assert check_truncation(None, 8).verdict == "not_checked"
    assert check_padding(60, 100).verdict == "warn"
    assert check_padding(10, 100).detail == "10.0% of 100 positions are padding"
    assert check_padding(0, 0).verdict == "not_checked"
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert row_lengths(torch.zeros(2, 3, dtype=torch.long), mask) == [2, 3]
    assert row_lengths(torch.zeros(2, 3), None) is None


def _named(results: list[Any]) -> dict[str, Any]:
    return {r.name: r for r in results}


def test_attention_mask_checks() -> None:
    inputs = torch.tensor([[5, 6, 0], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    labels = torch.tensor([[-100, 6, -100], [-100, 6, 7]])
    good = _named(check_attention_mask(inputs, mask, labels, ignore_index=-100, pad_token_id=0))
    assert {r.verdict for r in good.values()} == {"pass"}
    assert set(good) == {
        "attention_mask_shape",
        "attention_mask_values",
        "attention_mask_contiguous",
        "padding_token_masked",
        "padding_not_in_loss",
    }
    leaking = labels.clone()
    leaking[0, 2] = 0
    bad = _named(check_attention_mask(inputs, mask, leaking, ignore_index=-100))
    assert bad["padding_not_in_loss"].verdict == "fail"
    assert "1 padding position(s) have a label other than -100" in bad["padding_not_in_loss"].detail
    holes = _named(
        check_attention_mask(inputs, torch.tensor([[1, 0, 1], [1, 1, 1]]), None, ignore_index=-100)
    )
    assert holes["attention_mask_contiguous"].verdict == "warn"
    shape = check_attention_mask(inputs, torch.ones(2, 4), None, ignore_index=-100)
    assert (shape[0].name, shape[0].verdict) == ("attention_mask_shape", "fail")
    values = _named(check_attention_mask(inputs, mask * 2, None, ignore_index=-100))
    assert values["attention_mask_values"].verdict == "fail"
    assert check_attention_mask(inputs, None, None, ignore_index=-100)[0].verdict == "not_checked"


def test_instruction_masking_and_loss_positions() -> None:
    batch = InstructionCollator(32)([InstructionDataset(size=4, seed=0)[i] for i in range(4)])
    inputs, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    masked = check_instruction_masking(inputs, labels, mask, ignore_index=-100)
    assert masked.verdict == "pass"
    # The planted bug: labels are the inputs on every real token (the instruction is a target).
    unmasked = torch.where(mask.bool(), inputs, torch.full_like(inputs, -100))
    result = check_instruction_masking(inputs, unmasked, mask, ignore_index=-100)
    assert result.verdict == "warn"
    assert "labels equal input_ids on all" in result.detail
    assert check_loss_positions(labels, ignore_index=-100).verdict == "pass"
    cut = labels.clone()
    cut[1] = -100
    assert "rows 1" in check_loss_positions(cut, ignore_index=-100).detail


def test_class_histograms_warn_on_unseen_classes_and_shifted_ranges() -> None:
    assert class_histogram([0, 2, torch.tensor(2), -100, 1.5]) == {0: 1, 2: 2}
    clean = _named(check_class_histograms({"train": {0: 5, 1: 4}, "val": {0: 1, 1: 2}}))
    assert {r.verdict for r in clean.values()} == {"pass"}
    assert clean["class_histograms"].detail == "train: 0:5, 1:4; val: 0:1, 1:2"
    shifted = _named(check_class_histograms({"train": {1: 5, 2: 4}, "val": {0: 3, 1: 2}}))
    assert shifted["val_classes_in_train"].verdict == "warn"
    assert "val class(es) 0 never occur in training" in shifted["val_classes_in_train"].detail
    assert shifted["label_ranges_agree"].verdict == "warn"
    assert "train [1, 2], val [0, 1]" in shifted["label_ranges_agree"].detail
    assert check_class_histograms({})[0].verdict == "not_checked"


def test_leakage_lists_groups_in_two_splits() -> None:
    assert find_shared({"train": [1, 1, 2], "val": [2, 3], "test": [3, 1]}) == {
        1: ["train", "test"],
        2: ["train", "val"],
        3: ["val", "test"],
    }
    scanned = {"train": 3, "val": 2}
    leak = check_leakage({"train": ["a", "b", "c"], "val": ["c", "d"]}, scanned=scanned)
    assert leak.verdict == "fail"
    assert "1 group(s) found in more than one split: 'c' (train+val)" in leak.detail
    clean = check_leakage({"train": ["a", "b"], "val": ["c"]}, scanned=scanned)
    assert clean.verdict == "pass"
    assert check_leakage(None, scanned=scanned).verdict == "not_checked"
    assert check_leakage({"train": ["a"]}, scanned=scanned).verdict == "not_checked"


def test_duplicate_inputs_are_reported() -> None:
    a, b = input_fingerprint(torch.tensor([1, 2])), input_fingerprint(torch.tensor([1, 3]))
    assert a == input_fingerprint(torch.tensor([1, 2]))
    assert a != input_fingerprint(torch.tensor([1.0, 2.0]))  # dtype is part of the input
    assert input_fingerprint(None) is None
    result = check_duplicates({"train": [a, b], "val": [a]}, scanned={"train": 2, "val": 1})
    assert result.verdict == "warn"
    assert "1 exact duplicate input(s) across splits: 1 in train+val" in result.detail
    assert check_duplicates({"train": [a], "val": [b]}, scanned={}).verdict == "pass"
    assert check_duplicates({"train": [a], "val": [None]}, scanned={}).verdict == "not_checked"


def test_split_inspection_folds_batches_and_keeps_the_worst() -> None:
    adapter = BatchAdapter()
    inspection = SplitInspection("train", ignore_index=-100, output_size=4, max_length=3)
    inspection.add(
        adapter.view(
            {"ids": torch.tensor([0, 1]), "x": torch.zeros(2, 2), "y": torch.tensor([0, 3])}
        )
    )
    inspection.add(
        adapter.view(
            {"ids": torch.tensor([2, 3]), "x": torch.zeros(2, 2), "y": torch.tensor([1, 4])}
        )
    )
    checks = _named(inspection.checks())
    assert checks["train/label_range"].verdict == "fail"
    assert "values 4" in checks["train/label_range"].detail
    assert checks["train/ids_present_unique"].verdict == "pass"
    assert (inspection.batches, inspection.examples) == (2, 4)
    empty = SplitInspection("val", ignore_index=-100).checks()
    assert [(c.name, c.verdict) for c in empty] == [("val/batches", "not_checked")]


def test_example_rows_decode_tokens_targets_and_loss_positions() -> None:
    batch = InstructionCollator(32)([InstructionDataset(size=2, seed=0)[i] for i in range(2)])
    view = BatchAdapter().view(batch)
    rows = example_rows(
        view, split="train", batch_index=0, limit=5, ignore_index=-100, max_length=32, decode=decode
    )
    assert len(rows) == 2
    first = rows[0]
    assert first["example_id"] == "0"
    assert first["input_text"].startswith("<bos>")
    assert first["length"] == len(first["input_tokens"])
    assert first["loss_tokens"] == len(first["loss_positions"]) > 0
    assert first["target"].endswith("<eos>")
    assert first["truncated"] is False
    plain = example_rows(
        BatchAdapter().view((torch.ones(3, 2), torch.tensor([1, 0, 1]))),
        split="val",
        batch_index=1,
        limit=2,
        ignore_index=-100,
    )
    assert [r["target"] for r in plain] == ["1", "0"]
    assert plain[0]["input_values"] == [1.0, 1.0]
    assert plain[0]["notes"] == "no id in the batch"


# ---------------------------------------------------------------------------------------------
# Labels against input_ids: identical, shifted, other
# ---------------------------------------------------------------------------------------------

IDS = torch.tensor([[5, 6, 7, 8, 0], [9, 8, 7, 6, 5]])


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ([[-100, 6, 7, 8, -100], [-100, -100, 7, 6, 5]], ["identical", "identical"]),
        ([[6, 7, 8, -100, -100], [8, 7, 6, 5, -100]], ["shifted by 1", "shifted by 1"]),
        ([[-100, 5, 6, 7, -100], [-100, 9, 8, 7, 6]], ["shifted by -1", "shifted by -1"]),
        ([[1, 2, 3, 4, -100], [-100] * 5], ["other", None]),
        # Only the last position counted: no shift to compare, and it is not identical.
        ([[-100, -100, -100, -100, 3], [-100, -100, -100, -100, 5]], ["other", "identical"]),
    ],
)
def test_label_relations(labels: list[list[int]], expected: list[str | None]) -> None:
    assert label_relations(IDS, torch.tensor(labels), ignore_index=-100) == expected


def test_label_relations_need_token_sequences() -> None:
    assert label_relations(torch.zeros(2, 3), torch.tensor([0, 1]), ignore_index=-100) is None
    assert label_relations(IDS, IDS[:, :3], ignore_index=-100) is None


def test_check_label_shift_verdicts() -> None:
    clean = check_label_shift({"identical": 6})
    assert (clean.name, clean.verdict) == ("label_shift", "pass")
    assert clean.detail == (
        "labels equal input_ids where counted (the Hugging Face convention: the model or the loss"
        " shifts them; rows: 6 identical)"
    )
    shifted = check_label_shift(
        {"shifted by 1": 5, "identical": 1}, causal_lm="GPT2LMHeadModel at 'model'"
    )
    assert shifted.verdict == "warn"
    assert shifted.detail == (
        f"{SHIFTED_LABELS_ADVICE} (labels[t] == input_ids[t+1] in rows: 1 identical, 5 shifted"
        " by 1; the module holds GPT2LMHeadModel at 'model', which shifts labels)"
    )
    assert check_label_shift({"shifted by -1": 2}).verdict == "warn"
    assert check_label_shift({"other": 3, "identical": 1}).verdict == "not_checked"
    assert check_label_shift({}).verdict == "not_checked"


def test_check_causal_lm_labels_verdicts() -> None:
    lm = "GPT2LMHeadModel at 'model'"
    assert check_causal_lm_labels(lm, {"identical": 8}, 1).verdict == "pass"
    failed = check_causal_lm_labels(lm, {"shifted by 1": 8}, 2)
    assert failed.verdict == "fail"
    assert "trains to predict 2 tokens ahead" in failed.detail
    assert "2 forward call(s) seen" in failed.detail
    assert check_causal_lm_labels(lm, {"shifted by -1": 8}, 1).verdict == "warn"
    unlabelled = check_causal_lm_labels(lm, {}, 3)
    assert unlabelled.verdict == "not_checked"
    assert "the loss is computed outside it" in unlabelled.detail
    assert check_causal_lm_labels(lm, {}, 0).detail == f"{lm} was not called before the verdict"


def test_find_causal_lm_matches_hugging_face_causal_lms_only() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=8)

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = transformers.GPT2Model(config)  # no LM head: not a causal LM
            self.model = transformers.GPT2LMHeadModel(config)

    found = find_causal_lm(Wrapper())
    assert found is not None
    assert (found[0], type(found[1]).__name__) == ("model", "GPT2LMHeadModel")

    class GPT2LMHeadModel(nn.Module):  # the name alone is not enough
        pass

    assert find_causal_lm(nn.Sequential(GPT2LMHeadModel())) is None
    assert find_causal_lm(TinyCausalLM(d_model=8, n_heads=2, n_layers=1)) is None


def test_split_inspection_and_example_rows_name_the_relation() -> None:
    shifted = torch.tensor([[6, 7, 8, -100, -100], [8, 7, 6, 5, -100]])
    batch = {"input_ids": IDS, "attention_mask": (IDS != 0).long(), "labels": shifted}
    view = BatchAdapter().view(batch)
    inspection = SplitInspection("train", ignore_index=-100, output_size=10)
    inspection.add(view)
    checks = {c.name: c for c in inspection.checks()}
    assert checks["train/label_shift"].verdict == "warn"
    rows = example_rows(view, split="train", batch_index=0, limit=2, ignore_index=-100)
    assert [r["label_relation"] for r in rows] == ["shifted by 1", "shifted by 1"]
    classes = example_rows(
        BatchAdapter().view((torch.ones(2, 3), torch.tensor([1, 0]))),
        split="train",
        batch_index=0,
        limit=2,
        ignore_index=-100,
    )
    assert [r.get("label_relation") for r in classes] == [None, None]


def test_example_rows_keep_going_when_decode_raises() -> None:
    def broken(tokens: Any) -> str:
        raise ValueError("vocabulary not loaded")

    view = BatchAdapter().view({"input_ids": IDS, "labels": IDS})
    errors: list[str] = []
    rows = example_rows(
        view, split="val", batch_index=0, limit=2, ignore_index=-100, decode=broken, errors=errors
    )
    assert [r["input_text"] for r in rows] == [None, None]
    assert [r["target"] for r in rows] == [None, None]
    assert rows[0]["notes"] == "no id in the batch; decode raised ValueError: vocabulary not loaded"
    assert errors == ["decode raised ValueError: vocabulary not loaded"] * 4
    assert rows[0]["input_tokens"] == [5, 6, 7, 8, 0]


# ---------------------------------------------------------------------------------------------
# The data phase without a Trainer: dataset scans, the batches of a fit, a causal LM's labels
# ---------------------------------------------------------------------------------------------


def _items(n: int, offset: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    return [(torch.tensor([i + offset]), torch.tensor(i % 3), (i + offset) // 2) for i in range(n)]


def test_dataset_scan_compares_the_splits() -> None:
    scan = DatasetScan(BatchAdapter(), max_examples=100, group_fn=lambda item: item[2])
    ran = scan.run({"train": [_items(6)], "val": [_items(2, offset=5)]})
    assert [c.name for c in ran] == [  # the order the phase table lists them in
        "class_histograms",
        "val_classes_in_train",
        "label_ranges_agree",
        "split_leakage",
        "duplicate_inputs_across_splits",
    ]
    results = _named(ran)
    assert results["split_leakage"].verdict == "fail"
    assert "1 group(s) found in more than one split: 2 (train+val)" in (
        results["split_leakage"].detail
    )
    assert results["duplicate_inputs_across_splits"].detail.startswith("1 exact duplicate")
    assert results["class_histograms"].detail == "train: 0:2, 1:2, 2:2; val: 0:1, 1:1"
    assert scan.raised == []


def test_dataset_scan_is_bounded_and_restores_the_random_state() -> None:
    class Noisy(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 50

        def __getitem__(self, index: int) -> Any:
            return torch.rand(1), torch.tensor(0)

    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    scan = DatasetScan(BatchAdapter(), max_examples=4)
    results = _named(scan.run({"train": [Noisy()], "val": [Noisy()]}))
    assert torch.rand(1) == expected  # the scan's draws did not move the generator
    assert "(examples scanned: train 4, val 4)" in results["duplicate_inputs_across_splits"].detail
    assert results["split_leakage"].verdict == "not_checked"  # no group_fn


def test_dataset_scan_reports_user_code_that_raises() -> None:
    class Broken(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> Any:
            raise OSError("shard missing")

    def group(item: Any) -> Any:
        return item["conversation"]

    problem = CheckResult("test/split_leakage", "not_checked", "built in setup('test')")
    scan = DatasetScan(BatchAdapter(), max_examples=10, group_fn=group)
    results = scan.run({"train": [_items(4)], "val": [Broken()]}, [problem])
    names = [r.name for r in results]
    assert names[-2:] == ["test/split_leakage", "val/split_leakage"]
    assert results[-1].detail.startswith("reading the val dataset raised OSError: shard missing")
    leak = _named(results)["split_leakage"]
    assert leak.detail.startswith("group_fn raised TypeError")
    assert [r.name for r in scan.raised] == ["val/split_leakage", "split_leakage"]


def test_data_inspection_reads_batches_until_done_and_keeps_errors() -> None:
    adapter = BatchAdapter()
    inspection = DataInspection(
        {
            "train": SplitInspection("train", ignore_index=-100, output_size=3),
            "val": SplitInspection("val", ignore_index=-100, output_size=3),
        },
        batches=2,
        examples=3,
    )
    batch = {"ids": torch.tensor([0, 1]), "x": torch.zeros(2, 2), "y": torch.tensor([0, 2])}
    inspection.add("val", batch, adapter)
    inspection.add("train", batch, adapter)
    assert not inspection.done("train")
    inspection.add("train", batch, adapter)
    assert inspection.done("train")
    assert inspection.done("test")  # a split not inspected has nothing to read
    inspection.add("val", "not a batch", BatchAdapter(ids=lambda b: b["uid"]))
    assert inspection.done("val")
    rows = inspection.table_rows()
    assert [(r["split"], r["batch_index"], r["position"]) for r in rows] == [
        ("train", 0, 0),
        ("train", 0, 1),
        ("train", 1, 0),
        ("val", 0, 0),
        ("val", 0, 1),
    ]
    results = _named(inspection.results(None, dataset_checks=None, failed=ValueError("x")))
    assert results["val/batch_read"].detail.startswith("reading a val batch raised TypeError")
    assert results["datasets_scanned"].detail == (
        "the fit ended (ValueError) before training started"
    )
    assert [r.name for r in inspection.raised] == ["val/batch_read"]


def test_data_inspection_names_decode_errors_once() -> None:
    def broken(tokens: Any) -> str:
        raise ValueError("no vocabulary")

    inspection = DataInspection(
        {"train": SplitInspection("train", ignore_index=-100)}, batches=1, examples=2, decode=broken
    )
    inspection.add("train", {"input_ids": IDS, "labels": IDS}, BatchAdapter())
    decode_check = _named(inspection.results(None, dataset_checks=[]))["decode"]
    assert decode_check.detail.startswith("decode raised ValueError: no vocabulary (4 call(s))")
    assert inspection.raised == [decode_check]


def test_causal_lm_watch_reads_labels_and_stops() -> None:
    watch = CausalLMWatch("GPT2LMHeadModel at 'model'", -100, max_calls=2)
    shifted = torch.tensor([[6, 7, 8, -100, -100], [8, 7, 6, 5, -100]])
    watch(nn.Identity(), (IDS,), {"labels": shifted})
    watch(nn.Identity(), (), {"input_ids": IDS})  # no labels: counted, nothing to compare
    watch(nn.Identity(), (), {"input_ids": IDS, "labels": IDS})  # past max_calls: ignored
    assert (watch.calls, dict(watch.relations)) == (2, {"shifted by 1": 2})
    assert watch.check().verdict == "fail"
    watch = CausalLMWatch("GPT2LMHeadModel", -100, max_calls=2)
    watch(nn.Identity(), (), {"input_ids": IDS, "labels": "not a tensor"})
    assert watch.check().verdict == "not_checked"
    watch = CausalLMWatch("LM", -100, max_calls=2)
    watch(nn.Identity(), (), {"input_ids": IDS[:, :2], "labels": object()})
    broken = CausalLMWatch("LM", -100, max_calls=2)
    broken.relations = None  # type: ignore[assignment]
    broken(nn.Identity(), (), {"input_ids": IDS, "labels": IDS})
    assert broken.check().detail.startswith("reading the labels given to LM raised AttributeError")


def test_first_items_by_index_or_iteration() -> None:
    assert list(first_items([1, 2, 3], 2)) == [1, 2]
    assert list(first_items(iter(range(10)), 3)) == [0, 1, 2]


def test_a_module_without_an_encoder_decoder_or_causal_lm_gets_no_watch() -> None:
    plain = nn.Sequential(nn.Linear(2, 2))
    assert find_encoder_decoder(plain) is None
    assert CausalLMWatch.attach(plain, ignore_index=-100, max_calls=8) is None
