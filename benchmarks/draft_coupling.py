"""What identity verification costs a draft model: per-token acceptance of inverse-CDF coupling against rejection
sampling, on SmolLM2-135M-Instruct's real distributions over GSM8K text.

Speculative verification emits plain sampling's own draw `y = F_p^{-1}(U)` at each position (so a seed's samples are
the same with and without speculation); the draft model draws `d = F_q^{-1}(U)` with the same uniform, so a draft
token is accepted with probability `P(F_q^{-1}(U) = F_p^{-1}(U)) = sum_v |[C_p(v-1), C_p(v)) n [C_q(v-1), C_q(v))|`
(`spec_decode/verify.py`). Rejection sampling (Leviathan et al.) keeps only the distribution, and accepts with
`sum_v min(p_v, q_v)`, the largest possible. Both are computed exactly here (no sampling) and averaged over the
positions of chat-formatted GSM8K test questions with their reference answers (teacher forcing).

Target `p`: the full model. Draft `q`: the same model exited early after `L` of its decoder layers (final norm and
head applied there, as a self-speculative "layer skip" draft), a stand-in for a small draft model sharing the
tokenizer (no other real model is available offline). Both at temperature T, no truncation.

    python benchmarks/draft_coupling.py --num-prompts 8 --layers 10 20 25 28 --temperatures 1.0 0.6
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch
from common import GSM8K_TEST, Table, pick_device, run_header, write_results


def contexts(tokenizer, num_prompts: int) -> list[list[int]]:
    """Question (chat template) + reference answer token ids, one per GSM8K test row."""
    out = []
    for line in GSM8K_TEST.read_text().splitlines()[:num_prompts]:
        row = json.loads(line)
        msgs = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
        out.append(tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"])
    return out


@torch.no_grad()
def logits_per_exit(model, ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """[T, V] logits of the full model (key = number of layers) and of each early exit."""
    out = model.model(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states  # embeddings, then after each layer
    head, norm = model.lm_head, model.model.norm
    n = len(hidden) - 1
    result = {n: model.lm_head(out.last_hidden_state)[0].float()}
    for layer in layers:
        result[layer] = head(norm(hidden[layer]))[0].float()
    return result


def acceptance(p: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """Mean over rows of (sum min(p, q), P(F_q^-1(U) = F_p^-1(U))) for [T, V] probabilities (float64)."""
    maximal = torch.minimum(p, q).sum(-1)
    cp, cq = p.cumsum(-1), q.cumsum(-1)
    zero = torch.zeros(p.shape[0], 1, dtype=p.dtype)
    lo = torch.maximum(torch.cat([zero, cp[:, :-1]], 1), torch.cat([zero, cq[:, :-1]], 1))
    coupled = (torch.minimum(cp, cq) - lo).clamp_min(0).sum(-1)
    return maximal.mean().item(), coupled.mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--layers", type=int, nargs="+", default=[10, 20, 25, 28])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.6])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = pick_device("cpu")
    from trl_infinite.testing.offline_models import load_smollm2

    model, tok = load_smollm2(dtype=torch.float32, device="cpu")
    model.eval()
    per_exit: dict[int, list[torch.Tensor]] = {}
    full = None
    for ids in contexts(tok, args.num_prompts):
        logits = logits_per_exit(model, ids, args.layers)
        full = max(logits)
        for k, v in logits.items():
            per_exit.setdefault(k, []).append(v)
    target = torch.cat(per_exit[full])
    table = Table(["draft layers", "T", "positions", "rejection sampling", "inverse-CDF coupling", "ratio"])
    for temperature in args.temperatures:
        p = torch.softmax(target / temperature, -1).double()
        for layer in args.layers:
            q = torch.softmax(torch.cat(per_exit[layer]) / temperature, -1).double()
            maximal, coupled = acceptance(p, q)
            table.add(**{"draft layers": f"{layer}/{full}", "T": temperature, "positions": p.shape[0],
                         "rejection sampling": maximal, "inverse-CDF coupling": coupled, "ratio": coupled / maximal})
    header = run_header(device, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    write_results(args.json, header, table, {})


if __name__ == "__main__":
    main()
