"""data/tarscan.py: samples and member offsets from the headers agree with WebDataset; a cut-off tar is reported."""

import io
import tarfile

import pytest
import webdataset as wds

from atelier_studio.data.tarscan import TruncatedTar, iter_tar_samples, read_at, read_into


def _tar(members: list[dict]) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf, encoder=False) as w:
        for m in members:
            w.write(m)
    return buf.getvalue()


def test_samples_and_offsets_match_webdataset(tmp_path):
    members = [{"__key__": f"k{i}", "json": f'{{"i": {i}}}'.encode(), "safetensors": bytes(range(i, i + 200)) * 3,
                "txt": b"x" * (i * 300)} for i in range(5)]
    path = tmp_path / "s.tar"
    path.write_bytes(_tar(members))
    with open(path, "rb") as f:
        got = list(iter_tar_samples(f))
        assert [s.key for s in got] == [m["__key__"] for m in members]
        for s, m in zip(got, members):
            assert sorted(s.members) == ["json", "safetensors", "txt"] and s.duplicate is None
            for ext, (offset, size) in s.members.items():
                assert read_at(f, offset, size) == m[ext]
        out = bytearray(600)
        read_into(f, got[2].members["safetensors"][0], memoryview(out))
        assert bytes(out) == members[2]["safetensors"]
    # WebDataset's own reader groups the same samples
    ref = list(wds.DataPipeline(wds.SimpleShardList([str(path)]), wds.tarfile_to_samples()))
    assert [r["__key__"] for r in ref] == [s.key for s in got]


def test_cut_off_tar_raises_after_the_whole_samples(tmp_path):
    data = _tar([{"__key__": f"k{i}", "safetensors": bytes(5000), "json": b"{}"} for i in range(6)])
    with pytest.raises(TruncatedTar):
        list(iter_tar_samples(io.BytesIO(data[: len(data) // 2 + 100])))
    whole = []
    with pytest.raises(TruncatedTar):
        for s in iter_tar_samples(io.BytesIO(data[: len(data) // 2 + 100])):
            whole.append(s.key)
    assert 1 <= len(whole) < 6  # what precedes the cut is served, the sample being cut is not
    with pytest.raises(TruncatedTar, match="file ends after"):
        read_at(io.BytesIO(data[:100]), 50, 100)


def test_duplicate_member_is_flagged():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in ("k0.json", "k0.safetensors", "k0.json", "k1.json"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tf.addfile(info, io.BytesIO(b"{}"))
    buf.seek(0)
    got = list(iter_tar_samples(buf))
    assert [(s.key, s.duplicate) for s in got] == [("k0", "json"), ("k1", None)]
