"""Model registry: built-in tiny diffusers pipelines and local flow-match pipelines.

Built-in models are assembled from the real diffusers / transformers classes with tiny
configs and seeded random weights, created inside `torch.random.fork_rng` so that the
same id gives the same weights bit for bit on every build and the caller's RNG is untouched.
Every module is put in eval mode. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.spec import RolloutInputError

__all__ = ["LoadedModel", "ModelDefaults", "ModelRegistry", "weights_digest"]


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


@dataclass(kw_only=True)
class LoadedModel:
    """A ready pipeline plus what a rollout needs to know about it.

    `pipeline` and `digest` change together (under `lock`) when `ModelRegistry.load_weights`
    swaps in new transformer weights; a rollout reads both once with `snapshot()`.
    """

    id: str
    family: str
    """"sd3", "flux", "wan" or "other": selects the per-family batch argument names."""
    pipeline: Any
    device: torch.device
    dtype: torch.dtype
    digest: str
    defaults: ModelDefaults
    lock: threading.Lock = field(default_factory=threading.Lock)
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    """Fast tokenizers mutate their padding/truncation state per call: one call at a time."""

    def snapshot(self) -> tuple[Any, str]:
        with self.lock:
            return self.pipeline, self.digest


def weights_digest(pipeline: Any) -> str:
    """sha256 over the state dicts of all torch modules of a pipeline (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256()
    for name, module in sorted(pipeline.components.items()):
        if not isinstance(module, torch.nn.Module):
            continue
        for key, tensor in sorted(module.state_dict().items()):
            t = tensor.detach().to("cpu").contiguous()
            h.update(f"{name}.{key}:{t.dtype}:{tuple(t.shape)}\n".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


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


def _tiny_vae(latent_channels: int, **kw: Any) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(4, 4),
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


def _family_of(pipeline: Any) -> str:
    name = type(pipeline).__name__
    if name.startswith("StableDiffusion3"):
        return "sd3"
    if name.startswith("Flux"):
        return "flux"
    if name.startswith("Wan"):
        return "wan"
    return "other"


def max_image_size(pipeline: Any) -> int | None:
    """Largest height/width the transformer can place (SD3's learned position embedding covers
    pos_embed_max_size patches a side); None where positions are unbounded (RoPE: FLUX, Wan)."""
    cfg = getattr(getattr(pipeline, "transformer", None), "config", None)
    pos = getattr(cfg, "pos_embed_max_size", None)
    if cfg is None or pos is None:
        return None
    return int(pos) * int(getattr(cfg, "patch_size", 1)) * int(getattr(pipeline, "vae_scale_factor", 8))


def _size_multiple(pipeline: Any) -> int:
    vae = getattr(pipeline, "vae_scale_factor", 8)
    if _family_of(pipeline) == "flux":
        return int(vae) * 2
    if _family_of(pipeline) == "wan":  # spatial VAE factor x the transformer's (t, h, w) patch
        patch = tuple(pipeline.transformer.config.patch_size)
        return int(pipeline.vae_scale_factor_spatial) * int(max(patch[1], patch[2]))
    patch = getattr(getattr(pipeline, "transformer", None), "config", {}).get("patch_size", 1)
    return int(vae) * int(patch if isinstance(patch, int) else 1)


def _prepare(pipeline: Any, device: torch.device, dtype: torch.dtype) -> Any:
    pipeline.to(device)
    if dtype != torch.float32:
        pipeline.to(dtype=dtype)
    for module in pipeline.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
            module.requires_grad_(False)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


class ModelRegistry:
    """Models by id. Built-ins are built lazily on first `get` and cached."""

    def __init__(self, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self._device = torch.device(device)
        self._dtype = dtype
        self._loaded: dict[str, LoadedModel] = {}
        self._local: dict[str, tuple[str, torch.device, torch.dtype]] = {}
        self._lock = threading.Lock()

    def ids(self) -> list[str]:
        return sorted(set(_BUILTINS) | set(self._local) | set(self._loaded))

    def get(self, model_id: str) -> LoadedModel:
        with self._lock:
            if model_id in self._loaded:
                return self._loaded[model_id]
            if model_id in _BUILTINS:
                model = self._build_builtin(model_id)
            elif model_id in self._local:
                path, device, dtype = self._local[model_id]
                model = self._load_local(model_id, path, device, dtype)
            else:
                raise RolloutInputError("model", f"unknown model {model_id!r}; known: {self.ids()}")
            self._loaded[model_id] = model
            return model

    def register_local(
        self,
        model_id: str,
        path: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> LoadedModel:
        """Load a diffusers flow-match pipeline from a local directory (no network) under `model_id`."""
        model = self._load_local(model_id, str(path), torch.device(device), dtype)
        with self._lock:
            self._local[model_id] = (str(path), torch.device(device), dtype)
            self._loaded[model_id] = model
        return model

    def load_weights(self, model_id: str, state_dict: Mapping[str, torch.Tensor]) -> str:
        """Replace the transformer's weights; returns the new digest.

        Copy-on-write: the new weights go into a copy of the transformer and a new pipeline
        object, swapped in under the model's lock, so rollouts already running keep the
        weights (and digest) they started with.
        """
        import copy

        model = self.get(model_id)
        pipeline, _ = model.snapshot()
        transformer = copy.deepcopy(pipeline.transformer)
        transformer.load_state_dict(dict(state_dict), strict=True)
        transformer.eval()
        new_pipeline = type(pipeline)(**{**pipeline.components, "transformer": transformer})
        new_pipeline.set_progress_bar_config(disable=True)
        digest = weights_digest(new_pipeline)
        with model.lock:
            model.pipeline = new_pipeline
            model.digest = digest
        return digest

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for model_id in self.ids():
            m = self.get(model_id)
            d = m.defaults
            out.append(
                {
                    "id": m.id,
                    "family": m.family,
                    "dtype": str(m.dtype).removeprefix("torch."),
                    "device": str(m.device),
                    "digest": m.snapshot()[1],
                    "defaults": {
                        "height": d.height,
                        "width": d.width,
                        "num_inference_steps": d.num_inference_steps,
                        "guidance_scale": d.guidance_scale,
                        "num_frames": d.num_frames,
                    },
                    "size_multiple": d.size_multiple,
                    "is_video": d.is_video,
                }
            )
        return out

    # ------------------------------------------------------------------ internals

    def _build_builtin(self, model_id: str) -> LoadedModel:
        spec = _BUILTINS[model_id]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            pipeline = spec.build()
        _prepare(pipeline, self._device, self._dtype)
        return LoadedModel(
            id=model_id,
            family=spec.family,
            pipeline=pipeline,
            device=self._device,
            dtype=self._dtype,
            digest=weights_digest(pipeline),
            defaults=spec.defaults,
        )

    def _load_local(self, model_id: str, path: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
        from diffusers import DiffusionPipeline

        pipeline = DiffusionPipeline.from_pretrained(path, local_files_only=True, dtype=dtype)
        _prepare(pipeline, device, dtype)
        family = _family_of(pipeline)
        vae = int(getattr(pipeline, "vae_scale_factor", 8))
        sample = getattr(pipeline, "default_sample_size", 64)
        size = int(sample) * vae if family != "flux" else 32 * _size_multiple(pipeline)
        builtin_kwargs = {"max_sequence_length": _T5_LEN} if _is_builtin_sized(pipeline) else {}
        defaults = ModelDefaults(
            height=size,
            width=size,
            num_inference_steps=28,
            guidance_scale=3.5 if family == "flux" else 5.0,
            size_multiple=_size_multiple(pipeline),
            is_video=family == "wan",
            num_frames=9 if family == "wan" else None,
            call_kwargs=builtin_kwargs,
        )
        return LoadedModel(
            id=model_id,
            family=family,
            pipeline=pipeline,
            device=device,
            dtype=dtype,
            digest=weights_digest(pipeline),
            defaults=defaults,
        )


def _is_builtin_sized(pipeline: Any) -> bool:
    tok = getattr(pipeline, "tokenizer", None)
    return tok is not None and getattr(tok, "model_max_length", 0) == _CLIP_LEN
