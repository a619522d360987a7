"""The float32 model the support contract makes its structural decision on (`support.check_support`).

Whether the engine serves an architecture exactly is decided in float32, at the float32 tolerance, whatever dtype the
run uses, so that a 16-bit run is not accepted by the looser rounding bound of its own comparison
(`exactness.rounding_bound`). `float32_reference(model)` returns the model to decide on, most faithful first:

1. the model itself, with autocast turned off around it, when its parameters are float32 (TRL's `bf16=True` on
   float32 weights): no copy, its own weights and modules (adapters, patched layers) are checked;
2. a float32 copy on the CPU, when its parameters are 16-bit or its forward turns autocast on by itself (as
   accelerate's mixed-precision wrapper on `forward` does: the copy runs its class's `forward`), it lives on the
   CPU and it has at most `FLOAT32_COPY_MAX_PARAMS` parameters (4 bytes each);
3. otherwise (16-bit weights on an accelerator or too large to copy) a replica: the same model class built from a copy of its config
   with every size field shrunk (`shrink_config(keep_layers=True)`: hidden 32, 4 query / 2 KV heads, head dim 8,
   vocabulary 96, 4 experts, small ranks; windows above 6 capped at 6 so the probe sees them) and every structural
   field kept (the number of layers and `layer_types`, chunk sizes, rope parameters, position scheme), random
   float32 weights on the CPU. A replica sees what the config and the class decide, not changes made to the
   model's modules; those are then left to the 16-bit check.

If none can be built, `Float32ReferenceError` says why; the contract refuses the model with that reason (and the
way to run it: float32 weights, with or without autocast, are always checked directly).
"""

from __future__ import annotations

import copy

import torch

from trl_infinite.engine.config.inputs import text_config

FLOAT32_COPY_MAX_PARAMS = 1_000_000_000  # 4 GB of float32 on the CPU
REPLICA_MAX_PARAMS = 20_000_000
REPLICA_VOCAB = 96
# Generic shrinking of integer size fields by name: in order, the first rule that matches sets an upper bound
# (0: left alone). Shared with `trl_infinite.testing.tiny_configs` (model types new in a transformers release).
SHRINK_RULES: tuple[tuple[tuple[str, ...], int], ...] = (
    (("token_id", "position", "extent", "floor", "seed"), 0),  # ids and positions: left alone
    (("rank",), 16),
    (("vocab",), REPLICA_VOCAB),
    (("experts_per_tok", "topk", "top_k", "moe_k"), 2),
    (("key_value_heads", "kv_heads"), 2),
    (("heads",), 4),
    (("experts",), 4),
    (("layers",), 2),
    (("window",), 6),
    (("head_dim", "head_size"), 8),
    (("hidden_size", "embed_dim", "d_model", "n_embd"), 32),
    (("intermediate", "ffn", "inner", "channels", "_dim", "_size"), 64),
)
# The second try where the first replica's own forward fails (fields derived from head widths, e.g. multi-head latent
# attention's `qk_head_dim` = nope + rope): head widths and the K/V head count left as they are (at most 4 heads).
KEEP_HEAD_SHAPES: tuple[tuple[tuple[str, ...], int], ...] = (
    (("head_dim", "head_size", "key_value_heads", "kv_heads"), 0),
    *((keys, 4 if keys == ("heads",) else bound) for keys, bound in SHRINK_RULES),
)


class Float32ReferenceError(ValueError):
    """No float32 model to make the structural decision on could be built (the message says why)."""


def _shrink_value(name: str, value, keep_layers: bool, rules=SHRINK_RULES):
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    for keys, bound in rules:
        if any(k in name for k in keys):
            if bound == 0 or (keep_layers and keys == ("layers",)):
                return value
            return min(value, bound)
    return value


def _shrink_dict(d: dict, keep_layers: bool, rules=SHRINK_RULES) -> dict:
    return {name: _shrink_dict(value, keep_layers, rules) if isinstance(value, dict) else
            _shrink_value(name, value, keep_layers, rules) for name, value in d.items()}


