"""``[[export]] use = "mlflow"``: a run's export registered in an MLflow model registry, read back with
``MlflowClient``, and the registered artifact loaded with plain transformers and peft."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

pytest.importorskip("mlflow")

STAGES = """
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = { use = "lora", r = 4, lora_alpha = 8 }
epochs = 1
batch_size = 8
max_length = 64
learning_rate = 2e-3

[[evaluate]]
use = "perplexity"
data = "chat_eval"

[[export]]
use = "merged"

[[export]]
use = "adapter"
"""

REGISTRY = """
[[export]]
name = "{name}"
use = "mlflow"
source = "{source}"
model_name = "tiny-chat"
alias = "{alias}"
tags = {{ team = "nlp" }}
"""


def test_a_registered_model_reads_back_and_loads(tiny_project, monkeypatch):
    import mlflow
    import torch
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_project(STAGES + REGISTRY.format(name="registry", source="merged", alias="candidate")
                        + REGISTRY.format(name="registry_adapter", source="adapter", alias="adapter"))
    r = run_cli("run", str(path))
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tiny_project.dir / "runs" / "tiny"
    record = json.loads((run_dir / "exports" / "registry" / "registered.json").read_text())
    uri = f"sqlite:///{tiny_project.dir / 'runs' / '_mlflow' / 'mlflow.db'}"
    assert record["tracking_uri"] == uri and record["version"] == 1

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version_by_alias("tiny-chat", "candidate")
    assert int(version.version) == 1
    assert int(client.get_model_version_by_alias("tiny-chat", "adapter").version) == 2  # the second export
    manifest = json.loads((run_dir / "manifest.json").read_text())
    tags = version.tags
    assert tags["ftcore.plan_fingerprint"] == manifest["plan_fingerprint"]
    assert tags["ftcore.base_model"] == "scratch" and tags["team"] == "nlp"  # [model] use = "scratch", no path
    assert tags["ftcore.method"] == "sft: sft + lora" and tags["ftcore.export"] == "merged"
    for file, data in manifest["data_files"].items():
        assert tags[f"ftcore.data.{data['data']}.{file.rsplit('/', 1)[-1]}.sha256"] == data["sha256"]
    # The metrics are the run's evaluations, by phase, and its compute hours.
    metrics = client.get_run(version.run_id).data.metrics
    for phase in ("before", "after"):
        result = json.loads((run_dir / "evaluations" / f"{phase}.json").read_text())
        assert metrics[f"{phase}/perplexity/perplexity"] == pytest.approx(result["perplexity"]["perplexity"], rel=1e-12)
    hours = metrics["ftcore/wall_hours"]
    assert 0 < hours < 1 and metrics["ftcore/device_hours"] == pytest.approx(hours)
    assert "CPU" in tags["ftcore.devices"]

    # The artifact, fetched through the registry alone, is a transformers model: the merged export's logits.
    mlflow.set_registry_uri(uri)  # models:/ URIs resolve in the registry
    # and the tracking store too: MLflow's default one is ./mlflow.db, in the working tree
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    local = download_artifacts(artifact_uri="models:/tiny-chat@candidate", dst_path=str(tiny_project.dir / "dl"))
    model = AutoModelForCausalLM.from_pretrained(local).eval()
    tokenizer = AutoTokenizer.from_pretrained(local)
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "exports" / "merged").eval()
    ids = tokenizer("Which word is an animal?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, exported(ids).logits)
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    # The adapter version loads with peft on the base its adapter_config.json names.
    adapter_dir = download_artifacts(artifact_uri="models:/tiny-chat@adapter", dst_path=str(tiny_project.dir / "dl_adapter"))
    base = json.loads((run_dir / "exports" / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir).eval()
    with torch.no_grad():
        assert torch.allclose(peft_model(ids).logits, exported(ids).logits, atol=1e-4)

    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the second run finds the store by itself
    # A second run registers version 3 of the same model in the same store, and moves the alias.
    second = tiny_project(STAGES.replace("epochs = 1", "epochs = 2")
                          + REGISTRY.format(name="registry", source="merged", alias="candidate"), name="second.toml")
    second.write_text(second.read_text().replace('name = "tiny"', 'name = "tiny2"'))
    assert run_cli("run", str(second)).returncode == 0
    assert int(client.get_model_version_by_alias("tiny-chat", "candidate").version) == 3


@pytest.mark.parametrize("source,alias,expected", [
    ("merged2", "candidate", "export[2].source: no [[export]] named 'merged2' to register; exports: merged, adapter"),
    ("merged", "v3", "export[2].alias: 'v3' is not an alias MLflow accepts"),
    ("merged", "latest", "export[2].alias: 'latest' is not an alias MLflow accepts"),
])
def test_a_bad_registry_export_is_one_line(tiny_project, source, alias, expected):
    path = tiny_project(STAGES + REGISTRY.format(name="registry", source=source, alias=alias))
    r = run_cli("validate", str(path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: {expected}"), r.stderr


def test_a_gguf_export_is_not_registrable(tiny_project):
    pytest.importorskip("gguf")
    path = tiny_project(STAGES + '\n[[export]]\nuse = "gguf"\n'
                        + REGISTRY.format(name="registry", source="gguf", alias="candidate"))
    r = run_cli("validate", str(path))
    assert r.returncode == 2 and "export 'gguf' is 'gguf'; the registry takes a folder transformers or peft loads" \
        in r.stderr, r.stderr
