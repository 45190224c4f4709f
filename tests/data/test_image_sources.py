"""data/image_sources.py and `atelier data shards --from`: caption sidecars, kohya repeat folders, an HF imagefolder
(metadata.jsonl / .csv), parquet with image bytes; the shards hold the original bytes and captions; bad images are
skipped and counted in index.json and the summary line; bad listings are one line naming file:line."""

import io
import json
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from atelier_studio.data.image_sources import write_source_shards
from atelier_studio.data.shards import validate_shards
from atelier_studio.flows.cli import main
from atelier_studio.pipeline.errors import DataError

from tests.pipeline.test_hub import lay_out_cache, offline_cache  # noqa: F401 (a fixture)


def png(color: tuple[int, int, int], fmt: str = "PNG", side: int = 20) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buf, format=fmt)
    return buf.getvalue()


def put(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def samples(out: Path) -> list[tuple[bytes, str, dict]]:
    """(image bytes, caption, json) of every sample of the shard set, in key order."""
    got: dict[str, dict] = {}
    for tar in sorted(out.glob("shard-*.tar")):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                key, ext = m.name.split(".", 1)
                got.setdefault(key, {})[ext] = t.extractfile(m).read()
    return [(next(v for e, v in s.items() if e in ("png", "jpg", "webp")), s["txt"].decode(), json.loads(s["json"]))
            for _, s in sorted(got.items())]


def test_sidecar_captions_recursive_with_bad_images_skipped_and_counted(tmp_path):
    src = tmp_path / "src"
    a, b = png((255, 0, 0)), png((0, 0, 255), "JPEG")
    put(src / "a.png", a), put(src / "a.txt", "a red square\n")
    put(src / "deep" / "b.jpeg", b), put(src / "deep" / "b.caption", "a blue square")
    put(src / "no_caption.png", png((0, 255, 0)))
    put(src / "cut.png", png((9, 9, 9))[:40]), put(src / "cut.txt", "cut off")
    put(src / "empty.png", b""), put(src / "empty.txt", "nothing")
    put(src / "blank.png", png((1, 2, 3))), put(src / "blank.txt", "  \n")
    put(src / "notes.md", "not an image")
    got = write_source_shards(src, tmp_path / "out", shard_size=1, progress=False)
    assert (got.layout, got.images, got.shards.total, len(got.shards.shards)) == ("sidecars", 2, 2, 2)
    assert samples(tmp_path / "out") == [(a, "a red square", {"width": 20, "height": 20, "path": "a.png"}),
                                         (b, "a blue square", {"width": 20, "height": 20, "path": "deep/b.jpeg"})]
    skipped = {"no caption file": 1, "undecodable image": 1, "empty image file": 1, "empty caption": 1}
    assert json.loads((tmp_path / "out" / "index.json").read_text())["skipped"] == skipped
    assert dict(got.skipped.by_reason) == skipped and f"first: {src / 'cut.png'}" in got.skipped.summary()
    assert validate_shards(tmp_path / "out").ok


def test_kohya_repeat_folders_repeat_each_image(tmp_path):
    src = tmp_path / "src"
    cat, dog = png((200, 100, 0)), png((0, 100, 200), "WEBP")
    put(src / "3_cat" / "x.png", cat), put(src / "3_cat" / "x.txt", "a cat")
    put(src / "1_dog" / "sub" / "y.webp", dog), put(src / "1_dog" / "sub" / "y.txt", "a dog")
    got = write_source_shards(src, tmp_path / "out", shard_size=10, progress=False)
    assert (got.images, got.shards.total) == (2, 4)
    rows = samples(tmp_path / "out")
    assert [(d, c, m.get("repeat")) for d, c, m in rows] == [(dog, "a dog", None), (cat, "a cat", 0),
                                                             (cat, "a cat", 1), (cat, "a cat", 2)]
    put(src / "0_none" / "w.png", cat), put(src / "0_none" / "w.txt", "w")
    with pytest.raises(DataError, match=r"0_none: a repeat folder with 0 repeats; name it with N >= 1"):
        write_source_shards(src, tmp_path / "out2", shard_size=10, progress=False)


def test_imagefolder_metadata_jsonl_and_csv(tmp_path):
    src = tmp_path / "src"
    a, b = png((10, 20, 30)), png((40, 50, 60), "JPEG")
    put(src / "a.png", a)  # a number column beside the text is no caption candidate
    put(src / "metadata.jsonl", json.dumps({"file_name": "a.png", "text": "first", "aesthetic": 6.5}) + "\n")
    put(src / "more" / "imgs" / "b.jpg", b)
    put(src / "more" / "metadata.csv", 'file_name,text\nimgs/b.jpg,"second, with a comma"\n')
    got = write_source_shards(src, tmp_path / "out", shard_size=10, progress=False)
    assert got.layout == "imagefolder"
    assert [(d, c, m["path"]) for d, c, m in samples(tmp_path / "out")] == [
        (a, "first", "a.png"), (b, "second, with a comma", "more/imgs/b.jpg")]


@pytest.mark.parametrize("line,column,message", [
    ({"file_name": "a.png", "text": "t", "prompt": "p"}, None,
     r"metadata\.jsonl:1: several columns could be the caption \(text, prompt\); choose one with --caption-column"),
    ({"file_name": "a.png", "text": "t"}, "caption", r"metadata\.jsonl:1: no column 'caption' \(--caption-column"),
    ({"image": "a.png", "text": "t"}, None, r"metadata\.jsonl:1: no 'file_name'"),
    ({"file_name": "gone.png", "text": "t"}, None, r"metadata\.jsonl:1: file_name 'gone\.png': no such file"),
], ids=["ambiguous", "named-column-missing", "no-file-name", "missing-file"])
def test_imagefolder_listing_errors_name_the_line(tmp_path, line, column, message):
    put(tmp_path / "src" / "a.png", png((1, 1, 1)))
    put(tmp_path / "src" / "metadata.jsonl", json.dumps(line) + "\n")
    with pytest.raises(DataError, match=message):
        write_source_shards(tmp_path / "src", tmp_path / "out", 10, column, progress=False)
    assert not (tmp_path / "out").exists()


def test_parquet_with_image_structs_and_raw_bytes(tmp_path):
    import datasets

    a, b = png((255, 255, 0)), png((0, 255, 255), "JPEG")
    ds = datasets.Dataset.from_dict({"image": [{"bytes": a, "path": None}, {"bytes": b"broken", "path": None},
                                               {"bytes": b, "path": None}], "caption": ["one", "two", "three"]},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "caption": datasets.Value("string")}))
    ds.to_parquet(str(tmp_path / "img.parquet"))
    got = write_source_shards(tmp_path / "img.parquet", tmp_path / "out", 10, progress=False)
    assert [(d, c) for d, c, _ in samples(tmp_path / "out")] == [(a, "one"), (b, "three")]
    assert dict(got.skipped.by_reason) == {"undecodable image": 1}
    assert got.skipped.first["undecodable image"] == f"{tmp_path / 'img.parquet'} row 2"
    raw = datasets.Dataset.from_dict({"png": [a], "label": ["raw bytes"], "prompt": ["x"]})
    raw.to_parquet(str(tmp_path / "raw" / "r.parquet"))
    write_source_shards(tmp_path / "raw", tmp_path / "out2", 10, "label", progress=False)
    assert [(d, c) for d, c, _ in samples(tmp_path / "out2")] == [(a, "raw bytes")]


