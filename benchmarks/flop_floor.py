"""The GRPO step against its floor (issue 43): FLOPs counted per phase with torch's own counter, the FLOPs the step
cannot avoid (by the formula below), the machine's measured GEMM rate at the model's linear shapes, and per trainer
and phase `time / floor`. Used by `grpo_step.py` (its worker attaches `FloorProbe`; its parent builds the floor
table with `floor_rows`).

Required FLOPs (a dense decoder: `L` layers, body linears `W` = sum of in x out over every `nn.Linear` inside the
layers, `H` = the output head's in x out, `q` = attention heads x head_dim; norms, activations, rotary and softmax,
all O(d) per token, are left out). One position with `k` keys in its context costs `2 W + 4 L q k` through the body
and `2 H` for its logits. For a group of G samples of one prompt of `p` tokens and completions of `c_1..c_G` tokens:

    rollout  = body(positions 1..p, once per group) + 2H (the prompt's last logits, once per group)
             + sum_i [ body(positions p+1 .. p+c_i-1) + 2H (c_i - 1) ]           (each completion token fed once)
    forward  = body(positions 1..p, once per group) + sum_i [ body(p+1 .. p+c_i-1) + 2H c_i ]   (c_i log-probs)
    backward = 2 x forward                                   (gradients of activations and of weights)
             + body forward again only if one sample's activations do not fit the memory budget (recomputation)
    body(a..b) = sum_{t=a..b} (2 W + 4 L q t)

No padding anywhere, the prompt once per group, every completion token once, no work done twice (with `beta = 0` and
one iteration, TRL's defaults, no reference or old-policy forward is needed). Recomputation: a token's activations
are taken as `A` = 4 bytes x (in + out of every body linear) (each linear's input and output kept in float32, all
layers; `activation_bytes_per_token`); the floor includes one extra body forward when `A x (p + max c) > memory budget` (`--floor-memory-gb`, default the
machine's memory: host RAM on CPU, the GPU's on CUDA), since smaller slices of samples always fit otherwise.

Floor of a phase = max(required FLOPs / GEMM rate, bytes moved / copy bandwidth) (a roofline). GEMM rate: one
pass over the model's linears, each with its own weight in the model's order (the memory a step streams), through
`torch.nn.functional.linear` (forward, and for the backward the two transposed GEMMs) at M rows, in the worker's
threads and dtype, timed by the phase clock's kind (CPU seconds on CPU, synchronised wall on CUDA), the fastest of at
least 5 passes and 1 s (the attainable rate on a shared machine); one rate per phase: the rollout's at M = the
rollout's rows (G x prompts), forward's and backward's at M = `TRAIN_ROWS`. Bytes moved: only the rollout's decode
is counted (training is compute-bound): per decode step every weight once (in the compute dtype) plus the KV read, each group's prompt once (a cascade) and each sample's own
tokens; the copy bandwidth is `Tensor.copy_` of a large buffer.

Counted FLOPs (`torch.utils.flop_counter.FlopCounterMode`, matmuls and attention): in a warm-up step (step 1,
never reported) so the timed steps run without the counter; on CPU by default in a process of its own (`separate`:
a second worker runs that one step counted, since what the counter leaves resident lifts a process's peak RSS),
on CUDA in the measuring worker's warm-up; its phase split follows the phase clock's (exclusive)
boundaries. The counter sees only the thread that runs the step (TRL's continuous batching generates in another
thread) and counts attention as dense (causal masks not subtracted).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import TrainerCallback

TRAIN_ROWS = 512  # GEMM rows of the training phases' rate (a slice of tokens)
FLOOR_PHASES = ("rollout", "forward", "backward")
COUNT_MODES = ("auto", "separate", "warmup", "warmup-training", "off")


# ------------------------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    q_dim: int  # attention heads x head_dim
    kv_dim: int  # key-value heads x head_dim
    body: tuple[tuple[int, int], ...]  # (in, out) of every nn.Linear inside the layers
    head: tuple[int, int]  # the output head's (in, out)
    weight_bytes: int  # every weight a decode step reads once, in the compute dtype
    dtype_bytes: int

    @classmethod
    def of(cls, model: torch.nn.Module, dtype_bytes: int | None = None) -> ModelShape:
        cfg = model.config.get_text_config()
        head_mod = model.get_output_embeddings()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        body = tuple((m.in_features, m.out_features) for m in model.modules()
                     if isinstance(m, torch.nn.Linear) and m is not head_mod)
        head = (head_mod.weight.shape[1], head_mod.weight.shape[0])
        nbytes = dtype_bytes or next(model.parameters()).element_size()
        inp = model.get_input_embeddings()
        tied = inp is not None and inp.weight is head_mod.weight
        params = sum(p.numel() for p in model.parameters()) - (0 if tied or inp is None else inp.weight.numel())
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads * head_dim, kv_heads * head_dim,
                   body, head, params * nbytes, nbytes)

    @property
    def body_params(self) -> int:
        return sum(i * o for i, o in self.body)

    @property
    def head_params(self) -> int:
        return self.head[0] * self.head[1]

    def body_flops(self, first: int, last: int) -> int:
        """Positions first..last (1-based, inclusive) through the layers: 2 W each + 4 L q t of attention."""
        n = max(0, last - first + 1)
        keys = (first + last) * n // 2  # sum of t over the positions
        return 2 * self.body_params * n + 4 * self.layers * self.q_dim * keys

    def activation_bytes_per_token(self) -> int:
        """Bytes one token keeps for the backward, all layers (float32): every linear's input (q/k/v share one),
        the MLP's two intermediate outputs, attention's q/k/v and output; logits tiles are not kept."""
        widths = sum(i for i, _ in self.body) + sum(o for _, o in self.body)
        return 4 * widths  # upper estimate: each linear's input and output, all layers (the modules are all layers)


# ---------------------------------------------------------------------------------------------- required FLOPs
@dataclass
class Required:
    rollout: int
    forward: int
    backward: int
    recompute: bool  # the floor holds one extra body forward (memory budget too small for one sample)
    rollout_bytes: int  # bytes the rollout's decode steps read (weights + KV)
    tokens: int  # completion tokens

    @property
    def step(self) -> int:
        return self.rollout + self.forward + self.backward


def required_flops(shape: ModelShape, prompt_lens: list[int], completions: list[list[int]],
                   memory_budget_bytes: float) -> Required:
    """The formula of the module docstring for one step: `prompt_lens[g]` and `completions[g]` (G lengths) per
    group."""
    rollout = forward = body_fwd = 0
    kv_token = 2 * shape.layers * shape.kv_dim * shape.dtype_bytes
    steps = max((max(c) for c in completions if c), default=1) - 1
    kv_bytes = 0
    longest = 0
    for p, group in zip(prompt_lens, completions):
        prompt = shape.body_flops(1, p)
        own = sum(shape.body_flops(p + 1, p + c - 1) for c in group)
        rollout += prompt + 2 * shape.head_params + own + sum(2 * shape.head_params * (c - 1) for c in group)
        forward += prompt + own + sum(2 * shape.head_params * c for c in group)
        body_fwd += prompt + own
        kv_bytes += max(max(group) - 1, 0) * p * kv_token  # the prompt once per decode step while the group runs
        kv_bytes += sum((c - 1) * c // 2 for c in group) * kv_token  # each sample's own tokens so far
        longest = max(longest, p + max(group, default=0))
    recompute = shape.activation_bytes_per_token() * longest > memory_budget_bytes
    backward = 2 * forward + (body_fwd if recompute else 0)
    return Required(rollout, forward, backward, recompute, steps * shape.weight_bytes + kv_bytes,
                    sum(map(sum, completions)))


# ----------------------------------------------------------------------------------------------------- GEMM rate
def _timer(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def _gemms(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, backward: bool) -> None:
    if backward:
        torch.matmul(g, w)  # grad input: [rows, n] @ [n, k]
        torch.matmul(g.t(), x)  # grad weight: [n, rows] @ [rows, k]
    else:
        torch.nn.functional.linear(x, w)


def _fastest(fn, device: torch.device, min_calls: int = 3, min_s: float = 0.2) -> float:
    """The shortest of at least `min_calls` timed calls (and `min_s` in all): the attainable time, robust to other
    processes taking the core for a while (a shared machine)."""
    fn()  # warm-up
    best, total, calls = float("inf"), 0.0, 0
    while calls < min_calls or total < min_s:
        start = _timer(device)
        fn()
        elapsed = _timer(device) - start
        best, total, calls = min(best, elapsed), total + elapsed, calls + 1
    return max(best, 1e-9)


def gemm_rate(shape: ModelShape, rows: int, device: torch.device, dtype: torch.dtype, backward: bool = False) -> float:
    """FLOP/s of one pass over the model's linears at `rows` rows: every body linear in the model's order, each with
    its own weight, then the head (a step streams its weights: one layer's do not stay in cache until the next use,
    so one shape's weight timed over and over would overstate the rate), the fastest of at least 5 passes and 1 s;
    `backward`: the two transposed GEMMs of the backward (input and weight gradients) instead."""
    shapes = [*shape.body, shape.head]
    weights = [torch.randn(n, k, device=device, dtype=dtype) for k, n in shapes]
    xs = {k: torch.randn(rows, k, device=device, dtype=dtype) for k, _ in shapes}
    gs = {n: torch.randn(rows, n, device=device, dtype=dtype) for _, n in shapes}
    flops = sum(2 * rows * k * n for k, n in shapes) * (2 if backward else 1)

    def one_pass():
        for (k, n), w in zip(shapes, weights):
            _gemms(xs[k], w, gs[n], backward)

    return flops / _fastest(one_pass, device, min_calls=5, min_s=1.0)  # at 16 rows a pass is ~0.1 s: 10 of them


def copy_bandwidth(device: torch.device, nbytes: int = 256 * 2**20) -> float:
    """Bytes/s of `Tensor.copy_` (read + write counted), the fastest call."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _fastest(lambda: dst.copy_(src), device, min_calls=5, min_s=0.1)


@dataclass
class Rates:
    rollout: float  # FLOP/s at the rollout's rows
    forward: float  # FLOP/s at TRAIN_ROWS
    backward: float  # FLOP/s of the backward's GEMMs at TRAIN_ROWS
    bandwidth: float  # bytes/s
    rollout_rows: int
    train_rows: int
    dtype: str


def measure_rates(shape: ModelShape, rollout_rows: int, device: torch.device, dtype: torch.dtype) -> Rates:
    with torch.no_grad():
        return Rates(gemm_rate(shape, rollout_rows, device, dtype), gemm_rate(shape, TRAIN_ROWS, device, dtype),
                     gemm_rate(shape, TRAIN_ROWS, device, dtype, backward=True), copy_bandwidth(device),
                     rollout_rows, TRAIN_ROWS, str(dtype).removeprefix("torch."))


# ------------------------------------------------------------------------------------------- the worker's probe
def _heads_as_query(query, other):
    """`other`'s shape with the query's batch and heads (grouped-query attention shares K/V heads)."""
    return (*query[:2], *other[2:])


def _sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """[B, H, Q, D] queries, [B, Hkv, K, D] keys / values: every `_scaled_dot_product_*_attention` kernel."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, _heads_as_query(query, key), _heads_as_query(query, value))


def _sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out, query, _heads_as_query(query, key), _heads_as_query(query, value))


def _addmm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """addmm / baddbmm, also with `out_dtype` (TRL's chunked log-probs): torch's formula takes a fourth positional
    argument for its `out_shape` and raises (torch 2.11, CUDA)."""
    from torch.utils.flop_counter import bmm_flop, mm_flop

    return mm_flop(a_shape, b_shape) if len(a_shape) == 2 else bmm_flop(a_shape, b_shape)


def flop_counter():
    """`FlopCounterMode` counting totals only (no module hooks: they break on inference-mode tensors), with the CPU
    flash-attention kernels torch's registry lacks (counted as torch counts its other attention kernels: dense), the
    CUDA attention kernels with grouped-query K/V (torch's formula asserts equal heads) and addmm with `out_dtype`."""
    aten = torch.ops.aten
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
               aten.addmm: _addmm, aten.baddbmm: _addmm}
    for kernel in ("flash", "efficient", "cudnn"):
        mapping[getattr(aten, f"_scaled_dot_product_{kernel}_attention")] = _sdpa
        mapping[getattr(aten, f"_scaled_dot_product_{kernel}_attention_backward")] = _sdpa_backward
    mode = _TolerantCounter(display=False, custom_mapping=mapping)
    mode.mod_tracker = _GlobalOnly()
    return mode


class _TolerantCounter(FlopCounterMode):
    """A formula that raises (one torch release's registry meeting an operator it does not expect) is recorded in
    `errors` instead of failing the step it counts: the step's timings still come back, its count does not
    (`FloorProbe` drops an incomplete count)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.errors: list[str] = []

    def _count_flops(self, func_packet, out, args, kwargs):
        try:
            return super()._count_flops(func_packet, out, args, kwargs)
        except Exception as err:  # noqa: BLE001 (any formula's failure: the count is incomplete, not the step)
            message = f"{func_packet}: {type(err).__name__}: {err}"
            if message not in self.errors:
                self.errors.append(message)
            return out


class _GlobalOnly:
    """Stands in for `FlopCounterMode`'s module tracker: every count goes to "Global" only, no hooks installed."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


class FloorProbe(TrainerCallback):
    """Records each rollout's prompt and completion lengths, and counts FLOPs per phase in the first step
    (`count`: "warmup" every phase, "warmup-training" all but the rollout; "off" and "separate" none: a
    separate process counts). Attach after
    `grpo_probes.Instrumented` (it reads the same phase clock)."""

    def __init__(self, trainer, clock, count: str):
        self.trainer, self.clock, self.count = trainer, clock, count
        self.steps: list[dict] = []
        self.count_error: str | None = None
        self._mode = None
        self._last = 0
        self._original = trainer._generate_single_turn
        trainer._generate_single_turn = self._recording(self._original)
        trainer.add_callback(self)

    def _recording(self, rollout):
        def wrapper(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
            if self._mode is not None and self.count == "warmup-training":
                # the rollout runs with no dispatch mode at all (CUDA graph capture, compiled steps as without it)
                from torch.utils._python_dispatch import _disable_current_modes

                with _disable_current_modes():
                    out = rollout(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
            else:
                out = rollout(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
            if self.steps and self.steps[-1]["completions"] is None:  # the step's first (outer) call
                g = num_generations
                lens = [len(c) for c in out[0]]
                self.steps[-1]["prompt_lens"] = [len(prompt_ids[i]) for i in range(0, len(prompt_ids), g)]
                self.steps[-1]["completions"] = [lens[i:i + g] for i in range(0, len(lens), g)]
            return out

        return wrapper

    def _charge(self, phase: str) -> None:
        total = self._mode.get_total_flops()
        counted = self.steps[-1]["counted"]
        counted[phase] = counted.get(phase, 0) + total - self._last
        self._last = total

    def _on_boundary(self, phase: str) -> None:
        if self._mode is None:
            return
        if self.count == "warmup-training" and phase == "rollout":
            self._last = self._mode.get_total_flops()
            self.steps[-1]["counted"]["rollout"] = None
            return
        if self.steps[-1]["counted"].get(phase, 0) is not None:
            self._charge(phase)

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append({"prompt_lens": None, "completions": None, "counted": None})
        if len(self.steps) == 1 and self.count in ("warmup", "warmup-training"):
            self.steps[-1]["counted"] = {}
            self._mode = flop_counter()
            self._mode.__enter__()
            self._last = 0
            self.clock.listeners.append(self._on_boundary)

    def on_step_end(self, args, state, control, **kwargs):
        if self._mode is not None:
            self._on_boundary("other")
            errors = self._mode.errors
            if errors:  # an incomplete count is no count (the table shows "-"); the reason goes to the JSON
                self.steps[-1]["counted"] = None
                self.count_error = "; ".join(errors)
                print(f"[flop_floor] FLOP count dropped: {self.count_error}", file=sys.stderr, flush=True)
            self._mode.__exit__(None, None, None)
            self._mode = None
            self.clock.listeners.remove(self._on_boundary)

    def detach(self) -> None:
        if self._mode is not None:  # a step that raised: its dispatch mode would stay on in this process (and
            self._mode.__exit__(None, None, None)  # every later `torch.compile` would find no frame to compile)
            self._mode = None
            self.clock.listeners.remove(self._on_boundary)
        self.trainer._generate_single_turn = self._original
        self.trainer.remove_callback(self)


def count_mode(requested: str, device: torch.device) -> str:
    """auto: every phase, in a process of its own, on CPU (`separate`); on CUDA the training phases only, in the
    measuring worker's warm-up (a replayed CUDA graph runs no operator the counter sees, so a rollout count there
    says nothing)."""
    if requested != "auto":
        return requested
    return "separate" if device.type == "cpu" else "warmup-training"


def floor_summary(trainer, probe: FloorProbe, size, device: torch.device, bf16: bool) -> dict:
    """What the worker returns for the floor: the model's shape, the rates, and per step lengths and counts."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    dtype = torch.bfloat16 if bf16 and device.type == "cuda" else next(model.parameters()).dtype
    shape = ModelShape.of(model, torch.finfo(dtype).bits // 8)
    rates = measure_rates(shape, size.G * size.prompts, device, dtype)
    summary = {"shape": asdict(shape), "rates": asdict(rates), "steps": probe.steps}
    if probe.count_error is not None:
        summary["count_error"] = probe.count_error
    return summary
