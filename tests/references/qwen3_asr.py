"""A tiny but complete Qwen3-ASR checkpoint built with transformers' own class (``Qwen3ASRForConditionalGeneration``:
audio tower, projector, Qwen3 text decoder, tied head), the parity reference for the ``qwen3_asr`` family.

``save_pretrained`` writes the Hub's ``-hf`` layout: ``model.language_model.*`` (the decoder), ``model.audio_tower.*``,
``model.multi_modal_projector.*``, and no ``lm_head.weight`` (tied to the embedding). The decoder is Qwen3 (qk-norm,
GQA 4:2, head 16); its weights are drawn at 0.2 (norms around one), as in the other references, so that attention
and RoPE matter. The special ids, and the end-of-sequence and pad ids the outer config holds (the text config has
none), sit inside the tiny vocabulary."""

from __future__ import annotations

from pathlib import Path

import torch
from seeded_weights import draw_weights

TEXT_CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
# n_window as the released checkpoints (50: chunks of 100 mel frames), the rest tiny
AUDIO_CONFIG = {
    "num_mel_bins": 16,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 16,
    "d_model": 16,
    "output_dim": TEXT_CONFIG["hidden_size"],
    "n_window": 50,
    "n_window_infer": 200,
    "downsample_hidden_size": 8,
}
AUDIO_TOKEN, TIMESTAMP_TOKEN = 200, 201
EOS, PAD = [250, 251], 251
MEL_FRAMES = 200  # two chunks of the audio tower
# the seed whose greedy transcript of the audio prompt varies (8 tokens, 6 distinct; seed 0's repeats one token)
SEED = 4


def build(seed: int = SEED):
    from transformers import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3ASRConfig(
        text_config=TEXT_CONFIG,
        audio_config=AUDIO_CONFIG,
        audio_token_id=AUDIO_TOKEN,
        timestamp_token_id=TIMESTAMP_TOKEN,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    model = Qwen3ASRForConditionalGeneration(config).eval()
    draw_weights(model.model.language_model, seed)
    return model


def save(folder: str | Path, seed: int = SEED) -> Path:
    build(seed).save_pretrained(folder)
    return Path(folder)


def load_reference(folder: str | Path):
    from transformers import Qwen3ASRForConditionalGeneration

    return Qwen3ASRForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def audio_prompt(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One prompt holding an audio clip (``MEL_FRAMES`` mel frames, one audio token per frame the tower keeps) among
    text, as the model's forward and ``generate`` take it: (input_ids, the audio inputs)."""
    features = torch.randn(1, AUDIO_CONFIG["num_mel_bins"], MEL_FRAMES, generator=torch.Generator().manual_seed(5))
    inputs = {"input_features": features, "input_features_mask": torch.ones(1, MEL_FRAMES, dtype=torch.long)}
    with torch.no_grad():
        audio_tokens = model.get_audio_features(**inputs).pooler_output.shape[0]
    return torch.tensor([[5, 9, 17, 33, *[AUDIO_TOKEN] * audio_tokens, 21, 8, 7, 44]]), inputs
