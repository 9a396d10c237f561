"""export/dequantize.py's bookkeeping on hand-made inputs: a weight quantized in row ranges joined back, and the
constants read through a Reshape."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from export.dequantize import QuantizedWeight, _join_row_ranges, constant_reader


def table_part(rows: int, value: float, bits: int = 4):
    return lambda: QuantizedWeight("GatherBlockQuantized", bits, np.full((rows, 16), value, np.float32), 16)


def test_row_ranges_are_joined_in_row_order_and_must_tile_the_rows():
    """The parts of ``<name>.rows_<a>_<b>`` come back as one weight in row order, each part's grid at its own rows;
    parts that leave a gap or overlap are an exporter bug, not a table of the parts' combined height (a mutation
    dropping the tiling check passed every test)."""
    joined = _join_row_ranges({"w.rows_2_5": table_part(3, 1.0), "w.rows_0_2": table_part(2, 0.0, bits=8)})
    weight = joined["w"]()
    assert weight.weight[:, 0].tolist() == [0, 0, 1, 1, 1]
    assert weight.row_parts == ((0, 2, 8, 16), (2, 5, 4, 16)) and weight.bits == 4
    for parts, start in (
        ({"w.rows_0_2": table_part(2, 0), "w.rows_3_5": table_part(2, 1)}, 3),
        ({"w.rows_0_3": table_part(3, 0), "w.rows_2_5": table_part(3, 1)}, 2),
        ({"w.rows_1_3": table_part(2, 0)}, 1),
    ):
        with pytest.raises(RuntimeError, match=f"do not tile its rows at {start}"):
            _join_row_ranges(parts)["w"]()


@pytest.mark.parametrize(
    "allowzero, data, target, shape",
    [
        (None, np.arange(24.0).reshape(2, 3, 4), [0, -1], (2, 12)),
        (0, np.arange(24.0).reshape(2, 3, 4), [0, -1], (2, 12)),
        (1, np.zeros((0, 3)), [3, 0], (3, 0)),
    ],
)
def test_a_reshape_of_constants_reads_a_zero_as_onnx_does(allowzero, data, target, shape):
    """A 0 in a constant Reshape's shape copies the input's dimension unless ``allowzero`` is 1 (ONNX's Reshape): a
    mutation reading every 0 literally passed every test, the exporter's own Reshapes naming no 0."""
    attrs = {} if allowzero is None else {"allowzero": allowzero}
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["data", "shape"], ["table"], **attrs)],
        "reshaped",
        [],
        [],
        initializer=[numpy_helper.from_array(data, "data"), numpy_helper.from_array(np.array(target), "shape")],
    )
    read = constant_reader(graph)
    assert read("table").shape == shape and read("nothing") is None
    np.testing.assert_array_equal(read("table").reshape(-1), data.reshape(-1))
