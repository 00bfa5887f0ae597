"""Read Kaldi data directories (``wav.scp``, ``text``; ``segments``/``utt2spk``/``utt2dur``).

Every problem with the input is reported with the file and line it comes from. Problems that
make the whole directory suspect (a missing audio file, a transcript for an unknown utterance,
a pipe command that was not enabled, a wrong sample rate, a malformed line) raise
:class:`DataDirError`. Problems that concern one utterance only and are common in real
corpora (no transcript, an empty transcript, unreadable audio) skip that utterance, are
counted in :class:`LoadReport` and summarized in one warning.
"""

from __future__ import annotations

import io
import subprocess
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf


class DataDirError(ValueError):
    """Bad input in a Kaldi data directory; the message names the file and line."""


@dataclass(frozen=True)
class Location:
    """Where a record came from, for error messages."""

    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Utterance:
    """One utterance: where its audio is and what was said."""

    utt_id: str
    recording: str
    """``wav.scp`` entry: a path or, if it ends with ``|``, a shell command writing a wav."""
    recording_location: Location
    text: str
    speaker: str
    start: float = 0.0
    """Start time in seconds within the recording (``segments``)."""
    end: float | None = None
    """End time in seconds (``segments``); ``None`` means the end of the recording."""
    num_samples: int | None = None
    """Length in samples at the expected sample rate, if known without reading the audio."""

    @property
    def is_pipe(self) -> bool:
        return is_pipe_command(self.recording)


@dataclass
class LoadReport:
    """What :func:`load_data_dir` skipped, by reason, with a few example locations."""

    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: Location | str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < 3:
            self.examples[reason].append(str(where))

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        return "; ".join(f"{n} {reason} (e.g. {', '.join(self.examples[reason])})"
                         for reason, n in sorted(self.skipped.items()))


def is_pipe_command(entry: str) -> bool:
    """Kaldi's extended filename for "run this command and read its stdout"."""
    return entry.rstrip().endswith("|")


def read_table(path: Path, *, min_fields: int = 2, allow_empty_value: bool = False,
               ) -> Iterator[tuple[Location, str, str]]:
    """Yield ``(location, key, rest-of-line)`` for each non-blank line of a Kaldi table.

    Raises :class:`DataDirError` on lines with too few fields and on duplicate keys.
    """
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line:
                continue
            parts = line.split(maxsplit=1)
            where = Location(path, lineno)
            key, rest = parts[0], parts[1] if len(parts) > 1 else ""
            if len(line.split()) < min_fields and not (allow_empty_value and len(parts) == 1):
                raise DataDirError(f"{where}: expected at least {min_fields} fields, got {line!r}")
            if key in seen:
                raise DataDirError(f"{where}: duplicate key {key!r} (first on line {seen[key]})")
            seen[key] = lineno
            yield where, key, rest


def read_audio(entry: str, *, allow_pipes: bool) -> tuple[np.ndarray, int]:
    """Read a ``wav.scp`` entry as float32 samples in [-1, 1] (first channel) and its rate."""
    if is_pipe_command(entry):
        if not allow_pipes:
            raise DataDirError(f"pipe command not enabled: {entry!r}")
        proc = subprocess.run(entry.rstrip()[:-1], shell=True, capture_output=True, check=False)
        if proc.returncode != 0:
            raise OSError(f"command exited with {proc.returncode}: "
                          f"{proc.stderr.decode(errors='replace')[-500:]}")
        source: str | io.BytesIO = io.BytesIO(proc.stdout)
    else:
        source = entry
    data, rate = sf.read(source, dtype="float32", always_2d=True)
    return data[:, 0], rate


