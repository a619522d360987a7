"""A draft model is checked like the target, once, when the engine is built (`Speculator`):

1. **its own state**: the engine routes a model's attention through the pool by switching its configs'
   `_attn_implementation` for the duration of a forward (`attention.paged_attention`). A draft built on the
   target's config object (`LlamaForCausalLM(target.config)`) would share that switch: under decoupled speculation
   the drafter thread and the verifier switch and restore the one config at once, and the target is left routed to
   the paged attention after the call. The draft's modules get their own deep copy of every config object they share
   with the target (`own_configs`); a draft sharing a module that holds such a config (an attention layer of the
   target itself) is refused, since no copy can separate them (a draft that *is* the target is allowed with coupled
   speculation only, where nothing runs at once: `Speculator.begin`);
2. **its vocabulary** (`check_vocabulary`): every id the draft can propose (its logits' width) must be a target id,
   and the same id must mean the same token: the special ids both configs set (EOS, BOS, PAD) must agree, and where
   tokenizers are given their vocabularies must map each proposable id to the same string. The draft may have fewer
   input rows than the target (Qwen2.5-0.5B's 151,936 against Qwen2.5-7B's 152,064 padded rows): a sample whose
   context holds an id the draft cannot read gets no drafts from then on (`DraftModelDrafter`, lossless);
3. **its support contract** (`support.check_support`, as the target's) and **its KV pool inside the engine's budget**
   (`draft_block_bytes`: a byte budget pays for both pools' blocks, see docs/speculative.md).

Each failure is a `ValueError` naming `speculative_draft_model` and what differs, with both values.
"""

from __future__ import annotations

import copy

import torch

from trl_infinite.engine.config.inputs import model_vocab_size, text_config
from trl_infinite.engine.model.support import ModelSupport

SPECIAL_IDS = ("eos_token_id", "bos_token_id", "pad_token_id")


def _config_holders(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Modules of `model` that hold a config with an attention implementation, by id."""
    return {id(m): m for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}


def own_configs(draft: torch.nn.Module, target: torch.nn.Module) -> None:
    """Give the draft's modules their own deep copy of every config object they share with the target (one copy per
    shared object, sub-configs kept linked); refuse a draft that shares a config-holding module with the target. A
    draft that is the target is left as it is."""
    if draft is target:
        return
    target_holders = _config_holders(target)
    shared_modules = [m for i, m in _config_holders(draft).items() if i in target_holders]
    if shared_modules:
        raise ValueError(f"`speculative_draft_model` shares {len(shared_modules)} module(s) with the target (e.g. a "
                         f"{type(shared_modules[0]).__name__}) whose config selects their attention: the engine "
                         "switches that config while each model runs, so the two cannot have their own. Build the "
                         "draft from its own modules (shared embeddings or heads without a config are fine).")
    target_configs = {id(m.config) for m in target_holders.values()}
    memo: dict = {}
    copies: dict[int, object] = {}
    for m in draft.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) in target_configs:
            if id(cfg) not in copies:
                copies[id(cfg)] = copy.deepcopy(cfg, memo)
            m.config = copies[id(cfg)]


def proposable_ids(model: torch.nn.Module) -> int:
    """Width of the model's logits (the ids it can propose): its output embedding's rows, else its vocab size."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows = getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    return int(text_config(model).vocab_size)


def _special_id(model: torch.nn.Module, name: str):
    value = getattr(text_config(model), name, None)
    if value is None:
        value = getattr(getattr(model, "generation_config", None), name, None)
    if isinstance(value, (list, tuple)):
        value = tuple(sorted(value))
    return value


def check_vocabulary(draft: torch.nn.Module, target: torch.nn.Module, draft_tokenizer=None,
                     target_tokenizer=None) -> None:
    """The draft proposes target ids that mean the same tokens (module docstring, 2.); `ValueError` naming both."""
    if draft is target:
        return
    target_vocab, width = model_vocab_size(target), proposable_ids(draft)
    if width > target_vocab:
        raise ValueError(f"`speculative_draft_model` can propose {width} token ids (its logits' width) but the target "
                         f"reads {target_vocab}: a draft id >= {target_vocab} is not a target token. Use a draft "
                         "with the target's tokenizer and at most its vocabulary size.")
    for name in SPECIAL_IDS:
        a, b = _special_id(draft, name), _special_id(target, name)
        if a is not None and b is not None and a != b:
            raise ValueError(f"`speculative_draft_model`'s `{name}` is {a} but the target's is {b}: the two models "
                             "do not share a tokenizer (the same id must mean the same token).")
    if draft_tokenizer is not None and target_tokenizer is not None:
        dv, tv = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        d_ids = {i: s for s, i in dv.items() if i < width}
        t_ids = {i: s for s, i in tv.items()}
        diff = sorted(i for i, s in d_ids.items() if t_ids.get(i) != s)
        if diff:
            i = diff[0]
            raise ValueError(f"`speculative_draft_model`'s tokenizer maps id {i} to {d_ids[i]!r} but the target's to "
                             f"{t_ids.get(i)!r} ({len(diff)} ids differ): the models do not share a tokenizer.")


def draft_block_bytes(support: ModelSupport, block_size: int) -> int:
    """Bytes of one block of the draft's KV pool (all its layers, K and V, in its pool dtype)."""
    elem = torch.empty((), dtype=support.kv_dtype).element_size()
    return block_size * support.kv.elements_per_token() * elem
