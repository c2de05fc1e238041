"""LoRA adapters on a model's transformer (registry side).

References: the stock base model (a separate registry), and a trainer's own peft-wrapped
transformer built with `peft.get_peft_model` or diffusers' `add_adapter` from the same base
weights, replayed with sigmaflight.pipeline.replay.Replayer over the trainer's pipeline.
"""

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from sigmaflight.pipeline.models import LoadedModel, LoraNotLoaded, ModelRegistry
from sigmaflight.pipeline.replay import Replayer
from sigmaflight.pipeline.rollout import run_rollout
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec, SamplerSpec

# Flow-GRPO's LoRA targets for SD3 (its SD3 training script wraps these with get_peft_model, r=32, alpha=64)
TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
           "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]
SPEC = RolloutSpec(model="tiny-sd3", prompts=("a cat", "the dog"), num_outputs_per_prompt=2, num_inference_steps=3,
                   guidance_scale=4.5, seed=11, sampler=SamplerSpec(type="sde", noise_level=0.7))


def _config(r: int = 4) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights="gaussian", target_modules=TARGETS)


def _wire(config: LoraConfig) -> dict:
    """The config as a trainer sends it: to_dict() through JSON."""
    return json.loads(json.dumps(config.to_dict(), default=sorted))


def _trainer(base_transformer, how: str, r: int = 4, seed: int = 0):
    """A trainer's peft-wrapped transformer with non-zero factors, and its adapter state dict."""
    config = _config(r)
    if how == "get_peft_model":
        wrapped = get_peft_model(copy.deepcopy(base_transformer), config)
    else:
        wrapped = copy.deepcopy(base_transformer)
        wrapped.add_adapter(config)
    g = torch.Generator().manual_seed(seed)
    state = {k: 0.3 * torch.randn(v.shape, generator=g) for k, v in get_peft_model_state_dict(wrapped).items()}
    set_peft_model_state_dict(wrapped, state)
    wrapped.eval()
    return wrapped, get_peft_model_state_dict(wrapped), config


def base_model_modules():
    return ModelRegistry().get("tiny-sd3").pipeline.transformer.named_modules()


def _rollout(model):
    res = run_rollout(model, SPEC)
    return res, torch.stack([c.latent for c in res.captures], dim=1)  # [B, K, ...]


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_flow_grpo_targets_change_the_trajectory_and_digest_and_unload_restores_the_base():
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    base_res, base_lat = _rollout(ModelRegistry().get("tiny-sd3"))  # the base, from another build
    base_digest = model.digest
    _, adapter, config = _trainer(model.pipeline.transformer, "add_adapter")
    put = reg.load_lora("tiny-sd3", adapter, _wire(config))
    assert put.weights_version == 1 and put.digest != base_digest and put.base_digest == base_digest
    assert put.lora is not None and put.lora.rank == 4 and len(put.lora.tensors) == len(adapter)
    lora_layers = {n for n, m in model.pipeline.transformer.named_modules() if isinstance(m, LoraLayer)}
    # every module the targets name is wrapped (tiny-sd3's one block is context_pre_only: it has no to_add_out)
    targeted = {n for n, _ in base_model_modules() if any(n.endswith("." + t) for t in TARGETS)}
    assert lora_layers == targeted and {t for t in TARGETS if any(n.endswith("." + t) for n in targeted)} == set(
        TARGETS) - {"attn.to_add_out"}
    lora_res, lora_lat = _rollout(model)
    assert lora_res.digest == put.digest
    assert not torch.equal(lora_lat, base_lat) and not torch.equal(lora_res.log_probs, base_res.log_probs)
    row = next(r for r in reg.describe() if r["id"] == "tiny-sd3")
    assert row["digest"] == put.digest and row["weights_version"] == 1 and row["lora"]["r"] == 4

    gone = reg.unload_lora("tiny-sd3")
    assert gone.weights_version == 2 and gone.digest == base_digest and gone.lora is None
    back_res, back_lat = _rollout(model)
    assert back_res.digest == base_digest
    assert torch.equal(back_lat, base_lat) and _same(back_res.log_probs, base_res.log_probs)
    assert torch.equal(back_res.final_latents, base_res.final_latents)
    with pytest.raises(LoraNotLoaded):
        reg.unload_lora("tiny-sd3")
    assert model.weights_version == 2


