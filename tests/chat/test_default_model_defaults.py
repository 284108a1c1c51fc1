"""`tsterm run --model DIR` on the imported default model, without a profile: SmolLM2's recommended sampling comes
from the directory's generation_config.json (the import writes it), and stderr says which defaults were used,
the chat template's own system prompt included."""
from __future__ import annotations

import json

from tsterm.cli import main


def test_the_imported_default_model_carries_its_recommended_sampling(default_model_dir, capsys):
    generation = json.loads((default_model_dir / "generation_config.json").read_text(encoding="utf-8"))
    assert (generation["temperature"], generation["top_p"]) == (0.2, 0.9)  # SmolLM2's model card
    assert main(["run", "--model", str(default_model_dir), "--prompt", "Hi", "--max-tokens", "2", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert (f"tsterm: no profile: sampling temperature 0.2, top_p 0.9, top_k 0, max_tokens 2 (--max-tokens, --seed; "
            f"{default_model_dir}/generation_config.json); the chat template's own system prompt ('You are a helpful "
            "AI assistant named SmolLM, trained by Hugging Face') (--system, or a --profile, sets one)\n") in err, err
