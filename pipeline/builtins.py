"""Built-in models: tiny diffusers pipelines from the real classes with seeded random weights.

Each is assembled inside `torch.random.fork_rng` by `sigmaflight.pipeline.models.ModelRegistry` so that the
same id gives the same weights bit for bit on every build; nothing is downloaded.
`_BUILTINS` maps a model id to its family, seed, builder and request defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelDefaults", "BUILTINS", "T5_LEN", "CLIP_LEN", "sd3_with_tiny_encoders"]


@dataclass(frozen=True, kw_only=True)
class ModelDefaults:
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    num_frames: int | None = None
    """Video models only."""
    size_multiple: int = 1
    """height and width must be multiples of this."""
    is_video: bool = False
    call_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments every pipeline call gets (e.g. a short max_sequence_length)."""


# --------------------------------------------------------------------------- tokenizers

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _clip_tokenizer(max_length: int) -> Any:
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for ch in _LETTERS:
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    merges: Any = [("a", "t</w>"), ("t", "h"), ("th", "e</w>")]  # tuples (transformers 5), not strings
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=max_length,
        pad_token="<|endoftext|>",
    )


def _t5_tokenizer(max_length: int) -> Any:
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(ch, -2.0) for ch in _LETTERS]
    pieces += [("\u2581" + ch, -1.5) for ch in _LETTERS]
    return T5Tokenizer(vocab=pieces, model_max_length=max_length, extra_ids=0)


def _clip_encoder(hidden: int, proj: int, max_pos: int, vocab: int, layers: int, *, projection: bool = True) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=2,
        num_hidden_layers=layers,
        max_position_embeddings=max_pos,
        vocab_size=vocab,
        hidden_act="gelu",
        projection_dim=proj,
    )
    return CLIPTextModelWithProjection(cfg) if projection else CLIPTextModel(cfg)