def test_digest_is_deterministic_with_or_without_the_peft_prefix():
    base = ModelRegistry().get("tiny-sd3").pipeline.transformer
    _, plain, config = _trainer(base, "add_adapter")
    _, prefixed, _ = _trainer(base, "get_peft_model")
    assert all(k.startswith("base_model.model.") for k in prefixed)
    digests = []
    for tensors in (plain, prefixed, plain):
        reg = ModelRegistry()
        digests.append(reg.load_lora("tiny-sd3", tensors, _wire(config)).digest)
    assert digests[0] == digests[1] == digests[2]
    reg = ModelRegistry()
    _, other, _ = _trainer(base, "add_adapter", seed=1)
    assert reg.load_lora("tiny-sd3", other, _wire(config)).digest != digests[0]
    # a second put replaces the first adapter (not stacked): the same digest as a fresh put
    assert reg.load_lora("tiny-sd3", plain, _wire(config)).digest == digests[0]
    assert reg.get("tiny-sd3").weights_version == 2


@pytest.mark.parametrize("how", ["get_peft_model", "add_adapter"])
def test_a_trainers_peft_transformer_replays_the_rollout_bit_for_bit(how):
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    trainer_base = ModelRegistry().get("tiny-sd3")  # the trainer's own copy of the base weights
    wrapped, adapter, config = _trainer(trainer_base.pipeline.transformer, how)
    reg.load_lora("tiny-sd3", adapter, _wire(config))
    res, lat = _rollout(model)
    assert torch.isfinite(res.log_probs).all()
    pipe = trainer_base.pipeline
    trainer_pipe = type(pipe)(**{**pipe.components, "transformer": wrapped})
    trainer_pipe.set_progress_bar_config(disable=True)
    trainer = LoadedModel(id="tiny-sd3", family="sd3", pipeline=trainer_pipe, device=trainer_base.device,
                          dtype=trainer_base.dtype, digest="trainer", defaults=trainer_base.defaults)
    replayed = Replayer(trainer).log_probs(SPEC, latents=lat, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                           timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert torch.equal(replayed, res.log_probs)
    # and the base does not replay it: the adapter is really in the rollout
    plain = Replayer(trainer_base).log_probs(SPEC, latents=lat, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                             timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert not torch.equal(plain, res.log_probs)


def test_a_running_rollout_keeps_the_weights_it_started_with():
    reference, _ = _rollout(ModelRegistry().get("tiny-sd3"))
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    _, adapter, config = _trainer(model.pipeline.transformer, "add_adapter")
    puts = []

    def put_mid_rollout(step: int, total: int) -> None:
        if step == 1:
            puts.append(reg.load_lora("tiny-sd3", adapter, _wire(config)))

    during = run_rollout(model, SPEC, on_progress=put_mid_rollout)
    assert puts and during.digest == reference.digest
    assert torch.equal(during.final_latents, reference.final_latents)
    assert run_rollout(model, SPEC).digest == puts[0].digest


def test_a_full_push_replaces_the_adapter_too():
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    base_state = model.pipeline.transformer.state_dict()
    _, adapter, config = _trainer(model.pipeline.transformer, "add_adapter")
    reg.load_lora("tiny-sd3", adapter, _wire(config))
    pushed = reg.replace_weights("tiny-sd3", {k: v + 0.01 for k, v in base_state.items()})
    assert pushed.lora is None and pushed.weights_version == 2 and pushed.digest == pushed.base_digest
    assert set(model.pipeline.transformer.state_dict()) == set(base_state)


def _adapter_and_config():
    base = ModelRegistry().get("tiny-sd3").pipeline.transformer
    _, adapter, config = _trainer(base, "add_adapter")
    return dict(adapter), _wire(config)


A = "transformer_blocks.0.attn.to_q.lora_A.weight"
B = "transformer_blocks.0.attn.to_q.lora_B.weight"


def _bad_cases():
    def unknown_module(t, c):
        t["transformer_blocks.0.attn.to_zz.lora_A.weight"] = t[A].clone()
        return "transformer_blocks.0.attn.to_zz.lora_A.weight", "unknown target module"

    def untargeted_module(t, c):
        t["proj_out.lora_A.weight"] = torch.zeros(4, 16)
        return "proj_out.lora_A.weight", "not a target"

    def wrong_rank(t, c):
        t[A] = torch.zeros(8, t[A].shape[1])
        return A, "rank 4"

    def wrong_shape(t, c):
        t[B] = torch.zeros(t[B].shape[0] + 1, 4)
        return B, "does not fit"

    def nan(t, c):
        t[A] = t[A].clone()
        t[A][0, 0] = float("nan")
        return A, "NaN"

    def inf(t, c):
        t[B] = torch.full_like(t[B], float("inf"))
        return B, "infinite"

    def integer(t, c):
        t[A] = t[A].to(torch.int32)
        return A, "floating-point"

    def not_lora(t, c):
        t["transformer_blocks.0.attn.to_q.weight"] = torch.zeros(16, 16)
        return "transformer_blocks.0.attn.to_q.weight", "not a LoRA tensor"

    def missing_factor(t, c):
        del t[B]
        return B, "missing"

    def not_a_tensor(t, c):
        t[A] = [1.0, 2.0]
        return A, "not a tensor"

    return [unknown_module, untargeted_module, wrong_rank, wrong_shape, nan, inf, integer, not_lora, missing_factor,
            not_a_tensor]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda f: f.__name__)
def test_bad_tensors_are_refused_naming_the_key(registry, case):
    tensors, config = _adapter_and_config()
    key, reason = case(tensors, config)
    model = registry.get("tiny-sd3")
    before = model.policy()
    with pytest.raises(RolloutInputError) as err:
        registry.load_lora("tiny-sd3", tensors, config)
    assert err.value.field == key and reason in err.value.reason, str(err.value)
    after = model.policy()
    assert after.pipeline is before.pipeline and after.weights_version == before.weights_version


@pytest.mark.parametrize(
    "config, field",
    [
        (None, "lora_config"),
        ("r=4", "lora_config"),
        ({"lora_alpha": 8, "target_modules": TARGETS}, "lora_config.r"),
        ({"r": 0, "target_modules": TARGETS}, "lora_config.r"),
        ({"r": 4}, "lora_config.target_modules"),
        ({"r": 4, "target_modules": []}, "lora_config.target_modules"),
        ({"r": 4, "target_modules": ["attn.nothing_here"]}, "lora_config.target_modules"),
        ({"r": 4, "target_modules": TARGETS, "use_dora": True}, "lora_config.use_dora"),
        ({"r": 4, "target_modules": TARGETS, "modules_to_save": ["proj_out"]}, "lora_config.modules_to_save"),
        ({"r": 4, "target_modules": TARGETS, "no_such_field": 1}, "lora_config.no_such_field"),
        ({"r": 4, "target_modules": TARGETS, "peft_type": "LOHA"}, "lora_config.peft_type"),
        ({"r": 4, "target_modules": TARGETS, "lora_dropout": 2.0}, "lora_config.lora_dropout"),
    ],
)
def test_bad_lora_config_is_refused_naming_the_field(registry, config, field):
    tensors, _ = _adapter_and_config()
    with pytest.raises(RolloutInputError) as err:
        registry.load_lora("tiny-sd3", tensors, config)
    assert err.value.field == field, str(err.value)


def test_empty_adapter_is_refused(registry):
    _, config = _adapter_and_config()
    with pytest.raises(RolloutInputError) as err:
        registry.load_lora("tiny-sd3", {}, config)
    assert err.value.field == "tensors"


def test_all_flow_grpo_targets_are_wrapped_where_the_model_has_them():
    reg = ModelRegistry()
    model = reg.get("small-sd3")  # six blocks: all but the last have the context branch's to_add_out
    _, adapter, config = _trainer(model.pipeline.transformer, "add_adapter", r=2)
    reg.load_lora("small-sd3", adapter, _wire(config))
    lora_layers = {n for n, m in model.pipeline.transformer.named_modules() if isinstance(m, LoraLayer)}
    assert {t for t in TARGETS if any(n.endswith("." + t) for n in lora_layers)} == set(TARGETS)


def test_bf16_model_and_per_sample_calls_run_with_an_adapter():
    reg = ModelRegistry(dtype=torch.bfloat16)
    model = reg.get("tiny-sd3")
    _, adapter, config = _trainer(ModelRegistry().get("tiny-sd3").pipeline.transformer, "add_adapter")
    reg.load_lora("tiny-sd3", adapter, _wire(config))  # float32 factors, cast to the model's bf16
    lora_params = [p for n, p in model.pipeline.transformer.named_parameters() if "lora_" in n]
    assert lora_params and all(p.dtype == torch.bfloat16 for p in lora_params)
    batched = run_rollout(model, SPEC)
    row_by_row = run_rollout(model, SPEC, per_sample_model_calls=True)
    assert torch.isfinite(batched.log_probs).all() and torch.isfinite(row_by_row.log_probs).all()
    assert batched.digest == row_by_row.digest == model.digest
