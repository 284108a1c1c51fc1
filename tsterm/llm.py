"""LLM: the offline Python API. `LLM(model_dir).generate(prompts, SamplingParams(temperature=0))`."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tsterm.config import EngineConfig, SamplingParams
from tsterm.engine.engine import Engine
from tsterm.engine.executor import ExecutorFactory
from tsterm.engine.model_runner import ModelRunner
from tsterm.model.loader import ProgressFn
from tsterm.outputs import RequestOutput

Prompt = str | list[int]


def executor_for(config: EngineConfig) -> ExecutorFactory:
    """The executor the engine runs: one process, or rank 0 of tensor x expert parallel workers."""
    if config.tensor_parallel_size * config.expert_parallel_size == 1:
        return ModelRunner
    from tsterm.distributed import DistributedExecutor  # torch.distributed: loaded only when asked for

    return DistributedExecutor


class LLM:
    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", progress: ProgressFn | None = None,
                 **engine_options: Any):
        self.config = EngineConfig.from_options(str(model), dtype=dtype, device=device, **engine_options)
        self.engine = Engine(self.config, progress=progress, executor=executor_for(self.config))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion, batched together; results in prompt order.

        A single prompt may be a string or a token-id list; `on_output` sees every streamed partial output.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:  # a bad prompt anywhere in the batch leaves nothing of the batch queued
            for prompt, sp in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, sp))
            while len(final) < len(ids):
                for out in self.engine.step():
                    if on_output is not None:
                        on_output(out)
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [final[rid] for rid in ids]

    def chat(self, messages: list[dict] | Sequence[list[dict]], params: SamplingParams | None = None,
             tools: list[dict] | None = None, **template_kwargs: Any) -> list[RequestOutput]:
        """Renders conversation(s) with the model's chat template, then generates the assistant reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=True, tokenize=True,
                                                      **template_kwargs) for c in conversations]
        return self.generate(prompts, params)

    def stats(self) -> dict[str, int | float]:
        return self.engine.stats()
