"""Image datasets the dataset objectives train on (``sft``, ``dpo_offline``): their layouts, their images, and
converters from the public formats.

A dataset is a JSONL prompt file (:func:`flowgrpo.data.prompts.load_prompts`: one object a line with a ``prompt``;
every other field is metadata, handed to the rewards too), named by ``data.train_prompts``; image paths are
relative to the file's folder (or absolute):

- **image set** (``sft``): ``{"prompt": "a red cube", "target": "images/0.png", ...}``: the image the prompt should
  give.
- **preference set** (``dpo_offline``): ``{"prompt": "a red cube", "chosen": "images/0_w.png", "rejected":
  "images/0_l.png", ...}``: one line per pair, the chosen (preferred) image first.

Every image must be RGB-convertible and exactly the run's ``model.height`` × ``model.width`` (nothing is resized
silently; the converters below resize on request). The converters read the structure of the common public
formats from local files and write the layouts above (images as PNG, the JSONL written atomically):

- Pick-a-Pic v1/v2 (``yuvalkirstain/pickapic_v2``): rows with ``caption``, ``jpg_0``, ``jpg_1`` (encoded image
  bytes; base64 strings in JSONL) and ``label_0`` (1: ``jpg_0`` preferred, 0: ``jpg_1``, 0.5: a tie, dropped), read
  from a local ``.parquet`` (needs pyarrow) or ``.jsonl`` (:func:`read_pickapic`; the convention of Diffusion-DPO's
  train.py, SalesforceAIResearch/DiffusionDPO 5233e75, lines 72–73, 782–784 and 857);
- ranked lists (HPDv2's ``test.json`` layout; its ``train.json`` holds a 0/1 ``human_preference`` list instead of
  ``rank`` and is refused, naming the fields):
  ``{"prompt": ..., "image_path": [...], "rank": [...]}`` with rank 1 the best, pairs best-vs-worst or every
  ordered pair (:func:`read_ranked`);
- a Hugging Face ``imagefolder`` with its ``metadata.jsonl`` (``{"file_name": ..., "text": ...}``, the caption
  column settable) (:func:`read_imagefolder`).

Command line::

    python -m flowgrpo.data.image_sets pickapic train.parquet out/ [--size 512 512]
    python -m flowgrpo.data.image_sets ranked test.json out/ [--pairs all]
    python -m flowgrpo.data.image_sets imagefolder folder/ out/
"""

from __future__ import annotations

import base64
import io
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flowgrpo.argtypes import OneLineParser
from flowgrpo.data.prompts import EMBEDDED
from flowgrpo.data.text_files import iter_jsonl
from flowgrpo.writing.outputs import OutputRefused, check_folder, claim_folder, normal_mode, replace_file

__all__ = ["ImageItem", "PreferencePair", "check_dataset_images", "dataset_file", "dataset_folder", "load_image",
           "record_image", "read_pickapic",
           "read_ranked", "read_imagefolder", "write_image_set", "write_preference_set", "main"]

#: the metadata keys of each layout
TARGET_KEY = "target"
PAIR_KEYS = ("chosen", "rejected")


