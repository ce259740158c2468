"""openai-whisper's or faster-whisper's long-form `transcribe`, with the windows it decoded: the
references of scripts/longform_check.py. It runs in an environment of its own (torch and
openai-whisper, or faster-whisper), so it imports nothing of this project:

    PYTHON scripts/longform_reference.py openai-whisper MODEL.pt AUDIO.npz RUNS.json
    PYTHON scripts/longform_reference.py faster-whisper CT2_DIR AUDIO.npz RUNS.json

AUDIO.npz: each recording's 16 kHz samples (arr_0, arr_1, ...), given as arrays (faster-whisper
1.2.1 opens no file with PyAV 19). Each is transcribed with the package's defaults for
long-form (greedy first, the fallback schedule, the previous text as a prompt), in English,
fp32 on the CPU. RUNS.json: for each recording, its text, segments [[start, end, text], ...],
the wall time, and each window decoded: its first frame, its frames of audio, and the try that
was kept (temperature, tokens, no-speech probability, average log-probability); openai-whisper
also gives every try, [[temperature, tokens], ...].
"""

import json
import sys
import time
from types import SimpleNamespace

import numpy as np


def openai_whisper(model_path: str):
    import torch
    import whisper

    module = sys.modules["whisper.transcribe"]
    model = whisper.load_model(model_path, device="cpu")
    windows = []  # each: where it starts, its frames of audio, its last try (the one kept)
    pad_or_trim = module.pad_or_trim

    def cut(segment, *args, **kwargs):
        # `transcribe` takes each window's frames as a view of the whole spectrogram (its
        # offset is the window's first frame) and pads them with this before its tries
        if isinstance(segment, torch.Tensor) and segment.dim() == 2:
            windows.append({"seek": segment.storage_offset(), "size": segment.shape[-1]})
        return pad_or_trim(segment, *args, **kwargs)

    decode = model.decode

    def decoded(mel, options):
        result = decode(mel, options)
        windows[-1]["kept"] = result
        windows[-1].setdefault("tries", []).append([options.temperature, list(result.tokens)])
        return result

    module.pad_or_trim, model.decode = cut, decoded

    def run(audio):
        windows.clear()
        result = module.transcribe(model, audio, language="en", fp16=False)
        segments = [[s["start"], s["end"], s["text"]] for s in result["segments"]]
        return result["text"], segments, [log(w.pop("kept"), **w) for w in windows]

    return run


def faster_whisper(model_dir: str):
    import faster_whisper.transcribe as module
    from faster_whisper import WhisperModel

    model = WhisperModel(model_dir, device="cpu", compute_type="float32")
    windows = []
    pad_or_trim = module.pad_or_trim

    def cut(segment, *args, **kwargs):
        # as openai-whisper's: a view of the whole spectrogram, its offset the first frame
        if segment.ndim == 2 and segment.base is not None:
            seek = (segment.ctypes.data - segment.base.ctypes.data) // segment.itemsize
            windows.append({"seek": int(seek), "size": segment.shape[-1]})
        return pad_or_trim(segment, *args, **kwargs)

    generate = model.generate_with_fallback

    def decoded(encoder_output, prompt, tokenizer, options):
        out = generate(encoder_output, prompt, tokenizer, options)
        result, avg_logprob, temperature, _ = out
        windows[-1]["kept"] = SimpleNamespace(
            temperature=temperature,
            tokens=result.sequences_ids[0],
            no_speech_prob=result.no_speech_prob,
            avg_logprob=avg_logprob,
        )
        return out

    module.pad_or_trim, model.generate_with_fallback = cut, decoded

    def run(audio):
        windows.clear()
        segments, _ = model.transcribe(audio, language="en", beam_size=1)
        segments = list(segments)
        text = "".join(s.text for s in segments)
        runs = [log(w.pop("kept"), **w) for w in windows]
        return text, [[s.start, s.end, s.text] for s in segments], runs

    return run


def log(kept, seek: int, size: int, tries: list | None = None) -> dict:
    return {
        "seek": seek,
        "size": size,
        "temperature": kept.temperature,
        "tokens": list(kept.tokens),
        "no_speech_prob": kept.no_speech_prob,
        "avg_logprob": kept.avg_logprob,
        "tries": tries,
    }


def main() -> None:
    system, model, audio_path, out_path = sys.argv[1:5]
    run = {"openai-whisper": openai_whisper, "faster-whisper": faster_whisper}[system](model)
    audio = np.load(audio_path)
    runs = []
    for i in range(len(audio.files)):
        start = time.perf_counter()
        text, segments, windows = run(audio[f"arr_{i}"])
        runs.append(
            {
                "text": text,
                "segments": segments,
                "windows": windows,
                "seconds": time.perf_counter() - start,
            }
        )
        print(f"{system}: recording {i + 1} of {len(audio.files)}", file=sys.stderr, flush=True)
    with open(out_path, "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main()
