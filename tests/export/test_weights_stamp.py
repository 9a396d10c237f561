"""The stamp that pairs a graph with its weights file (export/weights_stamp.py): what the fingerprint sees, and that
stamping again replaces the stamp."""

from __future__ import annotations

import onnx
import pytest

from export.names import WEIGHTS_FINGERPRINT_KEY, WEIGHTS_SIZE_KEY
from export.weights_stamp import PAGE, SAMPLE_PAGES, check_weights_stamp, stamp_weights, weights_fingerprint
from thinker_common.errors import ThinkerError


def stamped_model(data_path):
    model = onnx.ModelProto()
    stamp_weights(model, data_path)
    return model


@pytest.mark.parametrize("size", [PAGE * 3 + 5, PAGE * SAMPLE_PAGES * 4 + 123])
@pytest.mark.parametrize("where", ["first byte", "last byte"])
def test_the_fingerprint_sees_the_first_and_last_pages(tmp_path, size, where):
    data = tmp_path / "model.onnx.data"
    data.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    model = stamped_model(data)
    check_weights_stamp(model, tmp_path / "model.onnx", data)  # its own weights pass

    changed = bytearray(data.read_bytes())
    changed[0 if where == "first byte" else -1] ^= 1
    data.write_bytes(changed)
    with pytest.raises(ThinkerError, match="model.onnx.data: not the weights model.onnx was exported with"):
        check_weights_stamp(model, tmp_path / "model.onnx", data)


def test_stamping_again_replaces_the_stamp(tmp_path):
    data = tmp_path / "model.onnx.data"
    data.write_bytes(bytes(PAGE))
    model = stamped_model(data)
    data.write_bytes(bytes(2 * PAGE))  # the accuracy guard's fallback rewrites the weights and stamps again
    stamp_weights(model, data)
    props = {prop.key: prop.value for prop in model.metadata_props}
    assert len(model.metadata_props) == 2
    assert props == {WEIGHTS_SIZE_KEY: str(2 * PAGE), WEIGHTS_FINGERPRINT_KEY: weights_fingerprint(data)}
    check_weights_stamp(model, tmp_path / "model.onnx", data)


def test_a_graph_without_stamps_loads_as_before(tmp_path):
    data = tmp_path / "model.onnx.data"
    data.write_bytes(bytes(PAGE))
    check_weights_stamp(onnx.ModelProto(), tmp_path / "model.onnx", data)
