"""Export scikit-learn's bundled handwritten digits as an ImageFolder tree of PNG files.

The digits set (1,797 real 8x8 scans with 17 grey levels, shipped inside scikit-learn, no
download) is written in the standard ImageNet layout, so the recipe's ImageFolder code path is
exercised end to end on this machine::

    OUT/train/<class>/<index>.png
    OUT/val/<class>/<index>.png

The train/val split is fixed (stratified by class, seeded), so every export is identical.

Usage::

    python -m recipes.imagenet.prepare_digits --out data/digits
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

#: Number of validation images (20% of 1,797, rounded so it divides evenly over 2, 4 or 8 ranks).
NUM_VAL_IMAGES = 360
#: Seed of the fixed stratified split.
SPLIT_SEED = 0
#: Class folder names: the digit itself.
CLASS_NAMES = tuple(str(d) for d in range(10))


def digits_split() -> dict[str, list[tuple[int, np.ndarray, int]]]:
    """Return ``{"train": [...], "val": [...]}`` of ``(index, 8x8 uint8 image, label)``.

    Pixel values 0..16 of the original scans are scaled to 0..255 (16 -> 255).
    """
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    indices = np.arange(len(images))
    train_idx, val_idx = train_test_split(
        indices, test_size=NUM_VAL_IMAGES, stratify=digits.target, random_state=SPLIT_SEED
    )
    return {
        split: [(int(i), images[i], int(digits.target[i])) for i in sorted(idx)]
        for split, idx in (("train", train_idx), ("val", val_idx))
    }


def export_digits(out: str | Path) -> dict[str, int]:
    """Write the digits ImageFolder tree under ``out``; return the image count per split.

    Existing files with the same names are overwritten, so re-running is safe.
    """
    out = Path(out)
    counts = {}
    for split, samples in digits_split().items():
        for name in CLASS_NAMES:
            (out / split / name).mkdir(parents=True, exist_ok=True)
        for index, image, label in samples:
            Image.fromarray(image).save(out / split / CLASS_NAMES[label] / f"{index:04d}.png")
        counts[split] = len(samples)
    return counts


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to create the tree in")
    args = parser.parse_args(argv)
    counts = export_digits(args.out)
    print(f"wrote {counts['train']} train and {counts['val']} val images to {args.out}")


if __name__ == "__main__":
    main()
