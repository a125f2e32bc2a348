"""The fast GGUF header reader agrees with the gguf package's GGUFReader."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from inferd.models.gguf_file import GGUFFile


def _reference_value(field):  # noqa: ANN001, ANN202
    """A GGUFReader field as a plain Python value."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        values = [field.parts[i][0] for i in field.data]
    elif kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    else:
        values = [field.parts[field.data[0]][0]]
    item = field.types[-1]
    if item == GGUFValueType.FLOAT32:
        values = [float(str(v)) for v in values]
    elif item == GGUFValueType.BOOL:
        values = [bool(v) for v in values]
    else:
        values = [v.item() for v in values]
    return values if kind == GGUFValueType.ARRAY else values[0]


def _assert_same(path) -> None:  # noqa: ANN001
    ours, ref = GGUFFile(path), GGUFReader(path)
    expected = {k: _reference_value(f) for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape, a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, tuple(int(d) for d in b.shape), b.n_elements, b.n_bytes, b.data_offset,
        )
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name


def test_default_model_header_and_tensors_match_gguf_reader(default_model_path):
    _assert_same(default_model_path)


def test_every_tensor_type_matches_gguf_reader(tiny_gguf, tmp_path):
    import gguf

    weights = tiny_gguf.weights()
    types = [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16,
             gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]
    tensors = {}
    for i, (name, w) in enumerate(weights.items()):
        qtype = types[i % len(types)] if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        tensors[name] = (w, qtype)
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write(path, tensors)
    _assert_same(path)


@pytest.mark.parametrize("cut", [3, 10, 200])
def test_a_cut_header_is_a_value_error(default_model_path, tmp_path, cut):
    path = tmp_path / "cut.gguf"
    path.write_bytes(default_model_path.read_bytes()[:cut])
    with pytest.raises(ValueError):
        GGUFFile(path)
