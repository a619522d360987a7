"""Draft-model drafting: a small causal LM sharing the tokenizer, with its own paged KV pool.

Each sample keeps its whole context (prompt + completion) in its own blocks of the draft pool. `propose` first runs
the not-yet-cached context through the draft model (catch-up), then decodes k tokens one forward at a time, all
samples batched. Draft tokens are drawn from the draft's processed distribution `q` (same temperature / top-k /
top-p / min-p as the target, so `q` is close to `p`) by inverse CDF with the very uniform plain sampling uses at that
position (`STREAM_SAMPLE`, keyed by seed, prompt, sample and position): verification accepts a draft exactly when the
target's own draw at that position is the same token (`verify.py`), which the shared uniform makes likely when `q`
is close to `p`. The emitted tokens are those of plain decoding, whatever the draft model proposes.
After verification, the KV of drafts that were accepted stays valid; the rest is overwritten by the next catch-up.
"""

from __future__ import annotations

import torch

from trl_infinite.engine.attention import Segment
from trl_infinite.engine.config.engine_config import EngineConfig, SpeculativeConfig
from trl_infinite.engine.config.inputs import model_vocab_size
from trl_infinite.engine.model.support import build_runner
from trl_infinite.engine.runner.model_runner import last_rows
from trl_infinite.engine.runner.sampler import STREAM_SAMPLE, Sampler, row_keys
from trl_infinite.engine.sched.sequence import Sequence
from trl_infinite.engine.spec_decode.drafter import EMPTY, DraftContext, Drafter, Proposal, register_drafter


def load_draft_model(spec, device: torch.device) -> torch.nn.Module:
    """`spec` is an `nn.Module` or a local path/name for `AutoModelForCausalLM.from_pretrained`."""
    if isinstance(spec, torch.nn.Module):
        return spec.to(device).eval()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec).to(device).eval()


class _State:
    __slots__ = ("ctx", "blocks", "cached", "drafts", "blind")

    def __init__(self, ctx: list[int], blind: bool):
        self.ctx, self.blocks, self.cached, self.drafts = ctx, [], 0, []
        self.blind = blind  # the context holds an id the draft model cannot read: no drafts


