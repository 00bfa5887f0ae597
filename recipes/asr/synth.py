"""Synthetic speech corpus: spoken command sentences made with espeak-ng, as Kaldi data dirs.

``python -m recipes.asr.synth --out DIR --seed S`` writes::

    DIR/wav/<utt-id>.wav                  16 kHz mono 16-bit PCM
    DIR/{train,dev,test}/wav.scp          utt-id -> absolute wav path
    DIR/{train,dev,test}/text             utt-id -> transcript (lower case)
    DIR/{train,dev,test}/utt2spk, spk2utt speaker = accent + voice variant
    DIR/corpus.json                       the generation settings (used as the cache key)

Sentences come from a small command grammar (a few dozen words). A *voice* is an espeak-ng
accent combined with a voice variant (``en-gb-scotland+m3``); every utterance also draws its
own speaking rate, pitch, loudness, word gap, leading/trailing silence and a little white
noise. The dev and test splits use voice variants that never occur in training, so their
speakers are unseen voices. The same seed and settings give byte-identical corpora.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF
from tqdm import tqdm

SAMPLE_RATE = 16000

ACCENTS: tuple[str, ...] = (
    "en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd",
    "en-029", "en-us-nyc",
)
TRAIN_VARIANTS: tuple[str, ...] = (
    "m1", "m2", "m4", "m5", "m7", "m8", "f1", "f3", "f5", "klatt", "klatt2", "klatt3",
)
DEV_VARIANTS: tuple[str, ...] = ("m6", "f4")
TEST_VARIANTS: tuple[str, ...] = ("m3", "f2")

_COLORS = ("red", "green", "blue", "yellow", "black", "white")
_OBJECTS = ("box", "ball", "cup", "book", "lamp", "chair", "key", "phone")
_PLACES = ("table", "bed", "door", "window", "shelf", "desk")
_PREPOSITIONS = ("on", "under", "behind", "near")
_VERBS = ("put", "move", "place", "drop")
_ROOMS = ("kitchen", "bedroom", "garage", "office", "hall")
_DEVICES = ("light", "fan", "heater", "radio")
_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "twenty", "thirty")
_NAMES = ("anna", "david", "maria", "peter", "susan", "john")


def random_sentence(rng: random.Random) -> str:
    """Draw one sentence from the command grammar."""
    kind = rng.randrange(4)
    if kind == 0:
        return (f"{rng.choice(_VERBS)} the {rng.choice(_COLORS)} {rng.choice(_OBJECTS)} "
                f"{rng.choice(_PREPOSITIONS)} the {rng.choice(_PLACES)}")
    if kind == 1:
        return f"turn {rng.choice(('on', 'off'))} the {rng.choice(_ROOMS)} {rng.choice(_DEVICES)}"
    if kind == 2:
        return f"set the {rng.choice(_ROOMS)} timer to {rng.choice(_NUMBERS)} minutes"
    return f"call {rng.choice(_NAMES)} at {rng.choice(_NUMBERS[:10])} o'clock"


def grammar_vocabulary() -> list[str]:
    """Every word the grammar can produce, sorted."""
    words = {"the", "turn", "on", "off", "set", "timer", "to", "minutes", "call", "at", "o'clock"}
    for group in (_COLORS, _OBJECTS, _PLACES, _PREPOSITIONS, _VERBS, _ROOMS, _DEVICES, _NUMBERS,
                  _NAMES):
        words.update(group)
    return sorted(words)


@dataclass(frozen=True)
class UtteranceSpec:
    """Everything needed to render one utterance deterministically."""

    utt_id: str
    split: str
    speaker: str
    voice: str
    text: str
    rate: int
    pitch: int
    amplitude: int
    word_gap: int
    lead_silence: float
    tail_silence: float
    snr_db: float
    noise_seed: int


@dataclass(frozen=True)
class CorpusConfig:
    """Settings that define a corpus; written to ``corpus.json`` and used as the cache key."""

    seed: int = 0
    num_train: int = 2400
    num_dev: int = 200
    num_test: int = 300
    min_rate: int = 130
    max_rate: int = 200
    min_snr_db: float = 25.0
    max_snr_db: float = 45.0
    version: int = 1


def plan_corpus(config: CorpusConfig) -> list[UtteranceSpec]:
    """Draw every utterance's sentence, voice and rendering parameters from ``config.seed``."""
    rng = random.Random(config.seed)
    specs: list[UtteranceSpec] = []
    for split, count, variants in (("train", config.num_train, TRAIN_VARIANTS),
                                   ("dev", config.num_dev, DEV_VARIANTS),
                                   ("test", config.num_test, TEST_VARIANTS)):
        for index in range(count):
            accent = rng.choice(ACCENTS)
            variant = rng.choice(variants)
            speaker = f"{accent}_{variant}"
            specs.append(UtteranceSpec(
                utt_id=f"{speaker}-{split}{index:05d}",
                split=split,
                speaker=speaker,
                voice=f"{accent}+{variant}",
                text=random_sentence(rng),
                rate=rng.randint(config.min_rate, config.max_rate),
                pitch=rng.randint(20, 80),
                amplitude=rng.randint(60, 160),
                word_gap=rng.randint(0, 3),
                lead_silence=rng.uniform(0.05, 0.3),
                tail_silence=rng.uniform(0.05, 0.3),
                snr_db=rng.uniform(config.min_snr_db, config.max_snr_db),
                noise_seed=rng.randrange(2**31),
            ))
    return specs


