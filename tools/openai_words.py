"""openai-whisper's own word timestamps, the reference of scripts/word_timestamps_check.py
--openai-python. It runs in an environment of its own (torch, numpy and openai-whisper, not this
project), so it imports nothing else:

    OPENAI_PYTHON tools/openai_words.py MODEL.pt HEADS CLIPS.npz WORDS.json

MODEL.pt: the project's weights in openai-whisper's layout (`word_timing.openai_checkpoint`);
HEADS: the alignment heads the engine uses, as JSON [[layer, head], ...]; CLIPS.npz: each
clip's 16 kHz samples as the project decoded them (arr_0, arr_1, ...). Writes JSON: for each
way below, each clip's words, [[word, start s, end s], ...].

"transcribe": each clip through `transcribe` as a user calls it: greedy, fp32, the language as
the engine's `word_timing.OPTIONS` leave it (English for an English-only model), with segment
timestamps as the engine decodes them (`without_timestamps=True` gives a window one segment,
then decodes again from its last word, adding words the engine does not have), without the
previous text as a prompt (which matters only for such a second window). `transcribe` pads a
clip shorter than its window with zeros in the log-mel spectrogram, where transformers and
the engine pad the samples (silence, in the spectrogram): close tokens can differ (a comma, a
full stop, a capital), and such clips' words do not pair up.

"same input": openai-whisper's timing alone (`whisper.timing.add_word_timestamps`) on the
engine's input: the samples padded to 30 s before the spectrogram, as the engine does (then
`transcribe`'s tokens are the engine's, token for token), and the clip's own frames as the
content, as the engine times them.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def load(checkpoint: Path, heads: list[list[int]]):
    """The model, with these alignment heads (openai's own models set theirs from a packed
    dump, `set_alignment_heads`, into the same sparse mask of decoder layers x heads)."""
    import whisper

    model = whisper.load_model(str(checkpoint), device="cpu")
    mask = torch.zeros(model.dims.n_text_layer, model.dims.n_text_head, dtype=torch.bool)
    for layer, head in heads:
        mask[layer, head] = True
    model.register_buffer("alignment_heads", mask.to_sparse(), persistent=False)
    return model


def transcribed(model, audio: np.ndarray) -> list[list]:
    """A clip's timed words from `transcribe`, in order."""
    result = model.transcribe(
        audio, word_timestamps=True, temperature=0.0, condition_on_previous_text=False, fp16=False
    )
    return [[w["word"], w["start"], w["end"]] for s in result["segments"] for w in s["words"]]


def same_input(model, audio: np.ndarray) -> list[list]:
    """A clip's timed words from openai-whisper's timing on the engine's input: its window's
    segments (times from their timestamp tokens), its spectrogram of the padded samples."""
    import whisper
    from whisper.audio import HOP_LENGTH, N_SAMPLES
    from whisper.timing import add_word_timestamps
    from whisper.tokenizer import get_tokenizer

    padded = np.pad(audio, (0, max(0, N_SAMPLES - len(audio))))
    result = model.transcribe(padded, temperature=0.0, condition_on_previous_text=False, fp16=False)
    tokenizer = get_tokenizer(
        model.is_multilingual, num_languages=model.num_languages, language=result["language"]
    )
    first = tokenizer.timestamp_begin
    segments = [s for s in result["segments"] if s["seek"] == 0]  # the first window's
    for s in segments:
        stamps = [t for t in s["tokens"] if t >= first]
        s["start"], s["end"] = (stamps[0] - first) * 0.02, (stamps[-1] - first) * 0.02
    add_word_timestamps(
        segments=segments,
        model=model,
        tokenizer=tokenizer,
        mel=whisper.log_mel_spectrogram(padded, model.dims.n_mels),
        num_frames=len(audio) // HOP_LENGTH,
        last_speech_timestamp=0.0,
    )
    return [[w["word"], w["start"], w["end"]] for s in segments for w in s["words"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("heads", type=json.loads)
    parser.add_argument("clips", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    model = load(args.checkpoint, args.heads)
    clips = np.load(args.clips)
    audio = [clips[f"arr_{i}"] for i in range(len(clips.files))]
    ways = {"transcribe": transcribed, "same input": same_input}
    answers = {way: [words(model, a) for a in audio] for way, words in ways.items()}
    args.out.write_text(json.dumps(answers))


if __name__ == "__main__":
    main()
