"""Parity against transformers, the checks every family's test makes: greedy tokens, the first position's log-prob,
the last position's logits of one prefill (transformers is the oracle, run without a cache)."""
from __future__ import annotations

import torch

from tsterm import LLM, SamplingParams


def reference_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers as the oracle: full-sequence forward every step (no cache), argmax. The new ids and the first
    step's logits."""
    ids = list(prompt)
    first_logits = None
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            if first_logits is None:
                first_logits = logits
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], first_logits


def random_prompts(vocab_size: int, lengths=(11, 5, 17), seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def assert_greedy_matches(llm: LLM, hf_model, prompts: list[list[int]], new_tokens: int) -> None:
    """Each prompt's greedy reply equals transformers', and its first token's log-prob is transformers' (1e-4)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        expected, ref_logits = reference_greedy(hf_model, prompt, new_tokens)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        ours = torch.tensor(out.outputs[0].logprobs[0]["logprob"])
        ref = torch.log_softmax(ref_logits, -1)[expected[0]]
        assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-5)


def assert_last_logits_close(llm: LLM, hf_model, prompt: list[int], rel_tol: float = 1e-4) -> None:
    """The last position's logits of one prefill of `prompt`, relative to transformers' largest logit. The engine
    must be idle; its one-token request is finished before returning."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    ours = engine.executor.execute(engine.scheduler.schedule())[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1]
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < rel_tol, f"relative error {rel:.2e}"
    engine.step()  # (finishes the request: its blocks are freed)
