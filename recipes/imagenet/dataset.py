"""ImageFolder with clear errors for bad layouts and a policy for unreadable images."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

log = logging.getLogger(__name__)

#: Errors PIL raises for missing, truncated or corrupt files (UnidentifiedImageError is an
#: OSError; some broken PNG chunks raise SyntaxError or ValueError).
IMAGE_READ_ERRORS = (OSError, SyntaxError, ValueError)


class ImageFolderError(ValueError):
    """The directory tree is not a usable ImageFolder (missing, empty or mismatched classes)."""


class UnreadableImageError(OSError):
    """An image file could not be decoded; the message and ``path`` name the file.

    Constructible from the message alone, so the DataLoader can re-raise it with its own type
    when it happened in a worker process (``path`` is then ``None``; the message has it).
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    @classmethod
    def from_cause(cls, path: str, cause: BaseException) -> UnreadableImageError:
        """The error for ``path`` that failed with ``cause``."""
        return cls(f"cannot read image {path}: {type(cause).__name__}: {cause}", path)


class CheckedImageFolder(ImageFolder):
    """``torchvision.datasets.ImageFolder`` that fails clearly on bad input.

    * A missing root, a root without class folders, or a class folder without images raises
      :class:`ImageFolderError` naming the directories.
    * An image that cannot be read raises :class:`UnreadableImageError` with its path, unless
      ``skip_unreadable`` is set: then the file is logged (path and running count) and the next
      readable image of the folder is returned in its place, so batches keep their size.
      ``num_skipped`` counts the files skipped by this copy of the dataset (each data-loading
      worker process has its own copy).

    Args:
        root: directory with one sub-directory of images per class.
        transform: applied to the RGB PIL image.
        skip_unreadable: skip unreadable images instead of failing.
    """

    def __init__(
        self,
        root: str | Path,
        transform: Callable[[Any], Any] | None = None,
        skip_unreadable: bool = False,
    ) -> None:
        root = Path(root)
        if not root.is_dir():
            raise ImageFolderError(f"image folder {root} does not exist or is not a directory")
        super().__init__(root, transform=transform, allow_empty=True)
        self.skip_unreadable = skip_unreadable
        self.num_skipped = 0
        per_class = Counter(target for _, target in self.samples)
        empty = [root / c for c in self.classes if per_class[self.class_to_idx[c]] == 0]
        if empty:
            shown = ", ".join(str(p) for p in empty[:10]) + (" ..." if len(empty) > 10 else "")
            raise ImageFolderError(
                f"{len(empty)} class folder(s) contain no images with extensions "
                f"{'/'.join(IMG_EXTENSIONS)}: {shown}"
            )

    def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
        """Class folders of ``directory``, sorted; :class:`ImageFolderError` if there are none."""
        classes = sorted(e.name for e in Path(directory).iterdir() if e.is_dir())
        if not classes:
            raise ImageFolderError(
                f"no class folders in {directory}: expected one sub-directory of images per class"
            )
        return classes, {name: i for i, name in enumerate(classes)}

    def _read(self, index: int) -> tuple[Any, int]:
        path, target = self.samples[index]
        try:
            image = self.loader(path)
        except IMAGE_READ_ERRORS as err:
            raise UnreadableImageError.from_cause(path, err) from err
        return image, target

    def __getitem__(self, index: int) -> tuple[Any, int]:
        """Return ``(transformed image, class index)``; see the class docstring for bad files."""
        for attempt in range(len(self.samples)):
            try:
                image, target = self._read((index + attempt) % len(self.samples))
                break
            except UnreadableImageError as err:
                if not self.skip_unreadable:
                    raise
                self.num_skipped += 1
                log.warning("%s; using the next image instead (%d unreadable image(s) skipped "
                            "so far by this process)", err, self.num_skipped)
        else:
            raise ImageFolderError(f"no readable image in {self.root}")
        if self.transform is not None:
            image = self.transform(image)
        return image, target
