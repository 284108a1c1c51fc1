"""LLM: the offline Python API. `LLM(model_dir).generate(prompts, SamplingParams(temperature=0))`."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from tsterm.config import EngineConfig, SamplingParams, generation_defaults
from tsterm.engine.engine import Engine
from tsterm.engine.executor import ExecutorFactory
from tsterm.engine.model_runner import ModelRunner
from tsterm.errors import ModelLoadError
from tsterm.harmony import REASONING_KEYS, is_harmony, read_reply, split_shown
from tsterm.harmony import render as harmony_render
from tsterm.model.loader import ProgressFn
from tsterm.outputs import RequestOutput

Prompt = str | list[int]


def executor_for(config: EngineConfig) -> ExecutorFactory:
    """The executor the engine runs: one process, or rank 0 of tensor x expert parallel workers."""
    if config.tensor_parallel_size * config.expert_parallel_size == 1:
        return ModelRunner
    from tsterm.distributed import DistributedExecutor  # torch.distributed: loaded only when asked for

    return DistributedExecutor


def _with_reimport_hint(error: ModelLoadError, model_dir: str) -> ModelLoadError:
    """A damaged file in a directory `tsterm import-gguf` wrote is fixed by importing again, not by a download."""
    from tsterm.convert.gguf import reimport_command

    command = reimport_command(model_dir)
    if command is None:
        return error
    message = re.sub(r";? ?\(?re-download it\)?", "", str(error)).rstrip()
    return ModelLoadError(f"{message}; {model_dir} is tsterm's import of a GGUF file: import it again with `{command}`")


def _reasoning_apart(message: dict) -> dict:
    """An assistant message whose content opens with a `<think>` block (a harmony reply as `LLM.chat` gives it) as
    its content and `reasoning_content`; any other message as it is."""
    if not isinstance(message, dict) or message.get("role") != "assistant" or not isinstance(
            message.get("content"), str) or any(key in message for key in REASONING_KEYS):
        return message
    reasoning, answer = split_shown(message["content"])
    return {**message, "content": answer, "reasoning_content": reasoning} if reasoning else message


class LLM:
    """An engine in this process. `model`: what the CLI's `--model` takes - a model directory, a shipped model name
    (`smollm2-135m-instruct`, imported on first use) or `demo:NAME` (generated on first use).

    `sampling` is what `generate`/`chat` use when given no params (default: the sampling keys of the model's
    generation_config.json over `SamplingParams()`'s), `system_prompt` what
    `chat` puts first in a conversation that has no system message; `from_profile` sets both from the profile."""

    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", progress: ProgressFn | None = None,
                 sampling: SamplingParams | None = None, system_prompt: str | None = None, **engine_options: Any):
        from tsterm.convert.shipped import resolve_model  # a shipped or demo model: prepared on first use

        self.config = EngineConfig.from_options(resolve_model(str(model)), dtype=dtype, device=device,
                                                **engine_options)
        try:
            self.engine = Engine(self.config, progress=progress, executor=executor_for(self.config))
        except ModelLoadError as e:
            raise _with_reimport_hint(e, self.config.model) from None
        self.tokenizer = self.engine.tokenizer
        # the model's own recommendation (its generation_config.json) where the caller gives none
        self.sampling = sampling or SamplingParams(**generation_defaults(self.config.model))
        self.system_prompt = system_prompt

    @classmethod
    def from_profile(cls, profile: str, progress: ProgressFn | None = None, **engine_options: Any) -> LLM:
        """The engine a profile (name or YAML path) describes, with its sampling defaults and system prompt;
        `engine_options` (dtype, device, kv_cache_memory, ...) override the profile's keys."""
        from tsterm.profiles import load_profile

        loaded = load_profile(profile)
        options = {**loaded.engine_options(), **engine_options}
        from tsterm.convert.shipped import resolve_model

        return cls(resolve_model(loaded.model(), loaded.model_base()), progress=progress,
                   sampling=loaded.sampling_params(), system_prompt=loaded.system_prompt, **options)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion, batched together; results in prompt order.

        A single prompt may be a string or a token-id list; `on_output` sees every streamed partial output.
        Every request is checked before any is queued: a bad field raises a ValueError (RequestError or ConfigError)
        that names it and the range it must be in, and nothing of the batch is queued. Given `params`, each one's
        max_tokens must fit in the context after its prompt; the defaults (`self.sampling`) are a cap instead: the
        context's end also ends a reply (finish_reason "length").
        If the engine fails on a request while running it (a kernel or the detokenizer raised), that request's output
        has finish_reason "error" and its `error`; the others run on and are unaffected.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        strict = params is not None  # the caller asked for these max_tokens
        params_list = list(params) if isinstance(params, Sequence) else [params or self.sampling] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:  # a bad prompt anywhere in the batch leaves nothing of the batch queued
            for prompt, sp in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, sp, strict_max_tokens=strict))
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
        """Renders conversation(s) in the model's chat format, then generates the assistant reply.

        The format is the checkpoint's chat template, but for a model that writes harmony (gpt-oss:
        `tsterm.harmony.is_harmony`, the choice the agent loop, the server and the chat views make): its prompt is
        tsterm's harmony rendering (`tsterm.harmony.render`; `reasoning_effort` and the other harmony options as
        keyword arguments), and each reply's `text` is read from its ids (the engine's text leaves harmony's markers
        out): the final channel, after the analysis channel as the `<think>` block a reasoning family's reply opens
        with (`tsterm.harmony.shown_reply`), a tool call as the model wrote it. An assistant message whose content is
        in that form is read back (its `<think>` block as its reasoning), so a reply goes back into the history as
        it came."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if self.system_prompt:
            conversations = [c if c and c[0].get("role") == "system" else
                             [{"role": "system", "content": self.system_prompt}, *c] for c in conversations]
        if not is_harmony(self.tokenizer, self.engine.model_config.model_type):
            prompts = [self.tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=True, tokenize=True,
                                                          **template_kwargs) for c in conversations]
            return self.generate(prompts, params)
        prompts = [self.tokenizer.encode(harmony_render([_reasoning_apart(m) for m in c], tools, True,
                                                        **template_kwargs)) for c in conversations]
        outputs = self.generate(prompts, params)
        for output in outputs:
            for completion in output.outputs:
                completion.text = read_reply(self.tokenizer, completion.token_ids).shown
        return outputs

    def stats(self) -> dict[str, int | float]:
        return self.engine.stats()
