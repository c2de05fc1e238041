"""sigmaflight.pipeline.decode against the stock diffusers pipelines: the same final latents give the same bytes.

Reference: the stock pipeline's own `__call__` with its own decode. A step-end callback records
the latents the loop ends on (x_T); decode_uint8 of those must equal numpy.asarray of the
pipeline's `output_type="pil"` images (sd3, flux) and video frames (wan), as the contract says.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from sigmaflight.pipeline.decode import decode_latents, decode_uint8
from sigmaflight.pipeline.models import LoadedModel, ModelRegistry


def _stock(model: LoadedModel, output_type: str, **kw: Any) -> tuple[Any, torch.Tensor]:
    """(the stock pipeline's output, the x_T its loop ended on)."""
    seen: dict[str, torch.Tensor] = {}

    def on_step_end(pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        seen["x"] = kwargs["latents"].clone()
        return kwargs

    d = model.defaults
    call = {"prompt": ["a red cube", "a dog"], "num_inference_steps": 2, "height": d.height, "width": d.width,
            "generator": torch.Generator("cpu").manual_seed(3), **d.call_kwargs, **kw}
    out = model.pipeline(output_type=output_type, callback_on_step_end=on_step_end,
                         callback_on_step_end_tensor_inputs=["latents"], **call)
    return out, seen["x"]


@pytest.mark.parametrize("model_id", ["tiny-sd3", "tiny-flux"])
def test_images_equal_the_stock_pipelines_pil_output(registry, model_id):
    model = registry.get(model_id)
    out, x_t = _stock(model, "pil")
    want = np.stack([np.asarray(im) for im in out.images])  # [B, H, W, 3] uint8
    got = decode_uint8(model, x_t, height=model.defaults.height, width=model.defaults.width)
    assert got.dtype == np.uint8 and got.shape == want.shape == (2, model.defaults.height, model.defaults.width, 3)
    assert np.array_equal(got, want)
    assert want.std() > 5  # a real picture, not a saturated or blank one
    floats = decode_latents(model, x_t, height=model.defaults.height, width=model.defaults.width)
    assert floats.shape == (2, 3, model.defaults.height, model.defaults.width)
    assert np.array_equal((floats.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8), want)


def test_video_frames_equal_the_stock_pipelines_pil_frames(registry):
    model = registry.get("tiny-wan")
    out, x_t = _stock(model, "pil", num_frames=5)
    want = np.stack([np.stack([np.asarray(frame) for frame in v]) for v in out.frames])  # PIL frames per video
    got = decode_uint8(model, x_t)
    assert got.shape == want.shape == (2, 5, 32, 32, 3)
    assert np.array_equal(got, want)
    assert want.std() > 5
    assert decode_latents(model, x_t).shape == (2, 5, 3, 32, 32)


def test_local_model_dir_decodes_through_its_own_vae(tmp_path):
    """A pipeline saved with save_pretrained and loaded as a local model: the family comes from its class."""
    ModelRegistry().get("tiny-sd3").pipeline.save_pretrained(tmp_path / "m")
    model = ModelRegistry().register_local("mine", str(tmp_path / "m"))
    out, x_t = _stock(model, "pil", height=32, width=32)
    got = decode_uint8(model, x_t, height=32, width=32)
    assert np.array_equal(got, np.stack([np.asarray(im) for im in out.images]))


def test_flux_needs_the_size_and_other_families_say_why(registry):
    flux = registry.get("tiny-flux")
    with pytest.raises(ValueError, match="height and width"):
        decode_uint8(flux, torch.zeros(1, 16, 64))
    other = LoadedModel(id="x", family="other", pipeline=flux.pipeline, device=flux.device, dtype=flux.dtype,
                        digest="d", defaults=flux.defaults)
    with pytest.raises(ValueError, match="'other' family"):
        decode_uint8(other, torch.zeros(1, 16, 64))
