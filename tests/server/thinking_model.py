"""A tiny Qwen3-MoE checkpoint that thinks and calls a tool, for the history-policy tests of the server.

Its tokenizer is the in-house Qwen3 family's (tests/helpers/reasoning_templates.py: a thinking template that drops
the reasoning of replies before the last user message, ChatML, Hermes tool calls) with two more added tokens, the
reasoning REASONING and the call CALL. Its weights make greedy decoding a fixed chain from the generation prompt's last
token: `\\n` -> `<think>` -> REASONING -> `</think>` -> CALL -> `<|im_end|>`, i.e. every reply is

    <think>\\nI should read the document first.\\n</think>\\n\\n<tool_call>\\n{"name": "read_document", ...}\\n</tool_call>

ended by the stop token, as the family's model writes a reply. The chain lives in the embeddings and the LM head
(random unit directions, each token's successor scored ~8 sqrt(hidden) above the rest); the attention and expert
layers keep transformers' small random weights, so every logit, and so every logprob, depends on the whole context
while the argmax does not: a prompt computed wrongly (a cached prefix that is not the prompt's) shows in the
logprobs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.reasoning_templates import FAMILIES, family_tokenizer

REASONING = "\nI should read the document first.\n"
TOOL = "read_document"
ARGUMENTS = {"name": "tides"}
CALL = '\n\n<tool_call>\n{"name": "' + TOOL + '", "arguments": ' + json.dumps(ARGUMENTS) + "}\n</tool_call>"
REPLY_CONTENT = f"<think>{REASONING}</think>\n\n"  # the content a client gets next to the call (reasoning inline)
TOOLS = [{"type": "function", "function": {"name": TOOL, "description": "Read a document by its name.",
                                           "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                                                          "required": ["name"]}}}]
HIDDEN = 64


def make_thinking_model(path: Path, max_positions: int = 4096) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer files) into `path`."""
    import transformers

    family = FAMILIES["qwen3"]
    backend = family_tokenizer(family)._backend
    backend.add_tokens([REASONING, CALL])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": family.stops[0],
                                                            "chat_template": family.template}))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [backend.token_to_id(t) for t in family.stops]}))

    def one(text: str) -> int:
        ids = backend.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    prompt_end = backend.encode("<|im_start|>assistant\n", add_special_tokens=False).ids[-1]
    chain = [prompt_end, one("<think>"), one(REASONING), one("</think>"), one(CALL), one(family.stops[0])]
    vocab = backend.get_vocab_size(with_added_tokens=True)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False)
    config.eos_token_id = None  # generation_config.json says which ids end a reply
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval().float()
    with torch.no_grad():
        embed = torch.randn(vocab, HIDDEN)
        embed /= embed.norm(dim=1, keepdim=True) / HIDDEN ** 0.5  # rms 1: the final norm leaves it as it is
        model.model.embed_tokens.weight.copy_(embed)
        head = torch.zeros(vocab, HIDDEN)
        for token, successor in zip(chain, chain[1:]):
            head[successor] += 8.0 * embed[token] / HIDDEN ** 0.5
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    return path
