"""Rollout weights in the autocast dtype: a half-precision copy of the float32 weights autocast casts anyway.

Under `torch.autocast(device, bfloat16 / float16)` with float32 weights (accelerate's mixed precision, TRL's
`bf16=True`, fp32 masters under ZeRO / FSDP) every `F.linear` of every decode step casts its float32 weight (and bias)
to the autocast dtype: it reads 4 bytes per weight and writes 2 before the matmul reads those 2, about 4x the weight
bytes of a 16-bit step. The engine can instead run each rollout on a 16-bit copy of exactly those tensors, made once
(`WeightCopy.refresh`) and put in place of the float32 Parameters for the call (`WeightCopy.swapped`).

Exact by construction: autocast's cast of a float32 weight is `.to(dtype)` (round to nearest even), so `F.linear` on
the copy under autocast (whose cast of a tensor already in the autocast dtype is a no-op) computes what it computes on
the float32 weight. Only what autocast casts is copied: the weight and bias of plain `nn.Linear` modules (`F.linear`,
on autocast's lower-precision list) and of transformers' `Conv1D` (`addmm`, same list); norms, embeddings, RoPE and
any other parameter stay float32, as autocast leaves them (also the 3-D expert Parameters of transformers' fused MoE
layers, which autocast still casts at every forward: not copied, for now). Tied weights are handled per module: an
`lm_head` tied to `embed_tokens` runs `F.linear` on the copy (autocast would cast it there) while the embedding lookup
keeps reading the float32 Parameter (autocast does not cast `embedding`). Modules that read their weights outside
`F.linear` are left alone: PEFT layers with DoRA (their weight norm reads the base and adapter weights directly). A
model that reads a Linear's weight some other way (adds a row of it element-wise, say) would compute differently on
the copy: `check_exact` runs a short forward with and without the copy at engine construction and turns the copy off,
with a warning, unless the logits are bit-identical.

Lifetime: the copy follows the KV pool's. It is made at the start of a call, after the pool is sized (the pool's
budget sets the copy's bytes aside first: `pending_bytes`, passed as reserve), and freed at the end of the call when
the pool is (the default `kv_cache_release=True`): the training step's forward and backward never see it. Where the
pool is kept (`kv_cache_release=False`, or the calls of one rollout with `keep_pool=True`) the copy is kept too,
refreshed in place when the weights may have changed (same addresses: CUDA graphs and compiled steps need not
recapture): at every call unless the engine's caller reports weight changes (`weight_state.py`: `invalidate`), and
whenever a weight's address or version counter moved.
Where decode steps are captured (`stable=True`) the copy lives in one reserved address range (`kv_memory`, as the KV
pool): its memory is given back at the end of a call all the same, and the next call's copy lands at the same
addresses, so the graphs captured on it replay instead of being captured again.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from trl_infinite.engine.runner.kv_memory import ReservedRange, reserve_range

# (module, parameter name, the float32 Parameter it holds outside a swap)
Target = tuple[nn.Module, str, nn.Parameter]
HALF = (torch.bfloat16, torch.float16)


def _cast_types() -> tuple[type, ...]:
    """Module types whose forward is one autocast-cast op on their weight and bias (and nothing else)."""
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def _dora_bases(model: nn.Module) -> set[int]:
    """ids of the modules inside PEFT layers with DoRA on (their forward reads weights outside `F.linear`)."""
    out: set[int] = set()
    for module in model.modules():
        dora = getattr(module, "use_dora", None)
        if isinstance(dora, dict) and any(dora.values()):
            out.update(id(m) for m in module.modules())
    return out


def copy_targets(model: nn.Module) -> list[Target]:
    """The float32 weights and biases autocast casts in `model`'s forward: those of plain `nn.Linear` / `Conv1D`
    modules (exact types: a subclass may override `forward`), DoRA layers left out."""
    types, skip = _cast_types(), _dora_bases(model)
    out: list[Target] = []
    for module in model.modules():
        if type(module) not in types or id(module) in skip:
            continue
        for name in ("weight", "bias"):
            param = module._parameters.get(name)
            if param is not None and param.dtype == torch.float32:
                out.append((module, name, param))
    return out


class WeightCopy:
    """The 16-bit copy of `copy_targets(model)` for one engine (see the module docstring). Distinct Parameters are
    copied once (a weight shared by two Linear modules has one copy). The targets are found again at every `refresh`
    (a module or Parameter replaced since, an adapter added: the copy follows the model as it is at the call)."""

    ALIGN = 256  # bytes between the copies' starts in a reserved range

    def __init__(self, model: nn.Module, dtype: torch.dtype, stable: bool = False):
        if dtype not in HALF:
            raise ValueError(f"a rollout weight copy is made in bfloat16 or float16, got {dtype}")
        self.model = model
        self.dtype = dtype
        self.stable = stable  # the copies at fixed addresses (`_reserved_copies`)
        self._range: ReservedRange | None = None
        self._layout: tuple = ()  # (id, shape, device) of each Parameter the reserved range was laid out for
        self._views: dict[int, torch.Tensor] = {}  # id(float32 Parameter) -> its copy's place in the range
        self.targets = copy_targets(model)
        self._copies: dict[int, torch.Tensor] = {}  # id(float32 Parameter) -> its copy
        self._fingerprint: tuple = ()
        self.refreshes = 0  # copies made or refreshed (tests, stats)

    @classmethod
    def for_engine(cls, model: nn.Module, mode: str, device: torch.device, autocast: torch.dtype | None,
                   stable: bool = False) -> WeightCopy | None:
        """The copy an engine runs on, or None: `mode` 'off', no 16-bit autocast inside the forward (`autocast`:
        the support probe's), or no float32 weight autocast casts. On every device: on CUDA the cast's bytes decide
        a bandwidth-bound step; on CPU the cast is work of its own (`benchmarks/weight_copy.py`: 0.72x to 0.93x the
        rollout's CPU time on SmolLM2-135M's shape, one thread; benchmarks/RESULTS.md)."""
        if mode == "off" or autocast not in HALF:
            return None
        copy = cls(model, autocast, stable)
        return copy if copy.targets else None

    @property
    def params(self) -> list[nn.Parameter]:
        """The distinct float32 Parameters copied."""
        return list({id(p): p for _, _, p in self.targets}.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the copy (held or not; in a reserved range: what backing it takes)."""
        if self._range is not None:
            return self._range.sizes[0]
        size = torch.tensor([], dtype=self.dtype).element_size()
        return sum(p.numel() for p in self.params) * size

    @property
    def allocated(self) -> bool:
        return bool(self._copies)

    @property
    def pending_bytes(self) -> int:
        """Bytes the next `refresh` allocates (0 while the copy is held): the KV budget's reserve for it."""
        return 0 if self.allocated else self.nbytes

    def _weights_fingerprint(self) -> tuple:
        return tuple((p.data_ptr(), 0 if p.is_inference() else p._version) for p in self.params)

    def refresh(self) -> None:
        """Make the copy, or bring a held one up to date in place when the float32 weights changed (an optimizer
        step, a weight load, parameters gathered into new storage) since it was made."""
        self.targets = copy_targets(self.model)
        fingerprint = (tuple(id(p) for p in self.params), self._weights_fingerprint())
        if self.allocated and fingerprint == self._fingerprint:
            return
        with torch.no_grad():
            if not (self.stable and self._reserved_copies()):
                for p in self.params:
                    held = self._copies.get(id(p))
                    if held is None or held.shape != p.shape or held.device != p.device:
                        self._copies[id(p)] = p.detach().to(self.dtype)
                    else:
                        held.copy_(p.detach())
                live = {id(p) for p in self.params}
                self._copies = {k: t for k, t in self._copies.items() if k in live}
        self._fingerprint = fingerprint
        self.refreshes += 1

    def _reserved_copies(self) -> bool:
        """The copy written into its reserved range (laid out anew when the Parameters changed; backed if given
        back); False where no range can be reserved (then the copy is allocated per call, `stable` off)."""
        params = self.params
        layout = tuple((id(p), tuple(p.shape), p.device) for p in params)
        if self._range is None or layout != self._layout:
            if self._range is not None:
                self._range.unmap()
            size = torch.empty((), dtype=self.dtype).element_size()
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += -(-p.numel() * size // self.ALIGN) * self.ALIGN
            devices = {p.device for p in params}
            self._range = reserve_range([total], params[0].device) if len(devices) == 1 else None
            if self._range is None:
                self.stable = False
                return False
            self._layout = layout
            self._views = {id(p): self._range.tensor(0, self.dtype, tuple(p.shape), o) for p, o in zip(params, offsets)}
        self._range.map(self._range.sizes)
        for p in params:
            self._views[id(p)].copy_(p.detach())
        self._copies = dict(self._views)
        return True

    def invalidate(self) -> None:
        """The float32 weights may have changed where the fingerprint cannot see it (a fused optimizer step,
        `p.data.copy_`, inference tensors: `weight_state.py`): the next `refresh` copies them again (in place)."""
        self._fingerprint = ()

    def release(self) -> None:
        """Free the copy (its memory goes back to the allocator, or to the device from its reserved range, for the
        training step)."""
        self._copies = {}
        self._fingerprint = ()
        if self._range is not None:
            self._range.unmap()

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The model's copied modules hold the 16-bit copies instead of their float32 Parameters, for the body only
        (`refresh` first); the float32 Parameters are put back on every exit path."""
        if self.targets and not self.allocated:
            raise RuntimeError("WeightCopy.swapped() before refresh(): no copy is held.")
        try:
            for module, name, param in self.targets:
                module._parameters[name] = self._copies[id(param)]
            yield
        finally:
            for module, name, param in self.targets:
                module._parameters[name] = param

    @contextmanager
    def active(self) -> Iterator[None]:
        """`refresh`, then `swapped`: the model runs on the copy for the body."""
        self.refresh()
        with self.swapped():
            yield

    def tensors(self) -> list[torch.Tensor]:
        """The copy's tensors now held (tests)."""
        return list(self._copies.values())


def check_exact(copy: WeightCopy, vocab_size: int, device: torch.device) -> bool:
    """Whether a forward of the model on the copy gives bit-identical logits to one on the float32 weights (under
    the autocast the caller runs in); warns and returns False otherwise (also when two forwards on the float32 weights
    already differ: a nondeterministic forward cannot be judged). Call with the model in eval mode and under
    `torch.inference_mode()`; the copy is released afterwards."""
    ids = torch.randint(0, vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)  # fixed
    reference = copy.model(input_ids=ids, use_cache=False).logits
    again = copy.model(input_ids=ids, use_cache=False).logits
    copy.refresh()
    try:
        with copy.swapped():
            got = copy.model(input_ids=ids, use_cache=False).logits
    finally:
        copy.release()
    if not torch.equal(again, reference):
        why = "two forwards on its float32 weights differ (a nondeterministic forward), so the copy cannot be checked"
    elif got.dtype == reference.dtype and torch.equal(got, reference):
        return True
    else:
        half = str(copy.dtype).removeprefix("torch.")
        why = (f"it computes differently on a {half} copy of its Linear weights than on its float32 weights under "
               "autocast (it reads a weight outside the ops autocast casts)")
    warnings.warn(f"`weight_copy`: {why}; the rollout runs on the float32 weights.", UserWarning, stacklevel=3)
    return False


def build_weight_copy(model: nn.Module, mode: str, device: torch.device, autocast: torch.dtype | None,
                      vocab_size: int, stable: bool = False) -> WeightCopy | None:
    """`WeightCopy.for_engine`, kept only where `check_exact` passes (the model runs in eval mode for the check)."""
    from trl_infinite.engine.runner.eval_mode import eval_mode

    copy = WeightCopy.for_engine(model, mode, device, autocast, stable)
    if copy is None:
        return None
    with torch.inference_mode(), eval_mode(model):
        return copy if check_exact(copy, vocab_size, device) else None
