"""BatchAdapter: the defaults for common layouts, overrides, and 'not found' as None."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_pilot.core.batches import BatchAdapter


def _lm_batch() -> dict[str, torch.Tensor]:
    return {
        "ids": torch.tensor([3, 4, 5]),
        "input_ids": torch.tensor([[1, 2, 3, 4], [1, 2, 0, 0], [1, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]),
        "labels": torch.tensor([[-100, -100, 3, 4], [-100, 2, -100, -100], [-100] * 4]),
    }


def test_dict_lm_batch() -> None:
    view = BatchAdapter().view(_lm_batch())
    assert view.ids_list() == [3, 4, 5]
    assert (view.batch_size, view.seq_len, view.tokens, view.loss_tokens) == (3, 4, 7, 3)
    assert view.missing == ()


@pytest.mark.parametrize(
    ("batch", "size", "ids", "missing"),
    [
        ((torch.zeros(5, 2), torch.zeros(5)), 5, None, ("ids", "attention_mask")),
        ([torch.zeros(2, 2), torch.zeros(2), torch.tensor([8, 9])], 2, [8, 9], ("attention_mask",)),
        (torch.zeros(6, 3), 6, None, ("ids", "targets", "attention_mask")),
        (
            {"x": torch.zeros(4, 3), "y": torch.zeros(4), "idx": [1, 2, 3, 4]},
            4,
            [1, 2, 3, 4],
            ("attention_mask",),
        ),
    ],
    ids=["tuple_xy", "list_xy_ids", "bare_tensor", "dict_xy_idx"],
)
def test_default_layouts(batch: Any, size: int, ids: Any, missing: tuple[str, ...]) -> None:
    view = BatchAdapter().view(batch)
    assert view.batch_size == size
    assert view.ids_list() == ids
    assert view.missing == missing
    # Float features have no sequence length or token count: None, never 0.
    assert view.seq_len is None
    assert view.tokens is None


def test_token_inputs_without_mask_count_every_position() -> None:
    view = BatchAdapter().view({"input_ids": torch.ones(2, 7, dtype=torch.long)})
    assert (view.seq_len, view.tokens, view.loss_tokens) == (7, 14, None)


def test_overrides_by_key_index_and_callable() -> None:
    adapter = BatchAdapter(ids="uid", inputs=0, targets=lambda b: b[1] * 2, ignore_index=-1)
    view = BatchAdapter(ids="uid").view({"uid": ["a", "b"]})
    assert view.ids_list() == ["a", "b"]
    tuple_view = adapter.view((torch.tensor([[1, 2]]), torch.tensor([[0, -1]])))
    assert tuple_view.loss_tokens == 2  # doubled targets: 0 and -2, neither is -1
    assert tuple_view.ids is None  # a tuple has no key "uid"


def shifted_labels(batch: dict[str, Any]) -> torch.Tensor:
    """A field by import path: the labels one position left, -100 at the end."""
    labels: torch.Tensor = batch["input_ids"].roll(-1, dims=1)
    labels[:, -1] = -100
    return labels


def test_a_string_with_a_colon_is_a_function_by_import_path() -> None:
    adapter = BatchAdapter(ids="uid", targets=f"{__name__}:shifted_labels")
    assert adapter._specs == {
        "ids": "uid",
        "inputs": None,
        "targets": shifted_labels,
        "attention_mask": None,
        "decoder_inputs": None,
    }
    # The imported function is called on the whole batch, like any callable field.
    batch = {"uid": ["a", "b"], "input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]])}
    view = adapter.view(batch)
    assert view.ids_list() == ["a", "b"]
    assert view.targets.tolist() == [[6, 7, -100], [9, 10, -100]]
    assert view.loss_tokens == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ids": 1.5}, TypeError, r"BatchAdapter\(ids=1.5\) is invalid"),
        ({"inputs": True}, TypeError, r"BatchAdapter\(inputs=True\) is invalid: expected a dict"),
        ({"targets": ""}, ValueError, r"BatchAdapter\(targets=''\) is invalid"),
        ({"ignore_index": "x"}, TypeError, r"BatchAdapter\(ignore_index='x'\) is invalid"),
        ({"ignore_index": 1.0}, TypeError, r"ignore_index=1.0\) is invalid: expected an integer"),
        ({"ignore_index": 2**63}, ValueError, r"ignore_index=9223372036854775808\) .* 64 bits"),
        # A string with a colon names a callable by import path: one that does not import, or
        # names something that is not callable, is refused here, never read as a dict key.
        (
            {"targets": "no_such_module_xyz:labels"},
            ValueError,
            r"BatchAdapter\(targets='no_such_module_xyz:labels'\) is invalid: expected"
            r" 'package.module:function'.*does not import \(ModuleNotFoundError",
        ),
        (
            {"ids": "lightning_pilot.core.batches:no_such_function"},
            ValueError,
            r"ids='lightning_pilot.core.batches:no_such_function'\).*\(AttributeError",
        ),
        (
            {"inputs": "lightning_pilot.core.batches:_FIELDS"},
            TypeError,
            r"inputs='lightning_pilot.core.batches:_FIELDS'\).*names a tuple, which is not"
            r" callable",
        ),
        ({"inputs": "text:en"}, ValueError, r"a dict key is a string without ':'"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        BatchAdapter(**kwargs)


# ---------------------------------------------------------------------------------------------
# The model zoo's batches: speech, vision, diffusion, contrastive and detection layouts
# ---------------------------------------------------------------------------------------------


def _zoo_batches() -> dict[str, tuple[dict[str, Any], str]]:
    """One batch of 2 examples per family, as its Hugging Face processor or training script
    builds it, with the key that holds the inputs."""
    tokens = torch.tensor([[5, 6, 7, 2], [5, 8, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    detection = [
        {"class_labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]])},
        {"class_labels": torch.tensor([0, 2]), "boxes": torch.rand(2, 4)},
    ]
    return {
        "whisper": (
            {
                "input_features": torch.randn(2, 8, 16),
                "decoder_input_ids": tokens,
                "labels": tokens,
            },
            "input_features",
        ),
        "wav2vec2_ctc": (
            {
                "input_values": torch.randn(2, 400),
                "attention_mask": torch.ones(2, 400, dtype=torch.long),
                "labels": torch.tensor([[3, 4, 5], [6, -100, -100]]),
            },
            "input_values",
        ),
        "diffusion_images": ({"images": torch.randn(2, 3, 8, 8)}, "images"),
        "diffusion_latents": ({"latents": torch.randn(2, 4, 8, 8)}, "latents"),
        "clip": (
            {"input_ids": tokens, "attention_mask": mask, "pixel_values": torch.randn(2, 3, 8, 8)},
            "input_ids",
        ),
        "detr": (
            {
                "pixel_values": torch.randn(2, 3, 8, 8),
                "pixel_mask": torch.ones(2, 8, 8, dtype=torch.long),
                "labels": detection,
            },
            "pixel_values",
        ),
    }


@pytest.mark.parametrize("family", list(_zoo_batches()))
def test_speech_vision_and_diffusion_inputs_are_read(family: str) -> None:
    from lightning_pilot.core.resume import content_keys

    batch, key = _zoo_batches()[family]
    view = BatchAdapter().view(batch)
    assert view.inputs is batch[key]
    assert "inputs" not in view.missing
    assert view.batch_size == 2
    # What the resume check's data position tells the examples apart by, without an id field.
    keys = content_keys(view.inputs)
    assert keys is not None
    assert len(set(keys)) == 2


def test_detection_targets_stay_a_list_of_dicts() -> None:
    batch, _ = _zoo_batches()["detr"]
    view = BatchAdapter().view(batch)
    assert view.targets is batch["labels"]
    assert (view.batch_size, view.seq_len, view.tokens, view.loss_tokens) == (2, None, None, None)


def test_decoder_inputs_by_default_key_or_spec() -> None:
    batch, _ = _zoo_batches()["whisper"]
    assert BatchAdapter().view(batch).decoder_inputs is batch["decoder_input_ids"]
    renamed = {"src": torch.ones(2, 3), "tgt_in": torch.ones(2, 3, dtype=torch.long)}
    assert BatchAdapter().view(renamed).decoder_inputs is None
    assert BatchAdapter(decoder_inputs="tgt_in").view(renamed).decoder_inputs is renamed["tgt_in"]
    assert BatchAdapter().view((torch.ones(2, 3), torch.ones(2))).decoder_inputs is None


def test_example_inputs_are_every_input_key_or_the_adapters_choice() -> None:
    batch, _ = _zoo_batches()["clip"]
    both = BatchAdapter().example_inputs(batch)
    assert set(both) == {"input_ids", "pixel_values"}
    assert both["pixel_values"] is batch["pixel_values"]
    assert BatchAdapter(inputs="pixel_values").example_inputs(batch) is batch["pixel_values"]
    single, _ = _zoo_batches()["whisper"]
    assert BatchAdapter().example_inputs(single) is single["input_features"]
    pair = (torch.ones(2, 3), torch.zeros(2))
    assert BatchAdapter().example_inputs(pair) is pair[0]
