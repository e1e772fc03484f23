"""Incremental decoding of the Qwen3-TTS 12 Hz codec: carry state instead of re-decoding a window.

faster-qwen3-tts decodes every chunk by re-running the codec over the new frames plus 25 frames
of left context, so a chunk of n frames costs a decode of n + 25 frames (measured on CPU with the
full-size codec: 1 frame 130 ms, 8 frames 506 ms, 33 frames 1407 ms). The decoder is causal end
to end, so the same output can be computed from the new frames alone if each layer keeps what it
needs from the past:

- the quantizer's codebook lookup and 1x1 projections are per frame (no state);
- each causal ``Conv1d`` (left padding ``p = (k - 1) * dilation``, stride 1) keeps the last ``p``
  input samples, which replace the zero padding;
- each causal ``ConvTranspose1d`` (kernel ``k``, stride ``s``, the last ``k - s`` outputs trimmed)
  keeps the ``k - s`` trimmed samples and adds them (overlap-add) to the next chunk's first
  outputs; the bias is added once per emitted sample;
- the 8-layer sliding-window transformer keeps its KV cache and continues its positions;
- SnakeBeta, LayerNorm, Linear and GELU act per time step (no state).

Unlike the windowed decode, this computes what a decode of the whole utterance in one pass
computes (positions do not restart at each window and attention sees its full sliding window).
It is the same arithmetic, not the same bits: the chunks' matrices have other shapes than the
whole utterance's, so float32 sums run in another order. The tests hold it within 1e-4 of the
one-pass decode (and > 60 dB under the signal), and check its distance to the windowed output.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


class StreamingCodecDecoder:
    """Decodes codec frames chunk by chunk, equal to one whole-utterance decode (up to float32
    summation order: within 1e-4, see the module docstring).

    One instance per utterance (or :meth:`reset` between utterances). Not thread-safe; the
    decoder module it wraps is shared read-only.
    """

    def __init__(self, decoder: Any) -> None:
        # decoder: qwen_tts ... Qwen3TTSTokenizerV2Decoder
        self.decoder = decoder
        self._classes = _module_classes()
        self.reset()

    def reset(self) -> None:
        """Forget the past (next call starts a new utterance)."""
        self._conv_state: dict[int, torch.Tensor] = {}
        self._tconv_tail: dict[int, torch.Tensor] = {}
        self._kv: Any = None
        self._position = 0

    @property
    def frames_decoded(self) -> int:
        return self._position

    def prime(self, codes: torch.Tensor) -> None:
        """Feed frames whose audio is not wanted (a cloned voice's reference clip)."""
        self.decode(codes)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> np.ndarray:
        """Decode ``codes`` (``[n, num_quantizers]`` codec ids) into ``n * 1920`` samples."""
        from transformers import DynamicCache

        dec = self.decoder
        n = int(codes.shape[0])
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        device = next(dec.parameters()).device
        codes = torch.clamp(codes.to(device), min=0).transpose(0, 1).unsqueeze(0)  # [1, K, n]
        hidden = dec.quantizer.decode(codes)
        hidden = self._conv(dec.pre_conv, hidden).transpose(1, 2)
        if self._kv is None:
            self._kv = DynamicCache(config=dec.pre_transformer.config)
        positions = torch.arange(self._position, self._position + n, device=hidden.device)
        hidden = dec.pre_transformer(
            inputs_embeds=hidden,
            past_key_values=self._kv,
            use_cache=True,
            cache_position=positions,
        ).last_hidden_state
        self._position += n
        hidden = hidden.permute(0, 2, 1)
        for blocks in dec.upsample:
            for block in blocks:
                hidden = self._run(block, hidden)
        for block in dec.decoder:
            hidden = self._run(block, hidden)
        wav = hidden.clamp(min=-1, max=1)
        return wav.reshape(-1).float().cpu().numpy()

    # --- layers -------------------------------------------------------------------------------

    def _run(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        c = self._classes
        if isinstance(module, c["conv"]):
            return self._conv(module, x)
        if isinstance(module, c["tconv"]):
            return self._tconv(module, x)
        if isinstance(module, c["convnext"]):
            return self._convnext(module, x)
        if isinstance(module, c["residual"]):
            y = module.act1(x)
            y = self._conv(module.conv1, y)
            y = module.act2(y)
            y = self._conv(module.conv2, y)
            return y + x
        if isinstance(module, c["block"]):
            for sub in module.block:
                x = self._run(sub, x)
            return x
        if isinstance(module, c["snake"]):
            return module(x)
        raise TypeError(f"no streaming rule for codec layer {type(module).__name__}")

    def _conv(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """Causal conv with carried left context (stride 1 everywhere in this decoder)."""
        if module.stride != 1:
            raise ValueError("streaming decode supports stride-1 causal convolutions only")
        pad = module.padding
        if pad == 0:
            return module.conv(x)
        key = id(module)
        past = self._conv_state.get(key)
        if past is None:
            past = x.new_zeros(x.shape[0], x.shape[1], pad)
        full = torch.cat([past, x], dim=-1)
        self._conv_state[key] = full[..., -pad:]
        return module.conv(full).contiguous()

    def _tconv(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """Causal transposed conv: overlap-add the tail the whole-signal version would trim."""
        conv = module.conv
        stride = conv.stride[0]
        y = F.conv_transpose1d(x, conv.weight, None, stride=stride)  # bias once, below
        n_out = x.shape[-1] * stride
        key = id(module)
        tail = self._tconv_tail.get(key)
        if tail is not None:
            overlap = tail.shape[-1]
            y[..., :overlap] += tail
        self._tconv_tail[key] = y[..., n_out:].clone()
        out = y[..., :n_out]
        if conv.bias is not None:
            out = out + conv.bias.view(1, -1, 1)
        return out.contiguous()

    def _convnext(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        y = self._conv(module.dwconv, x)
        y = y.permute(0, 2, 1)
        y = module.norm(y)
        y = module.pwconv1(y)
        y = module.act(y)
        y = module.pwconv2(y)
        y = module.gamma * y
        return x + y.permute(0, 2, 1)


class WindowedCodecDecoder:
    """faster-qwen3-tts's way: decode each chunk with up to 25 frames of left context.

    The 12 Hz codec decodes exactly 1920 samples per frame, so a chunk's new audio is the last
    ``n_new * 1920`` samples of its window's output. Kept as the reference the incremental
    decoder is measured against (``GATEWAY_CODEC_DECODE=windowed``).
    """

    def __init__(self, tokenizer: Any, left_context: int = 25) -> None:
        # tokenizer: qwen_tts Qwen3TTSTokenizer (its decode() takes {"audio_codes": [1, n, K]})
        self.tokenizer = tokenizer
        self.left_context = left_context
        self._frames: torch.Tensor | None = None

    def prime(self, codes: torch.Tensor) -> None:
        """Reference frames become the first windows' left context."""
        self._frames = codes[-self.left_context :].to(self._device())

    def decode(self, codes: torch.Tensor) -> np.ndarray:
        n_new = int(codes.shape[0])
        codes = codes.to(self._device())
        everything = codes if self._frames is None else torch.cat([self._frames, codes], dim=0)
        window = everything[-(n_new + self.left_context) :]
        wavs, _sr = self.tokenizer.decode({"audio_codes": window.unsqueeze(0)})
        audio = np.asarray(wavs[0], dtype=np.float32).reshape(-1)
        # Keep only what later windows can still reach; the history would grow per frame.
        self._frames = everything[-self.left_context :]
        return np.clip(audio[-n_new * 1920 :], -1.0, 1.0)

    def _device(self) -> Any:
        return next(self.tokenizer.model.parameters()).device


def _module_classes() -> dict[str, Any]:
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as m

    return {
        "conv": m.Qwen3TTSTokenizerV2CausalConvNet,
        "tconv": m.Qwen3TTSTokenizerV2CausalTransConvNet,
        "convnext": m.Qwen3TTSTokenizerV2ConvNeXtBlock,
        "residual": m.Qwen3TTSTokenizerV2DecoderDecoderResidualUnit,
        "block": m.Qwen3TTSTokenizerV2DecoderDecoderBlock,
        "snake": m.SnakeBeta,
    }