def _t5_encoder(d_model: int, vocab: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(T5Config(**kwargs))


def _tiny_vae(latent_channels: int, blocks: int = 2, **kw: Any) -> Any:
    """`blocks` down/up blocks of 4 channels: the pipeline's vae_scale_factor is 2 ** (blocks - 1)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=(4,) * blocks,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=1,
        sample_size=32,
        **kw,
    )


# --------------------------------------------------------------------------- built-ins

_CLIP_LEN = 16
_T5_LEN = 16


def _build_sd3(*, dim_heads: int, heads: int, layers: int) -> Any:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    clip_vocab = len(_clip_tokenizer(_CLIP_LEN).get_vocab())
    t5_vocab = len(_t5_tokenizer(_T5_LEN).get_vocab())
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=layers,
        attention_head_dim=dim_heads,
        num_attention_heads=heads,
        joint_attention_dim=32,
        caption_projection_dim=dim_heads * heads,
        pooled_projection_dim=32,
        pos_embed_max_size=32,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_tiny_vae(4, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=_clip_encoder(16, 16, _CLIP_LEN, clip_vocab, 1),
        tokenizer=_clip_tokenizer(_CLIP_LEN),
        text_encoder_2=_clip_encoder(16, 16, _CLIP_LEN, clip_vocab, 1),
        tokenizer_2=_clip_tokenizer(_CLIP_LEN),
        text_encoder_3=_t5_encoder(32, t5_vocab),
        tokenizer_3=_t5_tokenizer(_T5_LEN),
    )


def sd3_with_tiny_encoders(transformer_config: Mapping[str, Any], *, shift: float = 3.0) -> Any:
    """A StableDiffusion3Pipeline whose transformer is `SD3Transformer2DModel(**transformer_config)`
    (any size, e.g. a published checkpoint's dimensions) and whose text encoders, tokenizers and VAE
    are the built-ins' tiny ones, sized to fit it: the T5 encoder's d_model is `joint_attention_dim`,
    the two CLIP projections share `pooled_projection_dim`, the VAE has `in_channels` latent
    channels and four blocks (vae_scale_factor 8, as a real SD3 VAE). So the transformer does the
    real model's work and the rest is cheap. Weights are random: seed first (`torch.manual_seed`);
    build under `with torch.device(...)` to allocate on an accelerator.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    cfg = dict(transformer_config)
    clip_vocab = len(_clip_tokenizer(_CLIP_LEN).get_vocab())
    t5_vocab = len(_t5_tokenizer(_T5_LEN).get_vocab())
    pooled = int(cfg["pooled_projection_dim"])
    transformer = SD3Transformer2DModel(**cfg)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=_tiny_vae(int(cfg["in_channels"]), blocks=4, use_quant_conv=False, use_post_quant_conv=False,
                      shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=_clip_encoder(16, pooled // 2, _CLIP_LEN, clip_vocab, 1),
        tokenizer=_clip_tokenizer(_CLIP_LEN),
        text_encoder_2=_clip_encoder(16, pooled - pooled // 2, _CLIP_LEN, clip_vocab, 1),
        tokenizer_2=_clip_tokenizer(_CLIP_LEN),
        text_encoder_3=_t5_encoder(int(cfg["joint_attention_dim"]), t5_vocab),
        tokenizer_3=_t5_tokenizer(_T5_LEN),
    )


def _build_flux() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clip_vocab = len(_clip_tokenizer(_CLIP_LEN).get_vocab())
    t5_vocab = len(_t5_tokenizer(_T5_LEN).get_vocab())
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        out_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=16,
        max_image_seq_len=256,
    )
    return FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=_tiny_vae(4, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=_clip_encoder(16, 16, _CLIP_LEN, clip_vocab, 1, projection=False),
        tokenizer=_clip_tokenizer(_CLIP_LEN),
        text_encoder_2=_t5_encoder(32, t5_vocab),
        tokenizer_2=_t5_tokenizer(_T5_LEN),
    )


def _build_wan() -> Any:
    """WanPipeline with a 2-layer transformer, a 1-layer UMT5 encoder and a base_dim-3 Wan VAE.

    The VAE keeps Wan's factors (spatial 8, temporal 4; latent [16, (F - 1) // 4 + 1, H / 8, W / 8]).
    Real Wan ships UniPCMultistepScheduler; sigmaflight's rollout path wraps
    FlowMatchEulerDiscreteScheduler only, so the tiny Wan gets that with Wan's static flow shift 5.0.
    """
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    t5_vocab = len(_t5_tokenizer(_T5_LEN).get_vocab())
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=t5_vocab,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    return WanPipeline(
        tokenizer=_t5_tokenizer(_T5_LEN),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=transformer,
    )


@dataclass(frozen=True)
class _BuiltIn:
    family: str
    seed: int
    build: Callable[[], Any]
    defaults: ModelDefaults


_BUILTINS: dict[str, _BuiltIn] = {
    "tiny-sd3": _BuiltIn(
        "sd3",
        1,
        lambda: _build_sd3(dim_heads=8, heads=2, layers=1),
        ModelDefaults(
            height=32, width=32, num_inference_steps=4, guidance_scale=4.5, size_multiple=4,
            call_kwargs={"max_sequence_length": _T5_LEN},
        ),
    ),
    "small-sd3": _BuiltIn(
        "sd3",
        2,
        lambda: _build_sd3(dim_heads=32, heads=8, layers=6),
        ModelDefaults(
            height=64, width=64, num_inference_steps=8, guidance_scale=4.5, size_multiple=4,
            call_kwargs={"max_sequence_length": _T5_LEN},
        ),
    ),
    "tiny-flux": _BuiltIn(
        "flux",
        3,
        _build_flux,
        ModelDefaults(
            height=32, width=32, num_inference_steps=4, guidance_scale=3.5, size_multiple=4,
            call_kwargs={"max_sequence_length": _T5_LEN},
        ),
    ),
    "tiny-wan": _BuiltIn(
        "wan",
        4,
        _build_wan,
        ModelDefaults(
            height=32, width=32, num_inference_steps=4, guidance_scale=5.0, num_frames=9, size_multiple=16,
            is_video=True, call_kwargs={"max_sequence_length": _T5_LEN},
        ),
    ),
}



BUILTINS = _BUILTINS
T5_LEN = _T5_LEN
CLIP_LEN = _CLIP_LEN
