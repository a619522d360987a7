"""The trainer fuzzer's tool-calling draw (`Case.tools`): TRL's tool loop (`tools=[...]`) on fixed completions.

A tool case runs with conversational prompts, a byte-level tokenizer with Qwen3's chat template (TRL renders the
tools' schema into the prompt and parses the completions' tool calls with it) and a model sized to its vocabulary.
Its first-turn completions are, as a function of the prompt and the row, either random text or one of three tool
calls (a tool that answers, one that raises, one that does not exist): TRL runs the tool, appends its result to the
conversation and calls `_generate_single_turn` again (one row per sample), the same function answering; a
completion's tool-result tokens are masked out of the loss (`tool_mask`), a result that would pass
`max_completion_length` is rolled back, and TRL logs `tools/call_frequency` and `tools/failure_frequency`.
"""

from __future__ import annotations

import functools
import random

from trl_infinite.testing.tools import divide, multiply

# RoPE families of the matrix the tool cases are drawn from: a prompt with the tools' schema is ~1,100 byte tokens,
# and these take `max_position_embeddings` as their only position limit (set to `MAX_POSITIONS`)
TOOL_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "olmo2", "granite")
MAX_POSITIONS = 2048
# a call is 46-56 tokens; the answer's result ~19, an error's ~50: at 90 an error's result is rolled back as overlong
# and an answer's turn truncated, at 160 one call fits whole, at 240 two
MAX_COMPLETION = (90, 160, 240)
CALLS = (
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
    '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>',  # raises: a failure
    '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>',  # not found: a failure
)


@functools.cache
def tool_tokenizer():
    from trl.chat_template_utils import qwen3_chat_template

    from trl_infinite.testing.offline_models import byte_tokenizer

    return byte_tokenizer(qwen3_chat_template)


TOOLS = [multiply, divide]


def tool_completions(seed: int, max_len: int):
    """`_generate_single_turn` of a tool case: per (prompt, row), a tool call (probability 1/2, each of `CALLS`
    alike) or 1 to 20 random bytes, some ending in the end-of-turn token; at most `max_len` tokens, as `generate`
    would stop. A turn after a tool result has a new prompt, so it draws again (a second call, up to TRL's
    `max_tool_calling_iterations`)."""
    tokenizer = tool_tokenizer()
    eos = tokenizer.eos_token_id
    scripts = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for c in CALLS]

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for i, p in enumerate(prompt_ids):
            rng = random.Random(hash((seed, tuple(p), i % num_generations)))
            if rng.random() < 0.5:
                ids = list(rng.choice(scripts))
            else:
                ids = [rng.randrange(32, 127) for _ in range(rng.randint(1, 20))]
                if rng.random() < 0.4:
                    ids[-1] = eos
            out.append(ids[:max_len])
        return out, None

    return generate
