"""Grouped suffix-tree drafting (Seer §4.6, SuffixDecoding): one tree per prompt group over the prompt and every
sibling completion, in flight and finished, updated incrementally as tokens are emitted.

The tree is a depth-limited suffix trie: node `v` at depth d stands for a d-token string s, `v.count` is how many
times s occurred in the group's texts, and `v.children[t]` is the node of `s + [t]`. Each text keeps the list of
nodes of its suffixes of length 0..D (`active[d]` = node of its last d tokens), so appending a token costs O(D):
every active node steps to (and counts) its child. A sample's deepest active node that has children is the longest
earlier match of its own context; from there the draft follows the most frequent child while the path's confidence
`prod_i count(child_i) / sum count(children of node_i)` stays above `min_confidence`.

History (RhymeRL's HistoSpec, DAS, SPEC-RL): with the engine's `PromptHistory`, the tree also holds the prompt's
completions from its earlier visits (earlier epochs), inserted when the group's tree is built. `sources` picks the
texts: "siblings+history" (default), "siblings" (this call only) or "history" (earlier visits only: running
samples are matched against the tree without being inserted). Drafts stay proposals: lossless whatever the source.
"""

from __future__ import annotations

from trl_infinite.engine.config.engine_config import SpeculativeConfig
from trl_infinite.engine.sched.sequence import Sequence
from trl_infinite.engine.spec_decode.drafter import EMPTY, DraftContext, Drafter, Proposal, register_drafter


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


def _extend(root: _Node, active: list[_Node], token: int, max_depth: int, insert: bool = True) -> list[_Node]:
    """Insert `token` after the suffixes in `active` (depths 0..); returns the new active list. `insert=False`: the
    suffixes of the context that occur in the tree, nothing inserted or counted. A string occurs only if its own
    suffixes do, so the matched depths are 0..m and the walk stops at the first missing child."""
    new = [root]
    for node in active[:max_depth]:
        child = node.children.get(token)
        if child is None:
            if not insert:
                break
            child = node.children[token] = _Node()
        if insert:
            child.count += 1
        new.append(child)
    return new


class _GroupTree:
    def __init__(self, prompt: list[int], max_depth: int, earlier: list = ()):
        self.root = _Node()
        self.max_depth = max_depth
        self.prompt_active = [self.root]
        for t in prompt:
            self.prompt_active = _extend(self.root, self.prompt_active, t, max_depth)
        for completion in earlier:  # the prompt's completions from earlier visits continue the prompt
            active = self.prompt_active
            for t in completion:
                active = _extend(self.root, active, t, max_depth)
        self.stopped = 0


@register_drafter("suffix")
class SuffixDrafter(Drafter):
    """Frequency-scored drafts from the group's shared suffix trie (prompt + all sibling completions). Options:
    `config.suffix`; the earlier completions from `context.history`."""

    def __init__(self, config: SpeculativeConfig, context: DraftContext):
        super().__init__()
        options = config.suffix
        self.max_depth, self.min_confidence, self.min_match = options.max_depth, options.min_confidence, options.min_match
        sources = options.sources
        self.history = context.history if "history" in sources else None
        self.insert_own = "siblings" in sources
        self.trees: dict[int, _GroupTree] = {}
        self.active_nodes: dict[int, list[_Node]] = {}
        self.history_texts = 0  # earlier completions indexed (counter for tests and benchmarks)

    def _tree(self, seq: Sequence) -> _GroupTree:
        tree = self.trees.get(seq.group_id)
        if tree is None:
            earlier = self.history.completions(seq.group.prompt_ids) if self.history is not None else []
            self.history_texts += len(earlier)
            tree = self.trees[seq.group_id] = _GroupTree(seq.group.prompt_ids, self.max_depth, earlier)
        return tree

    def _start(self, seq: Sequence) -> None:
        self.active_nodes[seq.seq_id] = list(self._tree(seq).prompt_active)  # the prompt is in the tree once
        self.update(seq, seq.output_ids)

    def update(self, seq: Sequence, tokens: list[int]) -> None:
        root, active = self.trees[seq.group_id].root, self.active_nodes[seq.seq_id]
        for t in tokens:
            active = _extend(root, active, t, self.max_depth, self.insert_own)
        self.active_nodes[seq.seq_id] = active

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [self._one(s, k) if k > 0 else EMPTY for s, k in zip(seqs, ks)]

    supports_ahead = True

    def propose_ahead(self, seqs: list[Sequence], assumed: list[list[int]], ks: list[int]) -> list[Proposal]:
        """Drafts after the context + `assumed`: the assumed tokens are matched in the tree, not inserted."""
        out = []
        for s, extra, k in zip(seqs, assumed, ks):
            active = self.active_nodes[s.seq_id]
            root = self.trees[s.group_id].root
            for t in extra:
                active = _extend(root, active, t, self.max_depth, insert=False)
            out.append(self._one(s, k, active) if k > 0 else EMPTY)
        return out

    def _one(self, seq: Sequence, k: int, active: list[_Node] | None = None) -> Proposal:
        active = self.active_nodes[seq.seq_id] if active is None else active
        for depth in range(len(active) - 1, self.min_match - 1, -1):
            node = active[depth]
            if node.children:
                tokens = self._walk(node, k)
                if tokens:
                    return Proposal(tokens)
        return EMPTY

    def _walk(self, node: _Node, k: int) -> list[int]:
        tokens, confidence = [], 1.0
        while len(tokens) < k and node.children:
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            confidence *= child.count / total
            if confidence < self.min_confidence:
                break
            tokens.append(token)
            node = child
        return tokens

    def stop(self, seq: Sequence) -> None:
        super().stop(seq)
        self.active_nodes.pop(seq.seq_id, None)
        tree = self.trees.get(seq.group_id)
        if tree is not None:
            tree.stopped += 1  # the finished completion stays in the tree for its running siblings
            if tree.stopped == seq.group.num_generations:
                del self.trees[seq.group_id]