@dataclass(frozen=True)
class ImageItem:
    """One (prompt, image) of an image set: ``image`` is a path or encoded image bytes; ``metadata`` extra fields."""

    prompt: str
    image: str | bytes
    metadata: dict


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair: the ``chosen`` (preferred) and ``rejected`` images (paths or encoded bytes) of
    ``prompt``; ``metadata`` extra fields."""

    prompt: str
    chosen: str | bytes
    rejected: str | bytes
    metadata: dict


def dataset_folder(name_or_path: str) -> Path:
    """The folder a dataset's relative image paths start from: the JSONL file's (``data.train_prompts``), or the
    embedded set's file's."""
    if name_or_path in EMBEDDED:
        return Path(EMBEDDED[name_or_path]()[0]).parent
    return Path(name_or_path).resolve().parent


def _open(image: str | bytes | Path):
    from PIL import Image

    return Image.open(io.BytesIO(image) if isinstance(image, bytes) else image).convert("RGB")


def load_image(path: str | Path, height: int, width: int) -> torch.Tensor:
    """(3, height, width) float32 in [0, 1] of the image at ``path``.

    Raises:
        ValueError: a missing or unreadable file, or an image of another size (naming the path and both sizes).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"dataset image {str(p)!r} not found")
    try:
        img = _open(p)
    except OSError as err:
        raise ValueError(f"dataset image {str(p)!r} cannot be read ({err})") from None
    if img.size != (width, height):
        raise ValueError(f"dataset image {str(p)!r} is {img.size[0]}x{img.size[1]} (width x height), the run "
                         f"needs {width}x{height} (model.width x model.height); resize the set (python -m "
                         "flowgrpo.data.image_sets ... --size H W)")
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def record_image(metadata: dict, key: str, folder: Path) -> Path:
    """The absolute path of a record's image ``key`` (``target``, ``chosen``, ``rejected``), relative to
    ``folder``. Raises ``ValueError`` when the record has no such string field."""
    value = metadata.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"dataset record {metadata!r} needs a string field {key!r} (an image path relative to the "
                         "dataset file)")
    return (folder / value).resolve()


def dataset_file(name_or_path: str) -> Path:
    """The JSONL file of a dataset (``data.train_prompts``): the path, or the embedded set's file."""
    return Path(EMBEDDED[name_or_path]()[0]) if name_or_path in EMBEDDED else Path(name_or_path)


def _image_size(path: Path) -> tuple[int, int]:
    """(width, height) of the image file at ``path``, its structure checked (PIL ``verify``: chunks and checksums,
    no decoding). Raises ``ValueError`` for a missing, empty or unreadable file."""
    from PIL import Image

    if not path.is_file():
        raise ValueError("not found" if not path.exists() else "is not a file")
    if path.stat().st_size == 0:
        raise ValueError("is empty (0 bytes)")
    try:
        with Image.open(path) as img:
            img.verify()
            return img.size
    except (OSError, SyntaxError, ValueError) as err:  # PIL: UnidentifiedImageError, truncated or bad chunks
        raise ValueError(f"cannot be read as an image ({' '.join(str(err).split()) or type(err).__name__})") from None


def check_dataset_images(name_or_path: str, keys: Iterable[str], size: tuple[int, int] | None = None
                         ) -> tuple[tuple[int, int], str] | None:
    """Open every image of every record of the dataset ``name_or_path`` (``data.train_prompts``) under each of
    ``keys`` (``target``; ``chosen`` and ``rejected``) and read its size, before any model loads: one image that
    cannot be used stops the run at once instead of in the epoch that draws its record.

    Args:
        name_or_path: the JSONL file (or an embedded set); image paths are relative to its folder.
        keys: the record fields that hold image paths.
        size: (width, height) every image must have (``model.width`` × ``model.height``); None: every image the
            size of the first.

    Returns:
        ((width, height), where) of the first image (``where``: ``file:line: key 'path'``), for the check against
        the model's size once it loads; None for a set without records.

    Raises:
        ValueError: one line ``<file>:<line>: <key> <path> ...`` for a record without the field, a missing, empty
            or corrupt image, or one of another size (both sizes and the way out).
    """
    path, first = dataset_file(name_or_path), None
    folder = path.resolve().parent
    for lineno, record in iter_jsonl(path):
        for key in keys:
            value = record.get(key) if isinstance(record, dict) else None
            if not isinstance(value, str) or not value:
                raise ValueError(f"{path}:{lineno}: the record needs a string field {key!r} (an image path relative "
                                 "to the dataset file)")
            where = f"{path}:{lineno}: {key} {value!r}"
            try:
                got = _image_size((folder / value).resolve())
            except ValueError as err:
                raise ValueError(f"{where} ({(folder / value).resolve()}) {err}; fix or remove that record") from None
            expected = size or (first[0] if first else got)
            if got != expected:
                need = (f"the run needs {expected[0]}x{expected[1]} (model.width x model.height)" if size else
                        f"the set's first image ({first[1]}) is {expected[0]}x{expected[1]}")
                raise ValueError(f"{where} is {got[0]}x{got[1]} (width x height), {need}; resize the set (python -m "
                                 "flowgrpo.data.image_sets ... --size H W)")
            first = first or (got, where)
    return first


