"""Write data/train.tsv: the quickstart's training task (name the animal among three words) as
tab-separated instruction/output rows, so the example plan trains on the same task through the
``tsv`` source. Deterministic: regenerate with ``python examples/ftcore-example-data/make_data.py``."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
QUICKSTART = HERE.parent / "quickstart" / "data" / "train.jsonl"


def main() -> None:
    lines = ["instruction\toutput"]
    for raw in QUICKSTART.read_text(encoding="utf-8").splitlines():
        user, assistant = json.loads(raw)["messages"]
        lines.append(f"{user['content']}\t{assistant['content']}")
    (HERE / "data").mkdir(exist_ok=True)
    (HERE / "data" / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
