"""``python -m recipes.asr``: the recipe's LightningCLI."""

from recipes.asr.cli import main

if __name__ == "__main__":
    main()
