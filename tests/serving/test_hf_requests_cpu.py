"""The Hugging Face generator's request checks on the CPU: HF's position rule, left
padding, masks, lengths against the cache, token ids; every bad request a typed error
that names it, nothing run."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")


from cudagraphs.errors import (  # noqa: E402
    CudaGraphInputError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    Mismatch,
)
from cudagraphs.serving.hf import (  # noqa: E402
    check_request,
    positions_from_mask,
)
from cudagraphs.serving.hf.requests import inferred_mask  # noqa: E402
from helpers.hf_generate import (  # noqa: E402
    prompts,
)

CPU = torch.device("cpu")


# ---- requests.py -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "mask, expected",
    [
        ([[1, 1, 1]], [[0, 1, 2]]),
        ([[0, 0, 1, 1]], [[0, 0, 0, 1]]),
        ([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], [[0, 0, 1, 2], [0, 1, 2, 3], [0, 0, 0, 0]]),
        ([0, 1, 1], [0, 0, 1]),  # one row, unbatched: the count runs along the last dim
    ],
)
def test_positions_from_mask_follow_hf_rule(mask, expected):
    mask = torch.tensor(mask)
    hf_rule = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    assert torch.equal(positions_from_mask(mask), torch.tensor(expected))
    assert torch.equal(positions_from_mask(mask), hf_rule)
    assert torch.equal(positions_from_mask(mask.bool()), hf_rule)


def test_valid_request_without_mask_gets_an_all_true_bool_mask():
    ids = torch.arange(3, 15, dtype=torch.int32).reshape(2, 6)
    request = check_request(ids, None, 4, 16, CPU)
    assert request.attention_mask.dtype == torch.bool
    assert request.attention_mask.shape == (2, 6)
    assert bool(request.attention_mask.all())
    assert request.input_ids.dtype == torch.long
    assert torch.equal(request.input_ids, ids.long())
    assert (request.batch, request.prompt_len, request.max_new_tokens) == (2, 6, 4)


def test_without_a_mask_the_padding_is_read_from_the_pad_id_as_generate_does():
    ids = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9], [3, 4, 5, 6]])
    mask = inferred_mask(ids, 0, [2])
    assert torch.equal(mask, (ids != 0).long())
    assert inferred_mask(ids, 0, [0, 2]) is None  # the pad id is an end id: no padding
    assert inferred_mask(ids, None, [2]) is None
    assert inferred_mask(ids, 1, [2]) is None  # not in the ids
    with pytest.raises(
        CudaGraphInputError, match=r"pad_token_id 0 after real tokens in rows \[0\]"
    ):
        inferred_mask(torch.tensor([[5, 0, 6], [5, 6, 7]]), 0, [2])


@pytest.mark.parametrize("with_mask", [True, False])
def test_request_is_moved_to_the_device_given(with_mask):
    # the meta device stands in for a GPU: ids and mask both go to the device given
    ids, mask = prompts(3)
    meta = torch.device("meta")
    request = check_request(ids, mask if with_mask else None, 2, 16, meta)
    assert request.input_ids.device == meta and request.input_ids.dtype == torch.long
    assert request.attention_mask.device == meta and request.attention_mask.dtype == torch.bool


def test_a_missing_mask_is_made_on_the_device_given_not_the_default_device():
    ids = torch.ones(2, 3, dtype=torch.long)
    with torch.device("meta"):  # torch's default device for new tensors
        request = check_request(ids, None, 2, 16, CPU)
    assert request.attention_mask.device == CPU
    assert bool(request.attention_mask.all())


def test_valid_mask_becomes_bool_with_the_same_pattern():
    ids, mask = prompts(3)
    request = check_request(ids, mask, 2, 16, CPU)
    assert request.attention_mask.dtype == torch.bool
    assert torch.equal(request.attention_mask, mask.bool())


def test_positions_needed_is_prompt_plus_new_minus_one():
    request = check_request(torch.ones(2, 5, dtype=torch.long), None, 7, 64, CPU)
    assert request.positions_needed == 5 + 7 - 1


def test_request_filling_the_cache_exactly_is_accepted():
    request = check_request(torch.ones(1, 5, dtype=torch.long), None, 4, 8, CPU)
    assert request.positions_needed == 8


def test_request_longer_than_the_cache_names_positions_and_max_cache_len():
    with pytest.raises(CudaGraphsValueError, match="needs 9 cache positions") as err:
        check_request(torch.ones(1, 5, dtype=torch.long), None, 5, 8, CPU)
    assert "max_cache_len=8" in str(err.value)
    assert "max_cache_len >= 9" in str(err.value)


@pytest.mark.parametrize(
    "ids, kind", [([[1, 2, 3]], "list"), ((1, 2), "tuple"), (None, "NoneType")]
)
def test_non_tensor_ids_are_a_type_error(ids, kind):
    with pytest.raises(CudaGraphsTypeError, match="input_ids must be a torch.Tensor") as err:
        check_request(ids, None, 2, 16, CPU)
    assert f"got {kind};" in str(err.value)
    assert "return_tensors='pt'" in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_non_integer_ids_are_a_type_error(dtype):
    with pytest.raises(CudaGraphsTypeError, match="integer token ids"):
        check_request(torch.ones(1, 3, dtype=dtype), None, 2, 16, CPU)


def test_one_dimensional_ids_suggest_unsqueeze():
    with pytest.raises(CudaGraphsValueError, match=r"unsqueeze\(0\)") as err:
        check_request(torch.ones(4, dtype=torch.long), None, 2, 16, CPU)
    assert "got shape (4,) (one prompt: input_ids.unsqueeze(0))" in str(err.value)


def test_three_dimensional_ids_are_refused_without_the_unsqueeze_hint():
    with pytest.raises(CudaGraphsValueError, match="must be 2-D") as err:
        check_request(torch.ones(1, 2, 3, dtype=torch.long), None, 2, 16, CPU)
    assert "unsqueeze" not in str(err.value)
    assert str(err.value).endswith("got shape (1, 2, 3)")  # the shape received, no hint


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
def test_empty_ids_are_refused(shape):
    with pytest.raises(CudaGraphsValueError, match="empty"):
        check_request(torch.ones(shape, dtype=torch.long), None, 2, 16, CPU)


def test_mask_of_another_shape_is_an_input_error_with_one_mismatch():
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(CudaGraphInputError, match="attention_mask") as err:
        check_request(ids, torch.ones(2, 4, dtype=torch.long), 2, 16, CPU)
    assert err.value.mismatches == [Mismatch("attention_mask", "shape", (2, 3), (2, 4))]
    assert "attention_mask: shape expected (2, 3), received (2, 4)" in str(err.value)
    assert "attention_mask does not match input_ids" in str(err.value)
    assert "Pass the mask the tokenizer returned with these ids" in str(err.value)


def test_mask_that_is_not_a_tensor_is_a_type_error():
    with pytest.raises(CudaGraphsTypeError, match="attention_mask must be a torch.Tensor") as err:
        check_request(torch.ones(1, 3, dtype=torch.long), [[1, 1, 1]], 2, 16, CPU)
    assert str(err.value).endswith("got list")


def test_mask_values_other_than_zero_and_one_are_refused():
    mask = torch.tensor([[1, 2, 1]])
    with pytest.raises(CudaGraphInputError, match="values other than 0 and 1"):
        check_request(torch.ones(1, 3, dtype=torch.long), mask, 2, 16, CPU)


def test_a_row_without_real_tokens_is_named():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    with pytest.raises(CudaGraphInputError, match=r"rows \[1\] have no real token"):
        check_request(torch.ones(2, 3, dtype=torch.long), mask, 2, 16, CPU)


@pytest.mark.parametrize("bad_row", [[1, 1, 0], [1, 0, 1], [0, 1, 0]])
def test_right_padding_or_holes_name_the_row_and_padding_side(bad_row):
    mask = torch.tensor([[0, 1, 1], bad_row])
    with pytest.raises(CudaGraphInputError, match=r"rows \[1\] have padding after") as err:
        check_request(torch.ones(2, 3, dtype=torch.long), mask, 2, 16, CPU)
    assert "padding_side = 'left'" in str(err.value)
    assert str(err.value).endswith(
        "the static cache needs left padding: tokenizer.padding_side = 'left'"
    )


def test_every_mask_problem_is_said_at_once():
    mask = torch.tensor([[0, 0, 0], [1, 1, 0], [0, 1, 1]])
    with pytest.raises(CudaGraphInputError) as err:
        check_request(torch.ones(3, 3, dtype=torch.long), mask, 2, 16, CPU)
    assert "rows [0] have no real token" in str(err.value)
    assert "rows [1] have padding after" in str(err.value)
    # all three kinds, one clause each after the headline, in the order they are checked
    mask = torch.tensor([[0, 0, 0], [1, 2, 0], [0, 1, 1]])
    with pytest.raises(CudaGraphInputError) as err:
        check_request(torch.ones(3, 3, dtype=torch.long), mask, 2, 16, CPU)
    assert (
        "0/1 mask: it holds values other than 0 and 1; rows [0] have no real token; "
        "rows [1] have padding after"
    ) in str(err.value)


def test_zero_new_tokens_is_a_value_error():
    with pytest.raises(CudaGraphsValueError, match="max_new_tokens must be an int >= 1"):
        check_request(torch.ones(1, 3, dtype=torch.long), None, 0, 16, CPU)


@pytest.mark.parametrize("new", [2.0, "2", True, None])
def test_non_int_new_tokens_is_a_type_error(new):
    with pytest.raises(CudaGraphsTypeError, match="max_new_tokens must be an int"):
        check_request(torch.ones(1, 3, dtype=torch.long), None, new, 16, CPU)


def test_the_request_mask_is_boolean_with_or_without_a_mask_given():
    from cudagraphs.serving.hf.requests import check_request

    ids = torch.tensor([[5, 6, 7]])
    cpu = torch.device("cpu")
    assert check_request(ids, None, 2, 8, cpu).attention_mask.dtype == torch.bool
    given = check_request(ids, torch.tensor([[0, 1, 1]]), 2, 8, cpu).attention_mask
    assert given.dtype == torch.bool and given.tolist() == [[False, True, True]]


def test_ids_up_to_the_last_of_the_vocabulary_pass_and_the_size_itself_is_refused():
    from cudagraphs.errors import CudaGraphsValueError
    from cudagraphs.serving.hf.requests import check_request

    cpu = torch.device("cpu")
    check_request(torch.tensor([[0, 9]]), None, 1, 8, cpu, vocab_size=10)
    with pytest.raises(
        CudaGraphsValueError, match=r"input_ids\[0, 1\] = 10 is outside .*\[0, 10\)"
    ):
        check_request(torch.tensor([[0, 10]]), None, 1, 8, cpu, vocab_size=10)
    with pytest.raises(CudaGraphsValueError, match=r"input_ids\[0, 0\] = -1 is outside"):
        check_request(torch.tensor([[-1, 3]]), None, 1, 8, cpu, vocab_size=10)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1, max_size=4),
    pad=st.one_of(st.none(), st.integers(0, 4)),
    eos=st.lists(st.integers(0, 4), max_size=2),
)
def test_the_inferred_mask_is_generates_rule_and_left_padding_or_refused(rows, pad, eos):
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [5] * (width - len(r)) for r in rows])  # 5: never the pad
    # generate's rule: ids != pad where the pad is set, in the ids and no eos id.
    infers = pad is not None and pad not in eos and bool((ids == pad).any())
    if not infers:
        assert inferred_mask(ids, pad, eos) is None
        return
    want = (ids != pad).long()
    left_padded = all(
        all(want[r, :i].sum() == 0 for i in range(width) if want[r, i] == 0)
        for r in range(len(rows))
    )
    if left_padded:
        assert torch.equal(inferred_mask(ids, pad, eos), want)
    else:
        with pytest.raises(CudaGraphInputError, match="after real tokens"):
            inferred_mask(ids, pad, eos)


@pytest.mark.parametrize("which", ["input_ids", "attention_mask"])
def test_a_meta_tensor_is_refused_by_name_as_holding_no_values(which):
    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    given = {"input_ids": ids, "attention_mask": mask}
    given[which] = given[which].to("meta")
    with pytest.raises(CudaGraphsValueError, match=f"{which} is on the meta device"):
        check_request(given["input_ids"], given["attention_mask"], 2, 16, CPU)
    # The next good request goes through.
    assert check_request(ids, mask, 2, 16, CPU).input_ids.shape == (2, 3)
