"""openai-whisper's own word timestamps, the reference of scripts/word_timestamps_check.py
--openai-python. It runs in an environment of its own (torch, numpy and openai-whisper, not this
project), so it imports nothing else:

    OPENAI_PYTHON engine/tools/openai_words.py MODEL.pt HEADS CLIPS.npz WORDS.json

MODEL.pt: the project's weights in openai-whisper's layout (`word_timing.openai_checkpoint`);
HEADS: the alignment heads the engine uses, as JSON [[layer, head], ...]; CLIPS.npz: each
clip's 16 kHz samples as the project decoded them (arr_0, arr_1, ...). Writes a JSON list: each
clip's words, [[word, start s, end s], ...].

Each clip goes through `transcribe` as a user calls it, greedily, in fp32, with segment
timestamps as the engine decodes them (`word_timing.OPTIONS`); without the previous text as a
prompt, which for a clip of one window only matters if it is decoded again from its last word.
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


def words(model, audio: np.ndarray) -> list[list]:
    """A clip's timed words, in order."""
    result = model.transcribe(
        audio,
        word_timestamps=True,
        temperature=0.0,
        condition_on_previous_text=False,
        fp16=False,
    )
    return [[w["word"], w["start"], w["end"]] for s in result["segments"] for w in s["words"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("heads", type=json.loads)
    parser.add_argument("clips", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    model = load(args.checkpoint, args.heads)
    clips = np.load(args.clips)
    answers = [words(model, clips[f"arr_{i}"]) for i in range(len(clips.files))]
    args.out.write_text(json.dumps(answers))


if __name__ == "__main__":
    main()