@register_drafter("draft_model")
class DraftModelDrafter(Drafter):
    cost_per_token = 0.2  # relative to a target decode forward; refined by the engine's cost model via acceptance

    def __init__(self, config: SpeculativeConfig, context: DraftContext):
        super().__init__()
        target, draft_model, device = context.engine, context.draft_model, context.device
        decode = target.decode
        # the draft model runs on a pool too, on the target's attention path (in the dtype it computes in): as many
        # blocks as the target's pool of this call, whose budget paid for them (`draft_check.draft_block_bytes`);
        # built outside an engine, the budget's tokens
        blocks = context.pool_blocks
        tokens = (blocks + 1) * target.block_size if blocks is not None else (
            target.kv_cache.tokens or target.kv_cache.cpu_tokens)
        pool_cfg = EngineConfig(kv_cache_tokens=tokens, block_size=target.block_size, prefix_cache=False,
                                attention_backend=decode.attention_backend, cpu_decode_kernel=decode.cpu_decode_kernel)
        self.vocab = model_vocab_size(draft_model)  # ids the draft reads (a target id beyond: no drafts for the row)
        self.runner = build_runner(draft_model, pool_cfg, context.draft_support)
        self.pool = self.runner.pool
        self.sampler = Sampler(context.sampling)
        self.seed = context.sampling.seed
        self.device = device
        self.states: dict[int, _State] = {}

    def _start(self, seq: Sequence) -> None:
        ctx = seq.group.prompt_ids + seq.output_ids
        self.states[seq.seq_id] = _State(ctx, max(ctx) >= self.vocab)

    def update(self, seq: Sequence, tokens: list[int]) -> None:
        st = self.states[seq.seq_id]
        if st.drafts:  # KV of d_1..d_{k-1} was written after ctx; keep the part the emitted tokens confirm
            match = 0
            while match < min(len(tokens), len(st.drafts) - 1) and tokens[match] == st.drafts[match]:
                match += 1
            st.cached = min(st.cached, len(st.ctx)) + match
            st.drafts = []
        st.ctx.extend(tokens)
        if tokens and max(tokens) >= self.vocab:
            st.blind = True

    supports_ahead = True

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return self.propose_ahead(seqs, [[] for _ in seqs], ks)

    def propose_ahead(self, seqs: list[Sequence], assumed: list[list[int]], ks: list[int]) -> list[Proposal]:
        """Drafts after the context + `assumed[i]` (empty: `propose`); the assumed tokens' KV is written with the
        catch-up and kept by `update` where the emitted tokens confirm them."""
        out = [EMPTY] * len(seqs)
        todo = [i for i, k in enumerate(ks)
                if k > 0 and not self.states[seqs[i].seq_id].blind and (not assumed[i] or max(assumed[i]) < self.vocab)
                and self._reserve(self.states[seqs[i].seq_id], len(assumed[i]) + ks[i])]
        if not todo:
            return out
        states = [self.states[seqs[i].seq_id] for i in todo]
        extras = [list(assumed[i]) for i in todo]
        drafts: list[list[int]] = [[] for _ in todo]
        live = [True] * len(todo)  # a draft stops at a token the draft model's logits cannot give (not finite)
        for r in range(max(ks[i] for i in todo)):
            rows = [j for j, i in enumerate(todo) if ks[i] > r and live[j]]
            if not rows:
                break
            segs = [self._segment(states[j], extras[j], drafts[j]) for j in rows]
            logits, _ = self.runner.forward(segs, last_rows(segs))
            q = self.sampler.process(logits)  # [R, V]
            # the emitted position of d_{r+1} is len(ctx) + r: the key of the target's own draw there
            pos = torch.tensor([len(states[j].ctx) + len(extras[j]) + r for j in rows], device=self.device)
            keys = row_keys(self.seed, *self._ids([seqs[todo[j]] for j in rows]), pos, STREAM_SAMPLE)
            toks, _ = self.sampler.sample(q, keys, logits)
            for j, t in zip(rows, toks.tolist()):
                if t < 0:
                    live[j] = False
                    continue
                drafts[j].append(t)
                # KV now covers ctx + assumed + d_1..d_r (d_{r+1} not fed yet)
                states[j].cached = len(states[j].ctx) + len(extras[j]) + r
        for j, i in enumerate(todo):
            states[j].drafts = extras[j] + drafts[j]
            out[i] = Proposal(drafts[j])
        return out

    def _ids(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([s.group_id for s in seqs], device=self.device),
                torch.tensor([s.sample_idx for s in seqs], device=self.device))

    @staticmethod
    def _segment(st: _State, extra: list[int], drafts: list[int]) -> Segment:
        """Round 0: the uncached context (+ the assumed tokens); round r: the previous draft token."""
        if not drafts:
            full = st.ctx + extra if extra else st.ctx
            start = min(st.cached, len(full) - 1)  # at least the last token, whose logits draft d_1
            return Segment(0, [], st.blocks, start, full[start:])
        return Segment(0, [], st.blocks, len(st.ctx) + len(extra) + len(drafts) - 1, drafts[-1:])

    def _reserve(self, st: _State, k: int) -> bool:
        bs = self.pool.block_size
        need = -(-(len(st.ctx) + k) // bs) - len(st.blocks)
        if need > 0:
            if not self.pool.allocator.can_allocate(need):
                return False
            st.blocks.extend(self.pool.allocator.allocate(need))
        return True

    def stop(self, seq: Sequence) -> None:
        super().stop(seq)
        st = self.states.pop(seq.seq_id, None)
        if st is not None and st.blocks:
            self.pool.allocator.free(st.blocks)
