"""The README's "Hugging Face models" code runs as written, in 2 gloo ranks.

The README block is taken from README.md at test time; three literals are replaced: the model id
(by a tiny Llama saved in a temporary directory), the output directory, and the
``init_process_group()`` call (the test world already has its group). The test then checks what
the code promises: it trained (the loss went down on a repeated batch), every rank generated
its own number of tokens, and the saved model reproduces the trained model's logits.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from hf_models import llama

README = Path(__file__).resolve().parents[2] / "README.md"
MODEL_ID = '"Qwen/Qwen2.5-0.5B"'
OUTPUT = '"finetuned"'
INIT = "torch.distributed.init_process_group()"


def readme_block() -> str:
    text = README.read_text()
    section = text.split("## Hugging Face models", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README: no python block under 'Hugging Face models'"
    code = match.group(1)
    for literal in (MODEL_ID, OUTPUT, INIT):
        assert literal in code, f"README block no longer contains {literal}"
    return code


def case_readme(code: str, model_dir: str, out_dir: str) -> dict:
    code = code.replace(MODEL_ID, repr(model_dir)).replace(OUTPUT, repr(out_dir))
    code = code.replace(INIT, "pass")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    model, rank = namespace["model"], namespace["rank"]
    torch.distributed.barrier()
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out_dir)
    ids = torch.arange(3, 11).reshape(1, 8)
    with torch.no_grad():
        same = torch.equal(saved(input_ids=ids).logits, model(input_ids=ids).logits)
    prompt, out = namespace["prompt"], namespace["out"]
    return {
        "losses": namespace["losses"],
        "new tokens": out.shape[1] - prompt.shape[1],
        "prompt kept": torch.equal(out[:, : prompt.shape[1]], prompt),
        "saved logits equal": same,
        "rank": rank,
    }


def test_readme_hugging_face_section_runs(world, tmp_path) -> None:
    code = readme_block()
    torch.manual_seed(0)
    model = llama()
    model.generation_config.eos_token_id = None  # each rank generates exactly max_new_tokens
    model.save_pretrained(tmp_path / "model")
    got = world(2).run(
        case_readme, code, str(tmp_path / "model"), str(tmp_path / "out"), timeout=240.0
    )
    for r, result in enumerate(got):
        losses = result["losses"]
        assert losses[-1] < losses[0], f"rank {r}: loss did not go down: {losses}"
        assert result["new tokens"] == 8 + r, f"rank {r}: {result}"
        assert result["prompt kept"] and result["saved logits equal"], f"rank {r}: {result}"
