"""ImageNet recipe, data side: the digits export, ImageFolder loading and every bad-input case."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from recipes.imagenet.datamodule import ImageFolderDataModule
from recipes.imagenet.dataset import CheckedImageFolder, ImageFolderError, UnreadableImageError
from recipes.imagenet.prepare_digits import NUM_VAL_IMAGES, digits_split, export_digits

DIGITS_DATA = {
    "num_classes": 10, "batch_size": 16, "num_workers": 0, "pin_memory": False,
    "train_crop_size": 16, "train_crop_scale": (0.6, 1.0), "horizontal_flip": False,
    "eval_resize_size": 16, "eval_crop_size": 16, "mean": (0.5,) * 3, "std": (0.5,) * 3,
}


def digits_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits ImageFolder tree, exported once per test session (shared by the modules)."""
    root = tmp_path_factory.getbasetemp() / "digits"
    if not (root / "done").exists():
        export_digits(root)
        (root / "done").touch()
    return root


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return digits_tree(tmp_path_factory)


def small_tree(root: Path, train: dict[str, int], val: dict[str, int]) -> Path:
    """A tiny ImageFolder with ``n`` random 8x8 RGB PNGs per class and split."""
    gen = torch.Generator().manual_seed(0)
    for split, classes in (("train", train), ("val", val)):
        for name, n in classes.items():
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (8, 8, 3), generator=gen, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(root / split / name / f"{i}.png")
    return root


def test_digits_export_is_a_fixed_stratified_split(digits: Path) -> None:
    files = {split: sorted(p.relative_to(digits / split) for p in (digits / split).rglob("*.png"))
             for split in ("train", "val")}
    assert (len(files["train"]), len(files["val"])) == (1797 - NUM_VAL_IMAGES, NUM_VAL_IMAGES)
    assert not {p.name for p in files["train"]} & {p.name for p in files["val"]}
    val_per_class = Counter(p.parent.name for p in files["val"])
    assert sorted(val_per_class) == [str(d) for d in range(10)]
    assert min(val_per_class.values()) >= 35 and max(val_per_class.values()) <= 37
    # the split is a pure function of the bundled data: a second call gives the same indices
    again = digits_split()
    assert [i for i, _, _ in again["val"]] == sorted(int(p.stem) for p in files["val"])
    image = Image.open(digits / "val" / files["val"][0])
    assert image.size == (8, 8) and image.mode == "L"


def test_digits_loads_through_the_data_module(digits: Path) -> None:
    dm = ImageFolderDataModule(str(digits), **DIGITS_DATA)
    dm.setup("fit")
    assert dm.train_set.classes == [str(d) for d in range(10)]
    assert (len(dm.train_set), len(dm.val_set)) == (1437, 360)
    images, targets = next(iter(dm.train_dataloader()))
    assert images.shape == (16, 3, 16, 16) and images.dtype == torch.float32
    assert targets.shape == (16,) and 0 <= targets.min() and targets.max() <= 9
    val_images, val_targets = next(iter(dm.val_dataloader()))
    # evaluation is deterministic and in folder order: the first 16 images are all zeros
    assert val_targets.tolist() == [0] * 16
    again, _ = next(iter(dm.val_dataloader()))
    assert torch.equal(val_images, again)
    # the file's grey level survives loading: RGB channels are equal
    assert torch.equal(val_images[:, 0], val_images[:, 1])
    assert len(dm.train_dataloader()) == 1437 // 16  # incomplete last batch dropped


def test_layout_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ImageFolderError, match="does not exist"):
        CheckedImageFolder(tmp_path / "missing")
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "a.png")
    with pytest.raises(ImageFolderError, match="no class folders"):
        CheckedImageFolder(tmp_path / "flat")
    root = small_tree(tmp_path / "empty", {"cat": 2, "dog": 0}, {})
    (root / "train" / "dog" / "notes.txt").write_text("not an image")
    with pytest.raises(ImageFolderError, match=r"1 class folder\(s\) contain no images.*dog"):
        CheckedImageFolder(root / "train")


def test_mismatched_classes_and_wrong_num_classes(tmp_path: Path) -> None:
    root = small_tree(tmp_path / "a", {"cat": 2, "dog": 2}, {"cat": 1, "eel": 1})
    dm = ImageFolderDataModule(str(root), **{**DIGITS_DATA, "num_classes": 2})
    with pytest.raises(ImageFolderError, match=r"only in train: \['dog'\]; only in val: \['eel'\]"):
        dm.setup("fit")
    root = small_tree(tmp_path / "b", {"cat": 2, "dog": 2}, {"cat": 1, "dog": 1})
    dm = ImageFolderDataModule(str(root), **{**DIGITS_DATA, "num_classes": 3})
    with pytest.raises(ImageFolderError, match="num_classes is 3 but .* has 2 class folders"):
        dm.setup("fit")


