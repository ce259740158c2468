"""Qwen3-ASR-shaped models with random weights, for the transformers backend's tests and
benchmarks, and the same weights in the layout of the reference implementation (the
`qwen-asr` package's own transformers code) for the check against it.

Qwen3-ASR's weights cannot be downloaded here; its shapes can be built (`SIZES`: the
released 0.6B and 1.7B, from their configuration, and a tiny one for tests), with a small
byte-level BPE tokenizer that holds the model's special tokens. A user with the real weights
converts them with transformers' own script (the `-hf` checkpoints) and names the directory
`hf:/path`; nothing here is needed then.

    python -m tools.qwen3_asr make DIR [--size tiny|0.6B|1.7B]
    python -m tools.qwen3_asr reference DIR OUT   # the reference's layout of DIR
    REFERENCE_PYTHON tools/qwen3_asr.py run-reference OUT CLIPS.npz ANSWERS.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (audio encoder, text decoder) of each size; the released ones as their configurations give
SIZES = {
    "tiny": (
        {"d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
         "downsample_hidden_size": 32},
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128},
    ),
    "0.6B": (
        {"d_model": 896, "encoder_layers": 18, "encoder_attention_heads": 14,
         "encoder_ffn_dim": 3584, "downsample_hidden_size": 480},
        {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072},
    ),
    "1.7B": (
        {"d_model": 1024, "encoder_layers": 24, "encoder_attention_heads": 16,
         "encoder_ffn_dim": 4096, "downsample_hidden_size": 480},
        {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144},
    ),
}  # fmt: skip

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>",
    "<|audio_pad|>",
]  # fmt: skip
# added but not special: the answer's markers stay in decoded text, where they are parsed
MARKERS = ["<asr_text>", "<timestamp>"]

# The prompt Qwen3-ASR was trained on: an empty system turn unless a context is given, the
# audio in the user turn, and the assistant turn, which a forced language prefills
# ("language English<asr_text>") and which is otherwise left open.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\n<|im_end|>\n{% endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{%- for c in m['content'] -%}"
    "{%- if c['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{%- elif c['type'] == 'text' %}{{ c['text'] }}{% endif -%}"
    "{%- endfor -%}{% endif -%}"
    "{%- if not (loop.last and m['role'] == 'assistant') %}<|im_end|>\n{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)

# Text for the tokenizer's merges: what the dev set speaks, in a few lines
CORPUS = [
    "And so, my fellow Americans, ask not what your country can do for you; ask what you can "
    "do for your country. The quick brown fox jumps over the lazy dog. 0123456789",
    "language English language Chinese language French language German language Japanese",
    "Le renard brun rapide saute par-dessus le chien paresseux. Der schnelle braune Fuchs.",
]


def tokenizer():
    """A byte-level BPE tokenizer of a few hundred tokens with Qwen3-ASR's special tokens,
    as `Qwen2TokenizerFast` (what Qwen3-ASR's processor loads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tok = Qwen2TokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        extra_special_tokens={
            "audio_token": "<|audio_pad|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    tok.add_tokens(MARKERS)
    return tok


def make(path: Path, size: str = "tiny", seed: int = 0) -> Path:
    """A Qwen3-ASR model of `size` with random weights (std 0.1, so that greedy decoding
    wanders rather than repeating the prompt's last token), saved with its processor."""
    import torch
    from transformers import (
        Qwen3ASRConfig,
        Qwen3ASRFeatureExtractor,
        Qwen3ASRForConditionalGeneration,
    )
    from transformers.models.qwen3_asr.processing_qwen3_asr import Qwen3ASRProcessor

    tok = tokenizer()
    audio, text = SIZES[size]
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS + MARKERS}
    config = Qwen3ASRConfig(
        audio_config={**audio, "num_mel_bins": 128, "output_dim": text["hidden_size"]},
        text_config={**text, "vocab_size": len(tok), "tie_word_embeddings": False,
                     "max_position_embeddings": 65536, "rope_theta": 1000000.0},
        audio_token_id=ids["<|audio_pad|>"],
        timestamp_token_id=ids["<timestamp>"],
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|endoftext|>"], ids["<|im_end|>"]],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(path)
    processor = Qwen3ASRProcessor(
        feature_extractor=Qwen3ASRFeatureExtractor(), tokenizer=tok, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(path)
    return path


def reference(native: Path, out: Path) -> Path:
    """The model at `native` in the reference's layout (the `qwen-asr` package's): its
    configuration under `thinker_config` (the text model's rotary sections as Qwen3-ASR
    ships them: with the same position on all three axes, as for audio, they are plain RoPE),
    its weights under `thinker.`, and Whisper's feature extractor, which its processor uses.
    Needs only json and safetensors: it runs beside either transformers."""
    from safetensors.torch import load_file, save_file

    config = json.loads((native / "config.json").read_text())
    audio, text = config["audio_config"], config["text_config"]
    half = text["head_dim"] // 2
    section = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]  # 64: 24, 20, 20
    rope_theta = (text.get("rope_parameters") or {}).get("rope_theta", text.get("rope_theta"))
    tokens = json.loads((native / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tokens}
    thinker = {
        "audio_config": {
            **{k: audio[k] for k in (
                "num_mel_bins", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
                "d_model", "activation_function", "n_window", "output_dim", "n_window_infer",
                "downsample_hidden_size", "scale_embedding",
            )},
            "max_source_positions": 1500,
            "conv_chunksize": 500,
        },
        "text_config": {
            **{k: text[k] for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                "max_position_embeddings", "rms_norm_eps",
            )},
            "rope_theta": rope_theta,
            "rope_scaling": {"rope_type": "default", "mrope_section": section,
                             "interleaved": True, "mrope_interleaved": True},
            "tie_word_embeddings": False,
            "attention_bias": False,
        },
        "audio_token_id": config["audio_token_id"],
        "audio_start_token_id": ids["<|audio_start|>"],
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "thinker_config": thinker,
        "tie_word_embeddings": False,
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }, indent=1))  # fmt: skip
    renamed = {}
    for key, tensor in load_file(native / "model.safetensors").items():
        key = key.replace("model.multi_modal_projector.linear_1", "model.audio_tower.proj1")
        key = key.replace("model.multi_modal_projector.linear_2", "model.audio_tower.proj2")
        key = key.replace("model.language_model.", "model.model.")
        renamed["thinker." + key.removeprefix("model.")] = tensor
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "generation_config.json", "chat_template.jinja"):
        (out / name).write_bytes((native / name).read_bytes())
    # transformers 4 names the audio tokens in `extra_special_tokens`, a mapping
    tokenizer = json.loads((native / "tokenizer_config.json").read_text())
    named = ("audio_token", "audio_bos_token", "audio_eos_token")
    tokenizer["extra_special_tokens"] = {k: tokenizer[k] for k in named}
    tokenizer.pop("backend", None)
    tokenizer["tokenizer_class"] = "Qwen2TokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=1))
    features = json.loads((native / "processor_config.json").read_text())["feature_extractor"]
    whisper = {k: v for k, v in features.items() if k in WHISPER_FEATURES}
    (out / "preprocessor_config.json").write_text(json.dumps({
        **whisper, "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "Qwen3ASRProcessor",
    }, indent=1))  # fmt: skip
    return out


