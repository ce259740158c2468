"""Whisper's special tokens and text decoding, read from a Hugging Face `tokenizer.json`.

English-only (`.en`) and multilingual vocabularies place the special tokens at different ids
(the multilingual one has one more regular token), so every id is looked up by its text.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _BPE


@dataclass(frozen=True)
class Tokenizer:
    bpe: _BPE
    n_vocab: int  # the model's vocabulary size, which decides multilinguality

    @classmethod
    def from_dir(cls, path: Path, n_vocab: int) -> Tokenizer:
        return cls(_BPE.from_file(str(path / "tokenizer.json")), n_vocab)

    def _id(self, text: str) -> int:
        token_id = self.bpe.token_to_id(text)
        if token_id is None:
            raise ValueError(f"the tokenizer has no {text} token")
        return token_id

    @cached_property
    def eot(self) -> int:
        return self._id("<|endoftext|>")

    @cached_property
    def sot(self) -> int:
        return self._id("<|startoftranscript|>")

    @cached_property
    def translate(self) -> int:
        return self._id("<|translate|>")

    @cached_property
    def transcribe(self) -> int:
        return self._id("<|transcribe|>")

    @cached_property
    def sot_prev(self) -> int:
        return self._id("<|startofprev|>")

    @cached_property
    def no_speech(self) -> int:
        for text in ("<|nospeech|>", "<|nocaptions|>"):
            if self.bpe.token_to_id(text) is not None:
                return self._id(text)
        raise ValueError("the tokenizer has neither <|nospeech|> nor <|nocaptions|>")

    @cached_property
    def no_timestamps(self) -> int:
        return self._id("<|notimestamps|>")

    @cached_property
    def timestamp_begin(self) -> int:
        return self._id("<|0.00|>")

    @cached_property
    def is_multilingual(self) -> bool:
        return self.n_vocab >= 51865

    @cached_property
    def language_ids(self) -> dict[str, int]:
        """ISO 639-1 (or Whisper's own) code -> token id, for multilingual models only."""
        if not self.is_multilingual:
            return {}
        return {self.bpe.id_to_token(i)[2:-2]: i for i in range(self.sot + 1, self.translate)}

    @cached_property
    def task_ids(self) -> dict[str, int]:
        """Whisper's tasks, named as their tokens are: what a multilingual model can do."""
        return {"transcribe": self.transcribe, "translate": self.translate}

    def sot_sequence(self, language: str | None, task: str) -> list[int]:
        """The prompt that starts a window: sot [language task] notimestamps."""
        if not self.is_multilingual:
            return [self.sot, self.no_timestamps]
        return [self.sot, self.language_ids[language], self.task_ids[task], self.no_timestamps]

    def encode(self, text: str) -> list[int]:
        return self.bpe.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        """Text of the tokens below `eot`; special and timestamp tokens are dropped."""
        return self.bpe.decode([t for t in tokens if t < self.eot])

    def text_of(self, token: int) -> str:
        """One token's own text, as `decode` gives it, kept once asked: word timestamps ask it
        of every token of every window, in the stepping thread."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.decode([token])
        return text

    @cached_property
    def _texts(self) -> dict[int, str]:
        return {}
