"""The replay weights check, in process: `current_components` against the registry's own digests
(what the server records as `model.components`), its cache, and peft adapters placed the two
ways trainers do (`add_adapter`, `get_peft_model`) against the registry's `load_lora`."""

from __future__ import annotations

import copy
import json

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from sigmaflight.pipeline.models import ModelRegistry
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from sigmaflight.replay import current_components, current_digest

TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]


class _Trainer:
    """What replay needs of a model: `.pipeline`."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline


def _with(model, **components) -> _Trainer:
    pipe = model.pipeline
    return _Trainer(type(pipe)(**{**pipe.components, **components}))


def _wire(config: LoraConfig) -> dict:
    return json.loads(json.dumps(config.to_dict(), default=sorted))  # what push_lora sends


def test_components_match_the_registry_and_the_cache_follows_replaced_and_changed_tensors():
    model = ModelRegistry().get("tiny-sd3")
    assert current_components(model) == model.components and current_digest(model) == model.digest
    trainer = _with(model, transformer=copy.deepcopy(model.pipeline.transformer), text_encoder=None)
    assert current_components(trainer) == {k: v for k, v in model.components.items() if k != "text_encoder"}
    # new tensor objects (load_state_dict with assign=True), one value moved: a new digest, not the cached one
    state = {k: v.clone() for k, v in trainer.pipeline.transformer.state_dict().items()}
    key = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[key].view(-1)[0] += 1.0
    trainer.pipeline.transformer.load_state_dict(state, assign=True)
    moved = current_components(trainer)
    assert moved["transformer"] != model.components["transformer"] and moved["vae"] == model.components["vae"]
    # the same values again, in place: the version counter moves, the digest is the original one
    original = model.pipeline.transformer.state_dict()[key].view(-1)[0]
    with torch.no_grad():
        trainer.pipeline.transformer.state_dict()[key].view(-1)[0] = original
    assert current_components(trainer)["transformer"] == model.components["transformer"]
    # new storage under the same parameters (torch's vector_to_parameters sets param.data): a miss too
    params = list(trainer.pipeline.transformer.parameters())
    vector_to_parameters(parameters_to_vector(params) + 1e-3, params)
    assert current_components(trainer)["transformer"] != model.components["transformer"]


def test_a_trainers_adapter_gets_the_digest_the_server_gives_the_same_adapter():
    registry = ModelRegistry()
    served = registry.get("tiny-sd3")
    base = copy.deepcopy(served.pipeline.transformer)
    config = LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian", target_modules=TARGETS)
    torch.manual_seed(0)
    added = copy.deepcopy(base)
    added.add_adapter(config)  # diffusers' way: keys without a prefix, adapter "default"
    factors = get_peft_model_state_dict(added)
    policy = registry.load_lora("tiny-sd3", factors, _wire(config))
    assert policy.components["transformer"] != served.base_components["transformer"]
    assert current_components(_with(served, transformer=added))["transformer"] == policy.components["transformer"]
    assert current_digest(served) == policy.digest  # the server's own peft-placed transformer
    # peft's own wrapper (`base_model.model.` keys), the same factors: the same digest
    wrapped = get_peft_model(copy.deepcopy(base), config)
    wrapped.load_state_dict({f"base_model.model.{k}": v for k, v in added.state_dict().items()}, strict=False)
    assert current_components(_with(served, transformer=wrapped))["transformer"] == policy.components["transformer"]
    # the config is part of it: another lora_alpha scales the same factors otherwise
    other = copy.deepcopy(base)
    other.add_adapter(LoraConfig(r=2, lora_alpha=8, init_lora_weights="gaussian", target_modules=TARGETS))
    other.load_state_dict(added.state_dict())
    assert current_components(_with(served, transformer=other))["transformer"] != policy.components["transformer"]