# ------------------------------------------------------------------------------------------- public formats
def _rows(path: Path) -> Iterator[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or give the rows as "
                             "JSONL") from None
        for batch in pq.ParquetFile(path).iter_batches():
            yield from batch.to_pylist()
    elif path.suffix == ".jsonl":
        for lineno, obj in iter_jsonl(path):
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
            yield obj
    else:
        raise ValueError(f"{path}: give a .parquet or .jsonl file")


def _image_field(value, path: Path, column: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, dict) and isinstance(value.get("bytes"), bytes):  # datasets' Image feature
        return value["bytes"]
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            raise ValueError(f"{path}: column {column!r} holds a string that is not base64 image bytes") from None
    raise ValueError(f"{path}: column {column!r} must hold encoded image bytes, got {type(value).__name__}")


def read_pickapic(path: str | Path) -> Iterator[PreferencePair]:
    """The preference pairs of Pick-a-Pic rows (``caption``, ``jpg_0``, ``jpg_1``, ``label_0``) from a local
    ``.parquet`` or ``.jsonl``: ``label_0`` 1 → ``jpg_0`` chosen, 0 → ``jpg_1`` chosen, 0.5 (a tie) dropped
    (Diffusion-DPO train.py lines 782–784, 857). Other columns are kept as metadata when JSON-serialisable scalars.

    Raises:
        ValueError: a missing column, a ``label_0`` outside {0, 0.5, 1}, an image that is not bytes.
    """
    path = Path(path)
    for i, row in enumerate(_rows(path)):
        missing = [c for c in ("caption", "jpg_0", "jpg_1", "label_0") if c not in row]
        if missing:
            raise ValueError(f"{path}: row {i} lacks the Pick-a-Pic column(s) {missing}")
        label = float(row["label_0"])
        if label not in (0.0, 0.5, 1.0):
            raise ValueError(f"{path}: row {i} has label_0={row['label_0']!r}; Pick-a-Pic labels are 0, 0.5 or 1")
        if label == 0.5:
            continue
        a, b = _image_field(row["jpg_0"], path, "jpg_0"), _image_field(row["jpg_1"], path, "jpg_1")
        extra = {k: v for k, v in row.items() if k not in ("caption", "jpg_0", "jpg_1", "label_0")
                 and isinstance(v, str | int | float | bool)}
        yield PreferencePair(str(row["caption"]), a if label == 1.0 else b, b if label == 1.0 else a, extra)