def render(spec: UtteranceSpec, espeak: str = "espeak-ng") -> np.ndarray:
    """Synthesize ``spec`` with espeak-ng; return 16 kHz int16 samples."""
    cmd = [espeak, "-v", spec.voice, "-s", str(spec.rate), "-p", str(spec.pitch),
           "-a", str(spec.amplitude), "-g", str(spec.word_gap), "--stdout", spec.text]
    proc = subprocess.run(cmd, capture_output=True, check=False)
    if proc.returncode != 0 or not proc.stdout:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.decode(errors='replace')}")
    audio, rate = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    wave = AF.resample(torch.from_numpy(audio), rate, SAMPLE_RATE).numpy()
    wave = np.concatenate([np.zeros(int(spec.lead_silence * SAMPLE_RATE), np.float32), wave,
                           np.zeros(int(spec.tail_silence * SAMPLE_RATE), np.float32)])
    power = float(np.mean(wave**2)) + 1e-12
    noise = np.random.default_rng(spec.noise_seed).standard_normal(len(wave)).astype(np.float32)
    wave = wave + noise * np.sqrt(power / 10 ** (spec.snr_db / 10))
    return (np.clip(wave, -1.0, 1.0) * 32767).astype(np.int16)


def _write_split(out: Path, split: str, specs: Sequence[UtteranceSpec], wav_dir: Path) -> None:
    split_dir = out / split
    split_dir.mkdir(parents=True, exist_ok=True)
    rows = sorted((s for s in specs if s.split == split), key=lambda s: s.utt_id)
    (split_dir / "wav.scp").write_text(
        "".join(f"{s.utt_id} {(wav_dir / (s.utt_id + '.wav')).resolve()}\n" for s in rows))
    (split_dir / "text").write_text("".join(f"{s.utt_id} {s.text}\n" for s in rows))
    (split_dir / "utt2spk").write_text("".join(f"{s.utt_id} {s.speaker}\n" for s in rows))
    spk2utt: dict[str, list[str]] = {}
    for s in rows:
        spk2utt.setdefault(s.speaker, []).append(s.utt_id)
    (split_dir / "spk2utt").write_text(
        "".join(f"{spk} {' '.join(utts)}\n" for spk, utts in sorted(spk2utt.items())))


def is_complete(out: str | Path, config: CorpusConfig) -> bool:
    """True when ``out`` already holds the corpus that ``config`` describes."""
    meta = Path(out) / "corpus.json"
    try:
        return json.loads(meta.read_text()) == asdict(config)
    except (OSError, ValueError):
        return False


def generate_corpus(out: str | Path, config: CorpusConfig, *, jobs: int = 2,
                    progress: bool = True, espeak: str = "espeak-ng") -> Path:
    """Write the corpus described by ``config`` under ``out``; reuse it if already complete."""
    out = Path(out)
    if is_complete(out, config):
        return out
    if shutil.which(espeak) is None:
        raise FileNotFoundError(f"{espeak} not found; install the Debian package espeak-ng")
    (out / "corpus.json").unlink(missing_ok=True)
    wav_dir = out / "wav"
    wav_dir.mkdir(parents=True, exist_ok=True)
    specs = plan_corpus(config)

    def make(spec: UtteranceSpec) -> None:
        sf.write(wav_dir / f"{spec.utt_id}.wav", render(spec, espeak), SAMPLE_RATE,
                 subtype="PCM_16")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for _ in tqdm(pool.map(make, specs), total=len(specs), desc="synthesizing",
                      unit="utt", disable=not progress, file=sys.stdout):
            pass
    for split in ("train", "dev", "test"):
        _write_split(out, split, specs, wav_dir)
    (out / "corpus.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    defaults = CorpusConfig()
    parser = argparse.ArgumentParser(prog="python -m recipes.asr.synth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--num-train", type=int, default=defaults.num_train)
    parser.add_argument("--num-dev", type=int, default=defaults.num_dev)
    parser.add_argument("--num-test", type=int, default=defaults.num_test)
    parser.add_argument("--min-rate", type=int, default=defaults.min_rate,
                        help="slowest speaking rate (words per minute)")
    parser.add_argument("--max-rate", type=int, default=defaults.max_rate)
    parser.add_argument("--jobs", type=int, default=2, help="parallel espeak-ng processes")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    config = CorpusConfig(seed=args.seed, num_train=args.num_train, num_dev=args.num_dev,
                          num_test=args.num_test, min_rate=args.min_rate, max_rate=args.max_rate)
    out = generate_corpus(args.out, config, jobs=args.jobs, progress=not args.no_progress)
    print(f"corpus ready: {out}/{{train,dev,test}} ({len(grammar_vocabulary())} words)")


if __name__ == "__main__":
    main()