def test_cli_from_prints_the_counts_and_refuses_mixed_options(tmp_path, capsys):
    src = tmp_path / "src"
    put(src / "a.png", png((5, 5, 5))), put(src / "a.txt", "x")
    put(src / "b.png", png((6, 6, 6))[:30]), put(src / "b.txt", "y")
    assert main(["data", "shards", "--from", str(src), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert (f"wrote 1 samples (1 images, sidecars layout) in 1 shards to {tmp_path / 'out'}; skipped 1 images: "
            f"undecodable image 1 (first: {src / 'b.png'})") in out
    for argv in (["--from", str(src), "--images", str(src)], [], ["--images", str(src)]):
        assert main(["data", "shards", *argv, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("atelier: error: data shards: "), err
    (tmp_path / "nothing").mkdir()
    put(tmp_path / "nothing" / "c.png", png((1, 1, 1)))
    assert main(["data", "shards", "--from", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"atelier: error: {tmp_path / 'nothing'}: no usable image (sidecars layout); skipped 1 images: "
                   f"no caption file 1 (first: {tmp_path / 'nothing' / 'c.png'})"]


def test_from_a_hub_dataset_id_in_the_cache(tmp_path, offline_cache):  # noqa: F811
    a = png((7, 8, 9))
    put(tmp_path / "files" / "a.png", a), put(tmp_path / "files" / "metadata.jsonl",
                                              json.dumps({"file_name": "a.png", "text": "from the hub"}) + "\n")
    lay_out_cache(offline_cache, "org/pictures", tmp_path / "files", repo_type="dataset")
    got = write_source_shards("org/pictures", tmp_path / "out", 10, progress=False)
    assert got.layout == "imagefolder" and [(d, c) for d, c, _ in samples(tmp_path / "out")] == [(a, "from the hub")]
    with pytest.raises(DataError, match=r"--from 'org/absent': no such file or folder, and the hub dataset"):
        write_source_shards("org/absent", tmp_path / "out2", 10, progress=False)
