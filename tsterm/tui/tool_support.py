"""Whether a model's chat template shows it the tools, and which installed profiles' templates do.

An agent session offers tools by rendering them into the prompt through the chat template. A template without a tools
section drops them silently: the model never learns they exist and answers on its own ("37 + 12 = 45" on SmolLM2).
The check renders a probe tool and looks for its name in the prompt.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tsterm.errors import TstermError

PROBE_NAME = "tsterm_probe_tool"
_PROBE_TOOL = {"type": "function", "function": {"name": PROBE_NAME, "description": "a probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CHAT = [{"role": "user", "content": "?"}]


def renders_tools(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template puts the tools it is given into the prompt."""
    try:
        return PROBE_NAME in tokenizer.apply_chat_template(_PROBE_CHAT, tools=[_PROBE_TOOL], tokenize=False)
    except TstermError:  # no template, or one that refuses the probe: it shows no tools either
        return False


def tool_profiles() -> list[str]:
    """The installed profiles whose model is on disk and whose template renders tools. Blocking (reads each
    model's tokenizer): call it off the UI thread. Nothing is imported, generated or downloaded."""
    from tsterm.profiles import list_profiles
    from tsterm.tokenizer import Tokenizer

    names = []
    for name, _, path in list_profiles():
        model_dir = _model_on_disk(path)
        if model_dir is None:
            continue
        try:
            tokenizer = Tokenizer.from_dir(model_dir)
        except TstermError:
            continue
        if renders_tools(tokenizer):
            names.append(name)
    return names


def _model_on_disk(profile_path: Path) -> Path | None:
    """The profile's model directory when it is there already: the profile's own rule of where its model's files
    are once it is on disk (shipped and demo models that are imported or generated on first use count only once they
    have been); nothing is imported, generated or downloaded."""
    from tsterm.profiles import load_profile

    try:
        profile = load_profile(str(profile_path))
    except TstermError:  # a broken profile, or one whose ${ENV} is unset
        return None
    config = profile._model_config_path()  # noqa: SLF001 - the profile's rule, not a copy of it
    if config is None:
        return None
    path = config.parent
    return path if (path / "tokenizer.json").is_file() else None
