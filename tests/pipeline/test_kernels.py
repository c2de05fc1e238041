import math

import pytest
import torch

from pipeline.kernels import kernel_mean_std, step_log_prob
from pipeline.spec import SamplerSpec

SIGMAS = torch.tensor([1.0, 0.9, 0.6, 0.25, 0.0], dtype=torch.float32)


def _reference_mean_std(x, v, i, sampler):
    """Independent float64 implementation of the field-notes formulas."""
    x, v = x.double(), v.double()
    s, s1 = float(SIGMAS[i]), float(SIGMAS[i + 1])
    a = sampler.noise_level
    if sampler.type == "sde":
        dt = s1 - s
        ss = float(SIGMAS[1]) if s == 1 else s
        std_t = math.sqrt(ss / (1 - ss)) * a
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        return mean, std_t * math.sqrt(-dt)
    std = s1 * math.sin(a * math.pi / 2)
    mean = (x - s * v) * (1 - s1) + (x + (1 - s) * v) * math.sqrt(s1**2 - std**2)
    return mean, std


@pytest.mark.parametrize("kind", ["sde", "cps"])
@pytest.mark.parametrize("i", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_prob_matches_reference_gaussian(kind, i, dtype):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(3, 4, 5, 6, generator=g).to(dtype)
    v = torch.randn(3, 4, 5, 6, generator=g).to(dtype)
    sampler = SamplerSpec(type=kind, noise_level=0.7)
    ref_mean, ref_std = _reference_mean_std(x, v, i, sampler)
    x_next = (ref_mean + ref_std * torch.randn(x.shape, generator=g, dtype=torch.float64)).to(dtype)
    ref = torch.distributions.Normal(ref_mean, ref_std).log_prob(x_next.double()).mean(dim=(1, 2, 3))
    got = step_log_prob(x, x_next, v, SIGMAS, i, sampler=sampler)
    assert got.dtype == torch.float32 and got.shape == (3,)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)

    mean, std = kernel_mean_std(x, v, SIGMAS, i, sampler=sampler)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)

    no_const = step_log_prob(x, x_next, v, SIGMAS, i, sampler=SamplerSpec(type=kind, log_prob="no_const"))
    ref_nc = (-((x_next.double() - ref_mean) ** 2) / (2 * ref_std**2)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(no_const.double(), ref_nc, rtol=1e-4, atol=1e-4)


def test_log_prob_is_a_mean_not_a_sum():
    x = torch.zeros(1, 2, 8, 8)
    v = torch.zeros(1, 2, 8, 8)
    sampler = SamplerSpec(type="sde", noise_level=0.7, log_prob="no_const")
    small = step_log_prob(x, torch.ones(1, 2, 8, 8), v, SIGMAS, 1, sampler=sampler)
    big = step_log_prob(torch.zeros(1, 2, 16, 16), torch.ones(1, 2, 16, 16), torch.zeros(1, 2, 16, 16), SIGMAS, 1, sampler=sampler)
    torch.testing.assert_close(small, big)


def test_noise_level_zero_sde_mean_is_euler():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    mean, std = kernel_mean_std(x, v, SIGMAS, 2, sampler=SamplerSpec(type="sde", noise_level=0.0))
    assert float(std) == 0.0
    torch.testing.assert_close(mean, x + (SIGMAS[3] - SIGMAS[2]) * v)
