"""Weights moved into huge pages (`tsterm.model.huge_pages`): the same values, shapes and strides in new memory,
views still views of their base, borrowed memory (a file mapping) left where it is, and a quantized model that
decodes the same tokens and log-probabilities with and without the move."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tsterm.model.decoder as decoder
from tsterm import LLM, SamplingParams
from tsterm.model.huge_pages import HUGE_PAGE, move_to_huge_pages

from tests.helpers.checkpoints import make_checkpoint

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                               reason="needs transparent huge pages (Linux, not disabled)")


def _mapping(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address `ptr` (its range under "range")."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= ptr < hi
            fields = {"range": head}
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields if inside else {}


@needs_thp
def test_owned_storages_move_with_their_values_and_views():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 1000, generator=gen)
    row = a[1]  # a view: moving it moves its base's storage, so both stay one storage
    codes = torch.randint(-127, 128, (50, 64), dtype=torch.int8, generator=gen)
    strided = torch.randn(40, 30, generator=gen).t()  # non-contiguous: strides kept
    borrowed = torch.frombuffer(bytearray(range(256)) * 64, dtype=torch.uint8)  # not torch's memory
    before = {name: t.clone() for name, t in dict(a=a, codes=codes, strided=strided, borrowed=borrowed).items()}
    old = {name: t.data_ptr() for name, t in dict(a=a, codes=codes, strided=strided, borrowed=borrowed).items()}

    moved = move_to_huge_pages([row, codes, strided, borrowed, None])

    assert moved == 3 * 1000 * 4 + 50 * 64 + 40 * 30 * 4 + 32  # (each storage starts on 64 bytes)
    for name, t in dict(a=a, codes=codes, strided=strided).items():
        assert t.data_ptr() != old[name] and torch.equal(t, before[name]), name
        smaps = _mapping(t.data_ptr())
        assert smaps.get("THPeligible") == "1", (name, smaps)  # the arena is advised for huge pages
    assert strided.stride() == (1, 30) and strided.shape == (30, 40)
    assert row.data_ptr() == a.data_ptr() + 1000 * 4
    assert row.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    a[1, 7] = 42.0
    assert row[7] == 42.0  # still a view of a
    assert borrowed.data_ptr() == old["borrowed"] and torch.equal(borrowed, before["borrowed"])
    assert a.untyped_storage().data_ptr() % HUGE_PAGE == 0  # the first storage starts the arena
    assert move_to_huge_pages([]) == 0


@needs_thp
def test_borrowed_storages_move_only_when_passed_as_mapped_and_whole():
    memory, file = bytearray(range(256)) * 64, bytearray(range(256)) * 64
    whole = torch.frombuffer(memory, dtype=torch.int8)  # borrowed, all of its storage
    # borrowed: 4 KB of a 16 KB storage (as a tensor of a whole-file storage would be)
    part = torch.empty(0, dtype=torch.int8).set_(torch.frombuffer(file, dtype=torch.int8).untyped_storage(), 4096,
                                                 (4096,), (1,))
    want_whole, want_part, at = whole.clone(), part.clone(), part.data_ptr()
    assert move_to_huge_pages([whole]) == 0  # borrowed and not passed as mapped: stays
    assert whole.data_ptr() == torch.frombuffer(memory, dtype=torch.int8).data_ptr()
    assert move_to_huge_pages([], mapped=[whole, part]) == len(memory)  # whole moves; part's storage is more than it
    assert torch.equal(whole, want_whole) and _mapping(whole.data_ptr()).get("THPeligible") == "1"
    assert part.data_ptr() == at and torch.equal(part, want_part)
    memory[0] = 99
    assert whole[0] == 0  # a copy now: the buffer is no longer its memory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    sizes = dict(hidden_size=64, intermediate_size=96, head_dim=16, num_hidden_layers=2)
    return make_checkpoint(tmp_path_factory.mktemp("huge_pages"), "llama", sizes)[0]


def _decode(model_dir: Path):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", quantization="int4", block_size=4, num_kv_blocks=64)
    out = llm.generate([[5, 9, 2, 77, 31, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                              logprobs=0))[0].outputs[0]
    return llm.engine.executor.model, out.token_ids, [step["logprob"] for step in out.logprobs]


@needs_thp
def test_a_quantized_model_decodes_the_same_from_huge_pages(checkpoint, monkeypatch):
    model, tokens, logprobs = _decode(checkpoint)
    qkv = model.layers[0][1].qkv  # fused at load: torch's memory, so it moved
    assert model.huge_page_bytes > 0 and _mapping(qkv.data.data_ptr()).get("THPeligible") == "1"
    assert model.stack is not None  # (the decode stack read the moved weights)
    monkeypatch.setattr(decoder, "move_to_huge_pages", lambda tensors, mapped=(): 0)
    unmoved, want_tokens, want_logprobs = _decode(checkpoint)
    assert unmoved.huge_page_bytes == 0 and _mapping(unmoved.layers[0][1].qkv.data.data_ptr()).get("THPeligible") != "1"
    assert tokens == want_tokens and logprobs == want_logprobs


@needs_thp
def test_inference_tensors_move_too():
    with torch.inference_mode():  # (a loader may make its copies in inference mode)
        t = torch.arange(3000, dtype=torch.float32) * 0.5
    want, at = t.clone(), t.data_ptr()
    assert move_to_huge_pages([t]) == 12032 and t.data_ptr() != at and torch.equal(t, want) and t.is_inference()
