import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from engine.audio import decode_audio
from engine.mel import N_FRAMES, log_mel_spectrogram, mel_filters


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filters_match_transformers(n_mels):
    reference = WhisperFeatureExtractor(feature_size=n_mels).mel_filters
    np.testing.assert_allclose(mel_filters(n_mels), reference, rtol=0, atol=1e-7)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_matches_feature_extractor_on_real_audio(clips, n_mels):
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    for clip in clips.values():
        audio = decode_audio(clip.bytes)
        expected = extractor(audio, sampling_rate=16000, return_tensors="np").input_features[0]
        ours = log_mel_spectrogram(torch.from_numpy(audio), n_mels).numpy()
        assert ours.shape == (n_mels, N_FRAMES)
        assert np.abs(ours - expected).max() < 1e-3, clip.path.name


def test_silence_is_the_floor():
    mel = log_mel_spectrogram(torch.zeros(16000), 80)
    assert torch.all(mel == mel[0, 0])