def load_data_dir(path: str | Path, *, sample_rate: int = 16000, allow_pipes: bool = False,
                  require_text: bool = True, probe_audio: bool = True, warn: bool = True,
                  ) -> tuple[list[Utterance], LoadReport]:
    """Parse a Kaldi data directory into utterances sorted by id.

    Args:
        path: the directory.
        sample_rate: every recording must have this rate.
        allow_pipes: run ``wav.scp`` entries that are shell commands (``... |``). Off by
            default: a data directory should not run arbitrary commands unless asked to.
        require_text: utterances without a (non-empty) transcript are skipped; with ``False``
            (prediction) they are kept with an empty text and ``text`` may be absent.
        probe_audio: open every audio file's header to check it is readable, check its sample
            rate and learn its length (needed for length bucketing). Pipe entries are not
            probed; give their lengths in ``segments`` or ``utt2dur``.
        warn: emit one warning summarizing skipped utterances.
    """
    root = Path(path)
    if not root.is_dir():
        raise DataDirError(f"{root}: not a directory")
    wav_scp = root / "wav.scp"
    if not wav_scp.is_file():
        raise DataDirError(f"{wav_scp}: missing (every Kaldi data directory needs one)")
    report = LoadReport()

    recordings: dict[str, tuple[str, Location]] = {}
    for where, key, rest in read_table(wav_scp):
        if is_pipe_command(rest):
            if not allow_pipes:
                raise DataDirError(f"{where}: {key} is a pipe command ({rest!r}); enable pipe "
                                   "commands explicitly (allow_pipes=True) to run it")
        elif not Path(rest).is_file():
            raise DataDirError(f"{where}: audio file of {key} not found: {rest}")
        recordings[key] = (rest, where)

    # utterance id -> (recording id, start, end)
    spans: dict[str, tuple[str, float, float | None]] = {}
    segments = root / "segments"
    if segments.is_file():
        for where, key, rest in read_table(segments, min_fields=4):
            fields = rest.split()
            if len(fields) != 3:
                raise DataDirError(f"{where}: expected 'utt-id recording-id start end'")
            rec = fields[0]
            if rec not in recordings:
                raise DataDirError(f"{where}: unknown recording id {rec!r} (not in {wav_scp})")
            try:
                start, end = float(fields[1]), float(fields[2])
            except ValueError:
                raise DataDirError(f"{where}: start/end are not numbers: {rest!r}") from None
            if not 0 <= start < end:
                raise DataDirError(f"{where}: need 0 <= start < end, got {start} {end}")
            spans[key] = (rec, start, end)
    else:
        spans = {rec: (rec, 0.0, None) for rec in recordings}

    texts: dict[str, str] = {}
    empty_texts: set[str] = set()
    text_path = root / "text"
    if text_path.is_file():
        for where, key, rest in read_table(text_path, allow_empty_value=True):
            if key not in spans:
                source = segments if segments.is_file() else wav_scp
                raise DataDirError(f"{where}: unknown utterance id {key!r} (not in {source})")
            if not rest.strip() and require_text:
                report.skip("empty transcript", where)
                empty_texts.add(key)
                continue
            texts[key] = rest.strip()
    elif require_text:
        raise DataDirError(f"{text_path}: missing (transcripts are needed for training/scoring)")

    speakers: dict[str, str] = {}
    if (root / "utt2spk").is_file():
        for where, key, rest in read_table(root / "utt2spk"):
            if key not in spans:
                raise DataDirError(f"{where}: unknown utterance id {key!r}")
            speakers[key] = rest.split()[0]

    durations: dict[str, float] = {}
    if (root / "utt2dur").is_file():
        for where, key, rest in read_table(root / "utt2dur"):
            try:
                durations[key] = float(rest.split()[0])
            except ValueError:
                raise DataDirError(f"{where}: duration is not a number: {rest!r}") from None

    recording_samples: dict[str, int] = {}
    utterances: list[Utterance] = []
    for utt_id in sorted(spans):
        rec, start, end = spans[utt_id]
        entry, rec_where = recordings[rec]
        if utt_id not in texts and require_text:
            if utt_id not in empty_texts:  # those were counted already
                report.skip("no transcript", f"{rec_where} ({utt_id})")
            continue
        num_samples: int | None = None
        if end is not None:
            num_samples = int(round((end - start) * sample_rate))
        elif utt_id in durations:
            num_samples = int(round(durations[utt_id] * sample_rate))
        if probe_audio and not is_pipe_command(entry):
            if rec not in recording_samples:
                try:
                    info = sf.info(entry)
                except (RuntimeError, sf.LibsndfileError) as e:
                    report.skip("unreadable audio", f"{rec_where} ({e})")
                    recording_samples[rec] = -1
                    continue
                if info.samplerate != sample_rate:
                    raise DataDirError(f"{rec_where}: {entry} has sample rate {info.samplerate} "
                                       f"Hz, expected {sample_rate} Hz")
                recording_samples[rec] = info.frames
            if recording_samples[rec] < 0:
                report.skip("unreadable audio", rec_where)
                continue
            if num_samples is None:
                num_samples = recording_samples[rec]
        utterances.append(Utterance(
            utt_id=utt_id, recording=entry, recording_location=rec_where,
            text=texts.get(utt_id, ""), speaker=speakers.get(utt_id, utt_id),
            start=start, end=end, num_samples=num_samples))
    if warn and report.num_skipped:
        warnings.warn(f"{root}: skipped {report.num_skipped} utterance(s): {report.summary()}",
                      stacklevel=2)
    return utterances, report


def read_alignments(path: str | Path) -> dict[str, np.ndarray]:
    """Read Kaldi text alignments, one utterance per line: ``utt-id pdf pdf pdf ...``.

    This is the output of ``ali-to-pdf ... ark,t:-``: one senone (pdf) id per 10 ms frame.
    """
    path = Path(path)
    if not path.is_file():
        raise DataDirError(f"{path}: alignment file not found")
    alignments: dict[str, np.ndarray] = {}
    for where, key, rest in read_table(path):
        try:
            pdfs = np.array([int(tok) for tok in rest.split()], dtype=np.int64)
        except ValueError:
            raise DataDirError(f"{where}: pdf ids must be integers") from None
        if (pdfs < 0).any():
            raise DataDirError(f"{where}: negative pdf id")
        alignments[key] = pdfs
    return alignments