def read_ranked(path: str | Path, pairs: str = "best_worst") -> Iterator[PreferencePair]:
    """Preference pairs of ranked lists ``{"prompt", "image_path": [...], "rank": [...]}`` (rank 1 the best; a JSON
    list or JSONL; paths relative to the file): ``best_worst`` one pair per list, ``all`` every pair of different
    ranks (the better one chosen).

    Raises:
        ValueError: a record without the fields, lists of different lengths or fewer than 2 images, or another
            ``pairs``.
    """
    if pairs not in ("best_worst", "all"):
        raise ValueError(f"pairs must be best_worst or all, got {pairs!r}")
    path = Path(path)
    if path.suffix == ".jsonl":
        records = [obj for _, obj in iter_jsonl(path)]
    else:
        records = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(records, list):
            raise ValueError(f"{path}: a ranked-list file holds a JSON list of records")
    for i, rec in enumerate(records):
        images, ranks = rec.get("image_path"), rec.get("rank")
        if not isinstance(rec.get("prompt"), str) or not isinstance(images, list) or not isinstance(ranks, list):
            raise ValueError(f"{path}: record {i} needs 'prompt', 'image_path' (a list) and 'rank' (a list)")
        if len(images) != len(ranks) or len(images) < 2:
            raise ValueError(f"{path}: record {i} has {len(images)} images and {len(ranks)} ranks; give 2 or more "
                             "of each")
        paths = [str((path.parent / p).resolve()) for p in images]
        order = sorted(range(len(paths)), key=lambda j: ranks[j])
        if pairs == "best_worst":
            chosen_rejected = [(order[0], order[-1])] if ranks[order[0]] != ranks[order[-1]] else []
        else:
            chosen_rejected = [(a, b) for x, a in enumerate(order) for b in order[x + 1:] if ranks[a] != ranks[b]]
        for a, b in chosen_rejected:
            yield PreferencePair(rec["prompt"], paths[a], paths[b], {})


def read_imagefolder(folder: str | Path, caption_column: str = "text") -> Iterator[ImageItem]:
    """(prompt, image) items of a Hugging Face ``imagefolder`` (its ``metadata.jsonl``: ``file_name`` and the
    caption column); other fields are kept as metadata.

    Raises:
        ValueError: no ``metadata.jsonl``, or a line without ``file_name`` or the caption column.
    """
    folder = Path(folder)
    meta = folder / "metadata.jsonl"
    if not meta.is_file():
        raise ValueError(f"{folder}: an imagefolder needs metadata.jsonl (lines with file_name and "
                         f"{caption_column!r})")
    for lineno, obj in iter_jsonl(meta):
        if not isinstance(obj, dict) or not isinstance(obj.get("file_name"), str) \
                or not isinstance(obj.get(caption_column), str):
            raise ValueError(f"{meta}:{lineno}: needs string fields 'file_name' and {caption_column!r}")
        extra = {k: v for k, v in obj.items() if k not in ("file_name", caption_column)}
        yield ImageItem(obj[caption_column], str((folder / obj["file_name"]).resolve()), extra)


# --------------------------------------------------------------------------------------------------- writers
def _save_png(image: str | bytes, out: Path, size: tuple[int, int] | None) -> None:
    from PIL import Image

    img = _open(image)
    if size is not None and img.size != (size[1], size[0]):
        img = img.resize((size[1], size[0]), Image.Resampling.BICUBIC)
    replace_file(out, lambda tmp: img.save(tmp, format="PNG"))


def _check_metadata(metadata: dict, written: tuple[str, ...], i: int) -> None:
    """Refuse metadata holding a field the writer fills (it would replace the prompt or an image path)."""
    clash = [k for k in written if k in metadata]
    if clash:
        raise ValueError(f"record {i}: its metadata has the field(s) {clash}, which the written layout fills "
                         f"({', '.join(written)}); rename or drop them in the source")