def run_reference(path: Path, samples: Path, out: Path, batch: int, windows: bool) -> None:
    """In the reference's environment (`qwen-asr` and its transformers): each clip's
    generated ids, language and text, as `Qwen3ASRModel.transcribe` makes them (its prompt,
    its processor, its `generate`, in batches of `batch`). windows: give its audio attention
    the windows it otherwise only hands to FlashAttention-2 (without it, on the CPU, every
    position of a clip attends to every other)."""
    import numpy as np
    import torch
    from qwen_asr import Qwen3ASRModel
    from qwen_asr.core.transformers_backend import modeling_qwen3_asr as reference_model
    from qwen_asr.inference.utils import parse_asr_output

    if windows:
        attend = reference_model.Qwen3ASRAudioAttention.forward

        def windowed(self, hidden_states, cu_seqlens=None, attention_mask=None, **kwargs):
            if attention_mask is None and cu_seqlens is not None:
                n = hidden_states.shape[0]
                window = torch.bucketize(torch.arange(n), cu_seqlens[1:], right=True)
                apart = window[:, None] != window[None, :]
                attention_mask = torch.zeros(n, n, dtype=hidden_states.dtype)
                attention_mask = attention_mask.masked_fill(apart, float("-inf"))[None, None]
            return attend(self, hidden_states, cu_seqlens, attention_mask, **kwargs)

        reference_model.Qwen3ASRAudioAttention.forward = windowed

    asr = Qwen3ASRModel.from_pretrained(
        str(path), dtype=torch.float32, max_inference_batch_size=batch, max_new_tokens=448
    )
    ends = json.loads((path / "config.json").read_text())["eos_token_id"]
    clips = np.load(samples)
    wavs = [clips[k] for k in sorted(clips.files, key=int)]
    rows = []
    for i in range(0, len(wavs), batch):
        part = wavs[i : i + batch]
        texts = [asr._build_text_prompt(context="", force_language=None)] * len(part)
        inputs = asr.processor(text=texts, audio=part, return_tensors="pt", padding=True)
        inputs = inputs.to(asr.model.device).to(asr.model.dtype)
        with torch.inference_mode():  # its generate defaults to the real vocabulary's ends
            generated = asr.model.generate(**inputs, max_new_tokens=448, eos_token_id=ends)
        ids = generated.sequences if hasattr(generated, "sequences") else generated
        width = inputs["input_ids"].shape[1]
        for row in ids[:, width:].tolist():
            raw = asr.processor.batch_decode([row], skip_special_tokens=True,
                                             clean_up_tokenization_spaces=False)[0]  # fmt: skip
            language, text = parse_asr_output(raw)
            rows.append({"ids": row, "language": language, "text": text})
    out.write_text(json.dumps(rows))


WHISPER_FEATURES = (
    "feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value",
    "return_attention_mask", "dither",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make", help="a random-weight model in the transformers layout")
    p.add_argument("path", type=Path)
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("reference", help="a model of `make` in the reference's layout")
    p.add_argument("path", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("run-reference", help="(in the reference's environment) its answers")
    p.add_argument("path", type=Path)
    p.add_argument("samples", type=Path, help=".npz of 16 kHz clips named 0, 1, ...")
    p.add_argument("out", type=Path)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--windows", action="store_true", help="its audio attention in windows")
    args = parser.parse_args()
    if args.command == "make":
        print(make(args.path, args.size, args.seed))
    elif args.command == "reference":
        print(reference(args.path, args.out))
    else:
        run_reference(args.path, args.samples, args.out, args.batch, args.windows)
    print(json.dumps({"done": args.command}))


if __name__ == "__main__":
    main()
