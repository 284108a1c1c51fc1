"""A truncated GGUF (a download cut short) is named by what it lacks: the file, the first tensor it cuts, how many
of that tensor's bytes it has and how many the file misses. The tensors' byte ranges of the whole file come from
the `gguf` package's own reader (the oracle), not from tsterm's header check."""
from __future__ import annotations

import pytest

pytest.importorskip("gguf")

import gguf  # noqa: E402

from tests.helpers.gguf import tiny_model, write_gguf  # noqa: E402
from tsterm.errors import ModelLoadError  # noqa: E402
from tsterm.convert.gguf import import_gguf  # noqa: E402
from tsterm.convert.gguf_cli import cli_main  # noqa: E402


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    model = tiny_model("llama")
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model,
                      quantize={"blk.1.ffn_down.weight": gguf.GGMLQuantizationType.Q8_0})
    reader = gguf.GGUFReader(str(path))
    return path, sorted(reader.tensors, key=lambda t: t.data_offset)


def cut(path, size: int, to):
    to.write_bytes(path.read_bytes()[:size])
    return to


@pytest.mark.parametrize("which, into", [(-1, 1), (-1, -1), (-3, 5)])  # bytes into a tensor: from its start / end
def test_a_cut_inside_a_tensor_names_it_and_what_is_missing(whole, tmp_path, which, into):
    path, tensors = whole
    tensor = tensors[which]
    size = tensor.data_offset + (into if into > 0 else tensor.n_bytes + into)
    short = cut(path, size, tmp_path / "short.gguf")
    with pytest.raises(ModelLoadError) as info:
        import_gguf(short, tmp_path / "out")
    message, need = str(info.value), path.stat().st_size
    shape = " x ".join(str(int(d)) for d in reversed(tensor.shape))
    assert message.startswith(f"{short}: the file is cut short: it has {size:,} bytes, its {len(tensors)} tensors "
                              f"need {need:,} ({need - size:,} missing); tensor {tensor.name!r} "
                              f"({tensor.tensor_type.name}, {shape}) has {size - tensor.data_offset:,} of its "
                              f"{tensor.n_bytes:,} bytes"), message
    after = -which - 1
    assert (f"and the {after} tensor" in message) == (after > 0), message
    assert "reshape" not in message and not (tmp_path / "out").exists()


def test_a_cut_inside_the_header_says_so(whole, tmp_path, capsys):
    path, tensors = whole
    short = cut(path, 200, tmp_path / "head.gguf")
    assert cli_main([str(short), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{short}: the file is cut short: it has 200 bytes and ends inside its " \
        "header (metadata" in err, err


def test_a_whole_file_that_is_no_gguf_keeps_the_readers_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        import_gguf(bad, tmp_path / "out")