def _write_jsonl(records: list[dict], out: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    normal_mode(tmp)
    os.replace(tmp, out)


def write_preference_set(pairs: Iterable[PreferencePair], out_dir: str | Path,
                         size: tuple[int, int] | None = None) -> Path:
    """Write ``pairs`` in the preference layout: ``out_dir/images/<i>_chosen.png``, ``<i>_rejected.png`` and
    ``out_dir/data.jsonl`` (one line a pair: ``prompt``, ``chosen``, ``rejected``, the metadata); ``size``
    (height, width) resizes every image (bicubic). Returns the JSONL's path.

    Raises:
        OutputRefused: ``out_dir`` holds files flowgrpo did not write, or other flowgrpo output
            (:func:`flowgrpo.writing.outputs.check_folder`).
        ValueError: no pairs, or a pair whose metadata has a ``prompt``, ``chosen`` or ``rejected`` field (it would
            replace the written one)."""
    out = Path(out_dir)
    check_folder(out, "out_dir", "preference set")  # flowgrpo's write rule (flowgrpo.writing.outputs)
    claim_folder(out, "preference set", "out_dir")
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i, p in enumerate(pairs):
        _check_metadata(p.metadata, ("prompt", *PAIR_KEYS), i)
        names = {k: f"images/{i}_{k}.png" for k in PAIR_KEYS}
        _save_png(p.chosen, out / names["chosen"], size)
        _save_png(p.rejected, out / names["rejected"], size)
        records.append({"prompt": p.prompt, **names, **p.metadata})
    if not records:
        raise ValueError("no preference pairs to write")
    _write_jsonl(records, out / "data.jsonl")
    return out / "data.jsonl"


def write_image_set(items: Iterable[ImageItem], out_dir: str | Path, size: tuple[int, int] | None = None) -> Path:
    """Write ``items`` in the image-set layout: ``out_dir/images/<i>.png`` and ``out_dir/data.jsonl`` (``prompt``,
    ``target``, the metadata); ``size`` (height, width) resizes every image. Returns the JSONL's path.

    Raises:
        OutputRefused: ``out_dir`` holds files flowgrpo did not write, or other flowgrpo output
            (:func:`flowgrpo.writing.outputs.check_folder`).
        ValueError: no items, or an item whose metadata has a ``prompt`` or ``target`` field (it would replace the
            written one)."""
    out = Path(out_dir)
    check_folder(out, "out_dir", "image set")  # flowgrpo's write rule (flowgrpo.writing.outputs)
    claim_folder(out, "image set", "out_dir")
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i, item in enumerate(items):
        _check_metadata(item.metadata, ("prompt", TARGET_KEY), i)
        name = f"images/{i}.png"
        _save_png(item.image, out / name, size)
        records.append({"prompt": item.prompt, TARGET_KEY: name, **item.metadata})
    if not records:
        raise ValueError("no images to write")
    _write_jsonl(records, out / "data.jsonl")
    return out / "data.jsonl"


def main(argv: list[str] | None = None) -> None:
    """Convert a public dataset (``pickapic``, ``ranked``, ``imagefolder``) into our layouts."""
    ap = OneLineParser(prog="python -m flowgrpo.data.image_sets", description=main.__doc__)
    ap.add_argument("format", choices=["pickapic", "ranked", "imagefolder"])
    ap.add_argument("source", help="the .parquet/.jsonl (pickapic), .json/.jsonl (ranked) or folder (imagefolder)")
    ap.add_argument("out", help="the folder to write images/ and data.jsonl into")
    ap.add_argument("--size", nargs=2, type=int, metavar=("HEIGHT", "WIDTH"), help="resize every image (bicubic)")
    ap.add_argument("--pairs", default="best_worst", choices=["best_worst", "all"], help="ranked: which pairs")
    ap.add_argument("--caption-column", default="text", help="imagefolder: the caption field of metadata.jsonl")
    a = ap.parse_args(argv)
    size = tuple(a.size) if a.size else None
    kind = "image set" if a.format == "imagefolder" else "preference set"
    try:  # before the source is read: never into a folder of other files, never onto the source
        check_folder(a.out, "out", kind, inputs=[a.source])
    except OutputRefused as err:
        ap.exit(2, f"{ap.prog}: error: {err}\n")
    if a.format == "pickapic":
        path = write_preference_set(read_pickapic(a.source), a.out, size)
    elif a.format == "ranked":
        path = write_preference_set(read_ranked(a.source, a.pairs), a.out, size)
    else:
        path = write_image_set(read_imagefolder(a.source, a.caption_column), a.out, size)
    print(path)  # noqa: T201 - the command's result: the dataset file to name in data.train_prompts


if __name__ == "__main__":
    main()
