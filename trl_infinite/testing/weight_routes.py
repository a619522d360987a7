"""Every way a test changes a model's weights between two engine calls (issue 40: the cache cannot go stale).

`ROUTES[name](model, seed)` changes the weights of `model` in place, deterministically from `seed`, by one route;
`SEEN[name]` says whether the engine's fingerprint alone notices it (`engine/runner/weight_state.py`: an address, a version
counter, a `load_state_dict`, PEFT's adapter state). The routes it cannot notice are what `kv_cache_reuse_across_calls`
leaves to the caller's `RolloutEngine.reset_prefix_cache()`. The LoRA routes need a PEFT model from `lora_model`
(two adapters, 'default' active).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Route = Callable[[nn.Module, int], None]


def _noise(p: torch.Tensor, seed: int, scale: float = 0.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype)


def _step(optimizer_cls, **kw) -> Route:
    """One optimizer step on random gradients (every trainable parameter; none, e.g. LoRA adapters disabled by
    `lora_toggle`, whose parameters then stop requiring grad: no step, as a trainer's step changes nothing then)."""

    def route(model: nn.Module, seed: int) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return
        for i, p in enumerate(params):
            p.grad = _noise(p, seed + i, 1.0)
        optimizer_cls(params, **kw).step()
        for p in params:
            p.grad = None

    return route


def _data_copy(model: nn.Module, seed: int) -> None:
    """`p.data.copy_(...)`: the `.data` view has its own version counter."""
    for i, p in enumerate(model.parameters()):
        p.data.copy_(p.data + _noise(p, seed + i))


def _foreach_add(model: nn.Module, seed: int) -> None:
    """`torch._foreach_add_` under `no_grad` (what foreach optimizers run): bumps the version counters."""
    params = list(model.parameters())
    with torch.no_grad():
        torch._foreach_add_(params, [_noise(p, seed + i) for i, p in enumerate(params)])


def _inplace(model: nn.Module, seed: int) -> None:
    """`p.mul_` / `p.add_` on the Parameter under `no_grad`: bumps the version counters."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.mul_(0.8).add_(_noise(p, seed + i))


def inference_params(model: nn.Module) -> nn.Module:
    """Replace every Parameter of `model` by one made under `torch.inference_mode()` (an inference tensor: no version
    counter), as a model built or loaded there has."""
    with torch.inference_mode():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = nn.Parameter(p.detach().clone(), requires_grad=False)
    return model


def _inference_copy(model: nn.Module, seed: int) -> None:
    """In-place copy into inference tensors inside `inference_mode` (no version counter, no `load_state_dict`)."""
    if not next(model.parameters()).is_inference():
        inference_params(model)
    with torch.inference_mode():
        for i, p in enumerate(model.parameters()):
            p.copy_(p + _noise(p, seed + i))


def _inference_load(model: nn.Module, seed: int) -> None:
    """`load_state_dict` into inference tensors inside `inference_mode`: no version counter moves (the engine sees the
    `load_state_dict`)."""
    if not next(model.parameters()).is_inference():
        inference_params(model)
    state = {k: v + _noise(v, seed + i) if v.is_floating_point() else v
             for i, (k, v) in enumerate(model.state_dict().items())}
    with torch.inference_mode():
        model.load_state_dict(state)


def lora_model(model: nn.Module) -> nn.Module:
    """`model` with two LoRA adapters ('default', active, and 'b') on every attention projection, random (not the
    identity), in eval mode."""
    import peft

    def config():
        return peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0,
                               init_lora_weights=False)

    out = peft.get_peft_model(model, config())
    out.add_adapter("b", config())
    return out.eval()


def _lora_toggle(model: nn.Module, seed: int) -> None:
    """`disable_adapter_layers()` / `enable_adapter_layers()`: no parameter changes."""
    layer = next(m for m in model.modules() if hasattr(m, "merged_adapters"))
    if layer.disable_adapters:
        model.enable_adapter_layers()
    else:
        model.disable_adapter_layers()


def _lora_switch(model: nn.Module, seed: int) -> None:
    """`set_adapter` to the other adapter: no parameter changes."""
    model.set_adapter("b" if model.active_adapter == "default" else "default")


ROUTES: dict[str, Route] = {
    "adamw_fused": _step(torch.optim.AdamW, lr=0.5, fused=True),
    "adamw_foreach": _step(torch.optim.AdamW, lr=0.5, foreach=True), "sgd": _step(torch.optim.SGD, lr=0.5),
    "data_copy": _data_copy, "foreach_add": _foreach_add, "inplace": _inplace, "inference_copy": _inference_copy,
    "inference_load": _inference_load, "lora_toggle": _lora_toggle, "lora_switch": _lora_switch,
}
SEEN = {"adamw_fused": False, "adamw_foreach": True, "sgd": True, "data_copy": False, "foreach_add": True,
        "inplace": True, "inference_copy": False, "inference_load": True, "lora_toggle": True, "lora_switch": True}
# routes that can follow each other on one model: a plain trainable model, one with inference-tensor parameters
# (made by the first of its routes), a LoRA model (`lora_model`: the optimizers step its adapters)
FAMILIES = {
    "train": ("adamw_fused", "adamw_foreach", "sgd", "data_copy", "foreach_add", "inplace"),
    "inference": ("inference_copy", "inference_load"),
    "lora": ("lora_toggle", "lora_switch", "adamw_fused", "data_copy"),
}
LORA_ROUTES = ("lora_toggle", "lora_switch")  # these need a LoRA model