def _ids_in_vocab(d: dict) -> dict:
    """Token ids (`pad_token_id`, `eos_token_id`, ...: ints or lists) at or past a shrunk `vocab_size` moved to its
    last id, sub-configs included: the replica's embedding would refuse a padding row outside it (a Qwen3 config's
    pad id 151643 in a vocabulary of 96); which row pads does not change the structure."""
    vocab = d.get("vocab_size")
    out = {}
    for name, value in d.items():
        if isinstance(value, dict):
            value = _ids_in_vocab(value)
        elif isinstance(vocab, int) and "token_id" in name:
            fix = lambda i: vocab - 1 if isinstance(i, int) and not isinstance(i, bool) and i >= vocab else i  # noqa: E731
            value = [fix(i) for i in value] if isinstance(value, list) else fix(value)
        out[name] = value
    return out


def shrink_config(config, keep_layers: bool = False, rules=SHRINK_RULES):
    """`config` with every integer size field whose name says it is a vocabulary, head count, layer count (unless
    `keep_layers`), expert count, window or width capped at the tiny sizes (`SHRINK_RULES`), sub-configs included,
    token ids moved inside the shrunk vocabulary (`_ids_in_vocab`), rebuilt through the config class so that its
    `__post_init__` derives the rest."""
    data = config.to_dict()
    for key in ("transformers_version", "architectures", "_name_or_path"):
        data.pop(key, None)
    return type(config).from_dict(_ids_in_vocab(_shrink_dict(data, keep_layers, rules)))


def replica(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight float32 model of `model`'s class and structure on the CPU, in eval mode (see the module
    docstring), whose own forward runs; `Float32ReferenceError` if none can be built (the first reason)."""
    errors = []
    for rules in (SHRINK_RULES, KEEP_HEAD_SHAPES):
        try:
            return _replica(model, seed, rules)
        except Float32ReferenceError as err:
            errors.append(err)
    raise errors[0]


def _replica(model: torch.nn.Module, seed: int, rules) -> torch.nn.Module:
    base = getattr(model, "get_base_model", None)  # the transformers model under a PEFT wrapper (built from config)
    inner = base() if callable(base) else model
    try:
        config = shrink_config(inner.config, keep_layers=True, rules=rules)
        with torch.device("meta"):
            n = sum(p.numel() for p in type(inner)(config).parameters())
        if n > REPLICA_MAX_PARAMS:
            raise Float32ReferenceError(f"its float32 replica would have {n} parameters (> {REPLICA_MAX_PARAMS})")
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            built = type(inner)(config).float().eval()
            impl = getattr(inner.config, "_attn_implementation", None)
            if impl in ("eager", "sdpa"):
                built.config._attn_implementation_internal = impl
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                built(input_ids=torch.arange(1, 9)[None] % text_config(built).vocab_size,
                      use_cache=False)
    except Float32ReferenceError:
        raise
    except Exception as exc:  # noqa: BLE001  (any failure of the config or model class)
        raise Float32ReferenceError(f"a float32 replica of it cannot be built from its config "
                                    f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]})") from exc
    return built


def float32_reference(model: torch.nn.Module, forces_autocast: bool) -> tuple[torch.nn.Module, str]:
    """(the float32 model to decide on, how it was obtained: for messages). `forces_autocast`: the model's forward
    turns autocast on by itself (accelerate's mixed-precision wrapper), so it cannot be run in float32 as it is."""
    params = list(model.parameters())
    dtypes = {p.dtype for p in params}
    if dtypes <= {torch.float32, torch.float64} and not forces_autocast:
        return model, "its own float32 weights"
    if all(p.device.type == "cpu" for p in params) and sum(p.numel() for p in params) <= FLOAT32_COPY_MAX_PARAMS:
        return _plain_copy(model).float(), "a float32 copy of its weights"
    return replica(model), "a float32 replica built from its config (random weights)"


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy whose modules run their class's `forward`: a wrapper set on an instance (accelerate's autocast
    wrapper, which closes over the original model) would run the original, under autocast."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        m.__dict__.pop("forward", None)
    return twin