def test_unreadable_image_is_reported_with_its_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = small_tree(tmp_path, {"cat": 3, "dog": 3}, {"cat": 1, "dog": 1})
    bad = root / "train" / "cat" / "1.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    truncated = root / "train" / "dog" / "0.png"
    truncated.write_bytes((root / "train" / "dog" / "1.png").read_bytes()[:60])

    strict = ImageFolderDataModule(str(root), **{**DIGITS_DATA, "num_classes": 2, "batch_size": 6})
    strict.setup("fit")
    with pytest.raises(UnreadableImageError, match=str(bad)) as err:
        strict.train_set[1]
    assert err.value.path == str(bad)
    with pytest.raises(UnreadableImageError, match="cannot read image"):
        list(strict.train_dataloader())
    strict.num_workers = 1  # raised in a worker process: same type, path in the message
    with pytest.raises(UnreadableImageError, match=f"cannot read image ({bad}|{truncated})"):
        list(strict.train_dataloader())

    lenient = ImageFolderDataModule(
        str(root), **{**DIGITS_DATA, "num_classes": 2, "batch_size": 6}, skip_unreadable=True
    )
    lenient.setup("fit")
    dataset = lenient.train_set
    # a skipped file is replaced by the next readable one of the folder order
    with caplog.at_level(logging.WARNING, logger="recipes.imagenet.dataset"):
        image, target = dataset[1]
    assert target == 0 and image.shape == (3, 16, 16)
    assert dataset.num_skipped == 1 and str(bad) in caplog.text
    assert "1 unreadable image(s) skipped" in caplog.text
    # a whole epoch keeps full batches and counts every bad file it met
    dataset.num_skipped = 0
    (images, targets), = list(lenient.train_dataloader())
    assert images.shape[0] == 6 and dataset.num_skipped == 2
    assert str(truncated) in caplog.text


def test_skipping_fails_clearly_when_nothing_is_readable(tmp_path: Path) -> None:
    root = small_tree(tmp_path, {"cat": 2}, {})
    for path in (root / "train" / "cat").iterdir():
        path.write_bytes(b"garbage")
    dataset = CheckedImageFolder(root / "train", skip_unreadable=True)
    with pytest.raises(ImageFolderError, match="no readable image"):
        dataset[0]
    assert dataset.num_skipped == 2


#: reads the first image of the folder ``argv[1]`` and prints what it raised, as JSON
_READ_FIRST_IMAGE = """
import json, sys
from recipes.imagenet.dataset import CheckedImageFolder, UnreadableImageError
try:
    CheckedImageFolder(sys.argv[1])[0]
    print("RESULT " + json.dumps(None))
except UnreadableImageError as e:
    print("RESULT " + json.dumps({"type": type(e).__name__, "path": e.path, "message": str(e)}))
"""


def unprivileged_prefix() -> list[str]:
    """The command prefix that makes file permissions bind: none for a user other than root;
    for root, ``setpriv`` with every capability dropped (CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH are what let root read a file of mode 0). Root keeps its uid, so it
    still reads the interpreter and the repository (here under ``/root``, mode 0700, which no
    other user can enter); a file of mode 0 is then unreadable to it as to anyone."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux): cannot drop the "
                    "capabilities that bypass file permissions")
    return [setpriv, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]


@pytest.mark.multiprocess
def test_unreadable_permission_denied_is_reported(tmp_path: Path) -> None:
    """A file the reader may not open (mode 0) fails with :class:`UnreadableImageError` naming
    it and the ``PermissionError``; read by a process without privileges (as root: without
    capabilities, see :func:`unprivileged_prefix`)."""
    from testbed.launch import ROOT, base_env

    root = small_tree(tmp_path, {"cat": 2}, {})
    locked = root / "train" / "cat" / "0.png"
    locked.chmod(0)
    try:
        cmd = [*unprivileged_prefix(), sys.executable, "-c", _READ_FIRST_IMAGE,
               str(root / "train")]
        done = subprocess.run(cmd, cwd=ROOT, env=base_env(), capture_output=True, text=True,
                              timeout=300)
    finally:
        locked.chmod(0o644)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result is not None, "the locked image was read: file permissions did not bind"
    assert result["type"] == "UnreadableImageError" and result["path"] == str(locked)
    assert str(locked) in result["message"] and "PermissionError" in result["message"], result
