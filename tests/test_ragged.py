"""astrl.ragged: per-sample rows of different lengths and their padded forms."""

import pytest
import torch

from astrl.ragged import as_rows, nested, pad_ids, pad_rows, sample_rows, unpad

ROWS = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]


def test_pad_rows_right_left_wider_and_typed():
    assert pad_rows(ROWS).tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    assert pad_rows(ROWS, side="left", value=-1).tolist() == [[1, 2, 3], [-1, -1, 4], [-1, 5, 6]]
    assert pad_rows(ROWS, width=5, value=9).tolist() == [[1, 2, 3, 9, 9], [4, 9, 9, 9, 9], [5, 6, 9, 9, 9]]
    assert pad_rows(ROWS, side="left", width=4).tolist() == [[0, 1, 2, 3], [0, 0, 0, 4], [0, 0, 5, 6]]
    assert pad_rows(ROWS, dtype=torch.float32).dtype == torch.float32
    assert pad_rows([r > 2 for r in ROWS], dtype=torch.bool).tolist() == [
        [False, False, True],
        [True, False, False],
        [True, True, False],
    ]
    with pytest.raises(ValueError, match="side"):
        pad_rows(ROWS, side="middle")


def test_pad_rows_passes_gradients_to_the_rows():
    rows = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    (pad_rows(rows, side="left", width=4) * torch.arange(4.0)).sum().backward()
    assert rows[0].grad.tolist() == [2.0, 3.0] and rows[1].grad.tolist() == [1.0, 2.0, 3.0]


def test_pad_ids_mark_the_real_tokens_and_unpad_gives_the_rows_back():
    ids, mask = pad_ids(ROWS, pad_token_id=7)
    assert ids.tolist() == [[1, 2, 3], [4, 7, 7], [5, 6, 7]] and mask.dtype == torch.long
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    ids, mask = pad_ids(ROWS, pad_token_id=7, side="left")
    assert ids.tolist() == [[1, 2, 3], [7, 7, 4], [7, 5, 6]] and mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    back = unpad(pad_rows(ROWS), [len(r) for r in ROWS])
    assert all(torch.equal(a, b) for a, b in zip(back, ROWS, strict=True))


def test_as_rows_reads_every_form_of_ragged_data():
    for form in (ROWS, nested(ROWS)):
        assert [r.tolist() for r in as_rows(form)] == [[1, 2, 3], [4], [5, 6]]
    assert [r.tolist() for r in as_rows(torch.arange(6).reshape(1, 2, 3))] == [[0, 1, 2], [3, 4, 5]]
    assert [r.tolist() for r in as_rows(torch.arange(3))] == [[0, 1, 2]]


def test_sample_rows_give_one_row_per_sample_or_name_the_key():
    assert [r.tolist() for r in sample_rows(torch.arange(6).reshape(2, 3, 1), "reward", 2)] == [[0, 1, 2], [3, 4, 5]]
    assert [r.tolist() for r in sample_rows(torch.tensor([1.0, 2.0]), "score", 2)] == [[1.0], [2.0]]
    assert [r.tolist() for r in sample_rows([torch.tensor(3.0), torch.ones(2, 1)], "x", 2)] == [[3.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match="'mask' has 3 rows for a batch of 2"):
        sample_rows(nested(ROWS), "mask", 2)
    with pytest.raises(ValueError, match="'x': expected a \\(batch, tokens\\) tensor"):
        sample_rows(torch.zeros(2, 3, 4), "x", 2)
    with pytest.raises(ValueError, match="'x': sample 0 has shape \\(2, 2\\)"):
        sample_rows([torch.zeros(2, 2)], "x", 1)
