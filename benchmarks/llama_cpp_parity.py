"""Does llama.cpp answer like transformers? The quickstart's GGUF exports against its merged model.

    python benchmarks/llama_cpp_parity.py [--run RUN_DIR] [--limit N]

Without ``--run`` it copies ``examples/quickstart`` to a temporary folder, adds
``[[export]] use = "gguf"`` (f16 and q8_0) and runs the plan (about 3 minutes on 2 cores). A ``--run``
without a ``gguf`` export gets one from a second run with no stages, on its merged model. Then, for
each held-out prompt (``data/eval.jsonl``, rendered with the run's chat template), it compares:

* tokenization: llama.cpp's tokenizer (read from the GGUF file) against the transformers tokenizer;
* the greedy answer up to the end-of-turn token, at most 8 tokens: llama.cpp's (top_k 1) against
  transformers' (argmax of the merged model's logits, token by token).

Needs llama-cpp-python (in the ``test`` extra). ``tests/test_gguf.py`` runs it and checks the counts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPORT = '\n[[export]]\nname = "gguf"\nuse = "gguf"\ntypes = ["f16", "q8_0"]\n'
MAX_NEW_TOKENS = 8


def quickstart_with_gguf(folder: Path) -> Path:
    """Run the quickstart plan with a GGUF export in ``folder``; return the run folder."""
    project = folder / "quickstart"
    shutil.copytree(ROOT / "examples" / "quickstart", project, ignore=shutil.ignore_patterns("runs"))
    plan = project / "plan.toml"
    plan.write_text(plan.read_text(encoding="utf-8") + EXPORT, encoding="utf-8")
    return run_plan(plan)


def gguf_plan(run: Path, folder: Path) -> Path:
    """A plan with no stages that exports quickstart run ``run``'s merged model again and as GGUF (f16,
    q8_0), in ``folder`` beside a copy of its data: its run is one :func:`parity` reads, without training
    again."""
    project = folder / "quickstart-gguf"
    shutil.copytree(run.parent.parent / "data", project / "data")
    plan = project / "plan.toml"
    plan.write_text(f'[run]\nname = "quickstart"\n\n[model]\nuse = "hf"\npath = "{run / "exports" / "merged"}"\n\n'
                    '[template]\nuse = "native"\n\n[[export]]\nuse = "merged"\n' + EXPORT, encoding="utf-8")
    return plan


def run_plan(plan: Path) -> Path:
    result = subprocess.run([sys.executable, "-m", "ftcore", "run", str(plan)], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"ftcore run {plan} failed:\n{result.stderr[-3000:]}")
    return plan.parent / "runs" / "quickstart"


def parity(run: Path, limit: int | None = None) -> list[dict]:
    """One row per GGUF file in the run's ``gguf`` export: prompts, and how many tokenize the same and
    get the same greedy answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftcore_plugins.common.run_model import load_gguf

    merged = run / "exports" / "merged"
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    stops = model.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops])
    rows = [json.loads(line) for line in (run.parent.parent / "data" / "eval.jsonl").read_text().splitlines()]
    prompts = [tokenizer.apply_chat_template(r["messages"][:1], add_generation_prompt=True, tokenize=False)
               for r in rows[:limit]]

    def greedy(ids: list[int]) -> list[int]:
        out: list[int] = []
        with torch.no_grad():
            for _ in range(MAX_NEW_TOKENS):
                token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
                if token in stops:
                    break
                out.append(token)
        return out

    expected = [(ids, greedy(ids)) for ids in (tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts)]
    results = []
    for file in sorted((run / "exports" / "gguf").glob("*.gguf")):
        llm = load_gguf(file, n_ctx=0, verbose=False)
        same_tokens = same_answer = 0
        for prompt, (ids, answer) in zip(prompts, expected):
            same_tokens += llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
            got: list[int] = []
            for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
                if token in stops or len(got) == MAX_NEW_TOKENS:
                    break
                got.append(token)
            same_answer += got == answer
        results.append({"file": file.name, "bytes": file.stat().st_size, "prompts": len(prompts),
                        "same_tokenization": same_tokens, "same_greedy_answer": same_answer})
        llm.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a quickstart run folder with a `gguf` export (default: make one)")
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run or quickstart_with_gguf(Path(tmp))
        if not (run / "exports" / "gguf").is_dir():
            run = run_plan(gguf_plan(run, Path(tmp)))
        results = parity(run, args.limit)
    print("| file | bytes | same tokenization | same greedy answer |\n|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['file']} | {r['bytes']:,} | {r['same_tokenization']}/{r['prompts']} | "
              f"{r['same_greedy_answer']}/{r['prompts']} |")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
