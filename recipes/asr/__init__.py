"""ASR recipe: BLSTM acoustic model on Kaldi data directories, WER, synthetic espeak-ng corpus.

Model, data and CLI code only; it contains no gossip logic and runs under any strategy.
"""

from recipes.asr.datamodule import KaldiDataModule
from recipes.asr.model import BLSTMAcousticModel
from recipes.asr.recognizer import SpeechRecognizer

__all__ = ["BLSTMAcousticModel", "KaldiDataModule", "SpeechRecognizer"]
