"""The Uploader (tandem/upload.py): host lists -> device int64 views of one copy."""
from __future__ import annotations

import torch

from tandem.upload import Uploader


def test_views_hold_the_lists_and_start_on_16_byte_boundaries():
    up = Uploader(torch.device("cpu"))
    lists = [[1, 2, 3], [], [4], [5, 6], [-7, 8, 9, 10, 11]]
    views = up(*lists)
    assert [v.tolist() for v in views] == lists
    for v in views:
        assert v.dtype == torch.int64 and v.is_contiguous()
        assert v.data_ptr() % 16 == 0  # Triton compiles one variant per pointer alignment


def test_a_view_reshapes_as_its_list():
    up = Uploader(torch.device("cpu"))
    (odd, table) = up([1, 2, 3], list(range(6)))
    assert table.view(2, 3).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert odd.tolist() == [1, 2, 3]
