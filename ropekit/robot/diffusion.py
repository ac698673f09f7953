"""DDPM training and DDIM sampling for action chunks: a small scheduler with a functional core.

Shape legend: ``B`` batch, ``H`` chunk length (future steps), ``A`` action dimension, ``T`` training
timesteps, ``S`` sampling steps (``S <= T``).

Forward process (DDPM, Ho et al. 2020) with the cosine ("squaredcos_cap_v2") schedule of Nichol & Dhariwal::

    x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps,   eps ~ N(0, I),   t in {0, ..., T - 1}

The denoiser predicts either ``eps`` (``prediction="epsilon"``) or ``x_0`` (``"sample"``); the training
target is that quantity (plain MSE). Sampling is deterministic DDIM (Song et al. 2021, eta = 0) over ``S``
evenly spaced timesteps, with the ``x_0`` estimate clipped to ``[-clip, clip]`` (the action normaliser maps
the demonstrations into ``[-1, 1]``). Everything here runs in float32.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor, nn

__all__ = ["PREDICTIONS", "cosine_alphas_cumprod", "add_noise", "ddim_timesteps", "ddim_step", "DiffusionSchedule",
           "timestep_embedding"]

PREDICTIONS = ("epsilon", "sample")

#: ``denoise(x_t (B, H, A), t (B,) long) -> prediction (B, H, A)``
DenoiseFn = Callable[[Tensor, Tensor], Tensor]


def cosine_alphas_cumprod(num_steps: int, s: float = 0.008, max_beta: float = 0.999) -> Tensor:
    """``abar_t`` of the cosine schedule, ``(T,)`` float64, with each ``beta_t`` capped at ``max_beta``."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")

    def f(t: float) -> float:
        return math.cos((t / num_steps + s) / (1 + s) * math.pi / 2) ** 2

    betas = torch.tensor([min(1 - f(i + 1) / f(i), max_beta) for i in range(num_steps)], dtype=torch.float64)
    return torch.cumprod(1.0 - betas, dim=0)


def _gather(abar: Tensor, t: Tensor, like: Tensor) -> Tensor:
    """``abar[t]`` broadcast against ``like``: ``(B,) -> (B, 1, ..., 1)``."""
    return abar.to(like.dtype)[t].reshape(-1, *([1] * (like.dim() - 1)))


def add_noise(x0: Tensor, noise: Tensor, t: Tensor, alphas_cumprod: Tensor) -> Tensor:
    """``x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise``; ``x0, noise`` ``(B, ...)``, ``t`` ``(B,)`` long."""
    a = _gather(alphas_cumprod, t, x0)  # (B, 1, 1)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def ddim_timesteps(num_train_steps: int, num_steps: int) -> List[int]:
    """``S`` evenly spaced timesteps, descending, from ``T - 1`` (``"trailing"`` spacing) down to ``>= 0``."""
    if not 1 <= num_steps <= num_train_steps:
        raise ValueError(f"num_steps must be in [1, {num_train_steps}], got {num_steps}")
    ratio = num_train_steps / num_steps
    return [int(round(num_train_steps - i * ratio)) - 1 for i in range(num_steps)]


def ddim_step(x_t: Tensor, model_out: Tensor, t: int, t_prev: int, alphas_cumprod: Tensor,
              prediction: str = "epsilon", clip: Optional[float] = 1.0) -> Tensor:
    """One deterministic DDIM update ``x_t -> x_{t_prev}`` (``t_prev = -1``: return the ``x_0`` estimate)."""
    a_t = alphas_cumprod[t].to(x_t.dtype)
    if prediction == "epsilon":
        x0 = (x_t - (1 - a_t).sqrt() * model_out) / a_t.sqrt()
    elif prediction == "sample":
        x0 = model_out
    else:
        raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
    if clip is not None:
        x0 = x0.clamp(-clip, clip)
    if t_prev < 0:
        return x0
    eps = (x_t - a_t.sqrt() * x0) / (1 - a_t).sqrt()  # re-derived after clipping
    a_prev = alphas_cumprod[t_prev].to(x_t.dtype)
    return a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps


class DiffusionSchedule(nn.Module):
    """The noise schedule as a module (its table is a non-persistent buffer: derived, never checkpointed).

    Args:
        num_train_steps: ``T``.
        prediction: ``"epsilon"`` or ``"sample"`` -- what the denoiser outputs.
        clip: bound of the ``x_0`` estimate while sampling (``None``: no clipping).
    """

    def __init__(self, num_train_steps: int = 100, prediction: str = "epsilon", clip: Optional[float] = 1.0) -> None:
        super().__init__()
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
        self.num_train_steps = int(num_train_steps)
        self.prediction = prediction
        self.clip = clip
        self.register_buffer("alphas_cumprod", cosine_alphas_cumprod(num_train_steps).float(), persistent=False)

    def training_pair(self, x0: Tensor, generator: Optional[torch.Generator] = None):
        """Random ``t (B,)``, the noisy ``x_t`` and the regression ``target`` (``eps`` or ``x0``) for ``x0``."""
        t = torch.randint(0, self.num_train_steps, (x0.shape[0],), generator=generator, device=x0.device)
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        x_t = add_noise(x0, noise, t, self.alphas_cumprod)
        return t, x_t, (noise if self.prediction == "epsilon" else x0)

    @torch.no_grad()
    def sample(self, denoise: DenoiseFn, shape: Sequence[int], num_steps: int,
               generator: Optional[torch.Generator] = None, device=None) -> Tensor:
        """DDIM from pure noise with ``num_steps`` denoiser calls: ``(B, H, A)`` in normalised units."""
        x = torch.randn(tuple(shape), generator=generator, device=device)
        steps = ddim_timesteps(self.num_train_steps, num_steps)
        for i, t in enumerate(steps):
            t_prev = steps[i + 1] if i + 1 < len(steps) else -1
            tt = torch.full((shape[0],), t, dtype=torch.long, device=x.device)
            x = ddim_step(x, denoise(x, tt), t, t_prev, self.alphas_cumprod, self.prediction, self.clip)
        return x

    def extra_repr(self) -> str:
        return f"T={self.num_train_steps}, prediction={self.prediction}, clip={self.clip}"


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding of integer timesteps: ``(B,) -> (B, dim)`` float32 (``dim`` even)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]  # (B, dim/2)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
