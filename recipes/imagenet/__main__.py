"""``python -m recipes.imagenet {fit,validate} --config recipes/imagenet/configs/<name>.yaml``."""

from recipes.imagenet.cli import main

if __name__ == "__main__":
    main()
