"""llama.cpp's own converter, ``convert_hf_to_gguf.py`` with its ``gguf-py``, for the GGUF exporter.

The converter writes about a hundred architectures (Qwen3, Gemma 1/2/3, Phi-3, ...). It is not on
PyPI as a package: it ships in llama-cpp-python's source distribution (``vendor/llama.cpp/``), not
in its wheel. ftcore does not copy it; it runs it, as a separate Python process, from where it is:

1. the exporter's ``converter_path`` option, or ``$FTCORE_LLAMA_CPP``: a llama.cpp source tree (a
   folder holding ``convert_hf_to_gguf.py``) or a llama-cpp-python sdist (``.tar.gz``, unpacked
   once into the folder below);
2. ``$XDG_DATA_HOME/ftcore/llama.cpp/<version>/`` (``~/.local/share/ftcore/...``), where

       python -m ftcore_plugins.exporters.llama_cpp_converter

   puts it: pip downloads the source distribution of the installed llama-cpp-python version (the
   converter then writes what that llama.cpp reads), and only the converter's files are kept
   (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``, ``LICENSE``, about 3 MB), with llama.cpp's
   copies of official chat templates (``models/templates/``, 0.5 MB, which ftcore's tests render:
   :func:`official_template`). This is the one step that needs the network; ``--sdist FILE`` takes a
   source distribution you already have, and a second run replaces what the first one kept;
3. a source tree beside the installed ``llama_cpp`` package (an editable or source install).

Exports never download anything. The converter needs ``torch``, ``transformers``, ``numpy`` (all
ftcore's) and ``sentencepiece``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

SCRIPT = "convert_hf_to_gguf.py"
ENV = "FTCORE_LLAMA_CPP"
FETCH = "python -m ftcore_plugins.exporters.llama_cpp_converter"
TEMPLATES = "models/templates"
# What the converter needs of a llama.cpp tree: the script, its package (newer trees), gguf-py, the licence;
# and the models' official chat templates, exactly as they ship (MIT, like the rest), for template tests.
KEEP = (SCRIPT, "conversion/", "gguf-py/", "LICENSE", TEMPLATES + "/")


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def data_dir() -> Path:
    """Where the fetch step puts converters, one folder per llama.cpp version."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "ftcore" / "llama.cpp"


def find_converter(path: str | Path | None = None) -> Path | None:
    """The llama.cpp tree holding ``convert_hf_to_gguf.py`` (see the module's docstring), or None."""
    given = path or os.environ.get(ENV)
    if given:
        return _tree(Path(given).expanduser())
    version = llama_cpp_version()
    candidates = []
    if version is not None:
        candidates.append(data_dir() / version)
    elif data_dir().is_dir():  # no llama-cpp-python: the newest one fetched
        candidates += sorted(data_dir().iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    try:
        import importlib.util

        spec = importlib.util.find_spec("llama_cpp")
        if spec is not None and spec.origin:
            package = Path(spec.origin).parent
            candidates += [package.parent / "vendor" / "llama.cpp", package / "vendor" / "llama.cpp"]
    except (ImportError, ValueError):
        pass
    for candidate in candidates:
        if (candidate / SCRIPT).is_file():
            return candidate
    return None


def official_template(name: str, tree: Path | None = None) -> Path | None:
    """llama.cpp's copy of a model's official chat template, ``<tree>/models/templates/<name>.jinja`` (``name``
    as llama.cpp names the file: ``CohereForAI-c4ai-command-r7b-12-2024-tool_use``), in ``tree`` or the converter
    :func:`find_converter` finds; None when it is not there (a converter fetched before the templates were
    kept has none: run the fetch step again)."""
    tree = tree or find_converter()
    path = tree / TEMPLATES / f"{name}.jinja" if tree is not None else None
    return path if path is not None and path.is_file() else None


def _tree(path: Path) -> Path | None:
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        target = data_dir() / _sdist_version(path)
        if not (target / SCRIPT).is_file():
            unpack(path, target)
        return target
    for candidate in (path, path / "vendor" / "llama.cpp"):
        if (candidate / SCRIPT).is_file():
            return candidate
    return None


def _sdist_version(path: Path) -> str:
    match = re.search(r"(\d+(?:\.\d+)+)", path.name)
    return match.group(1) if match else path.name.split(".tar")[0]


def unpack(sdist: Path, target: Path) -> Path:
    """The files KEEP names of a llama-cpp-python sdist (or a llama.cpp source archive), into ``target`` (replaced)."""
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=_mkdir(target.parent)))
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for member in tar.getmembers():
                parts = member.name.split("/")
                # <pkg>/vendor/llama.cpp/<rest> in the sdist; <tree>/<rest> in a llama.cpp archive
                rest = "/".join(parts[3:]) if parts[1:3] == ["vendor", "llama.cpp"] else "/".join(parts[1:])
                if (member.isfile() and rest and ".." not in parts
                        and any(rest == k or (k.endswith("/") and rest.startswith(k)) for k in KEEP)):
                    member.name = rest
                    members.append(member)
            if not any(m.name == SCRIPT for m in members):
                raise SystemExit(f"{sdist}: no {SCRIPT} in it (expected llama-cpp-python's source distribution)")
            tar.extractall(tmp, members=members, filter="data") if sys.version_info >= (3, 12) \
                else tar.extractall(tmp, members=members)  # noqa: S202 - members filtered above
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch(version: str | None = None, sdist: Path | None = None) -> Path:
    """Download (with pip) llama-cpp-python's source distribution and keep the converter from it."""
    if sdist is not None:
        return unpack(sdist, data_dir() / _sdist_version(sdist))
    version = version or llama_cpp_version()
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([sys.executable, "-m", "pip", "download", spec, "--no-deps", "--no-binary", ":all:",
                                 "-d", tmp, "--disable-pip-version-check", "-q"],
                                capture_output=True, text=True)
        archives = sorted(Path(tmp).glob("*.tar.gz"))
        if result.returncode != 0 or not archives:
            raise SystemExit(f"pip could not download {spec}'s source distribution: "
                             f"{(result.stderr.strip().splitlines() or ['no archive'])[-1]}")
        return unpack(archives[0], data_dir() / (version or _sdist_version(archives[0])))


@lru_cache(maxsize=8)
def registered(tree: Path) -> frozenset[str]:
    """The transformers architecture class names (``Qwen3ForCausalLM``) the converter in ``tree`` converts,
    read from its ``@ModelBase.register(...)`` lines without importing it."""
    files = [tree / SCRIPT, *sorted((tree / "conversion").glob("*.py"))]
    names: set[str] = set()
    for file in files:
        for args in re.findall(r"@ModelBase\.register\(([^)]*)\)", file.read_text(encoding="utf-8")):
            names.update(re.findall(r"[\"']([A-Za-z0-9_]+)[\"']", args))
    return frozenset(names)


# Config keys the converter still reads by their old names, which transformers 5 folds into
# ``rope_parameters`` (GPT-NeoX's and Cohere 2's share of rotated dimensions): old name -> its key there.
# The converter reads a config through transformers (``AutoConfig(...).to_dict()``), which has dropped the old
# name, so the converter's process puts it back in what the converter loaded: without, GPT-NeoX (Pythia) failed
# with a bare ``KeyError: 'rotary_pct'``.
LEGACY_ROPE_KEYS = {"rotary_pct": "partial_rotary_factor"}
# The same for keys transformers 5 dropped for another of the config: old name -> the key it reads instead
# (GPT-2's context length; without, every GPT-2 failed with ``KeyError: 'n_ctx'``).
LEGACY_KEYS = {"n_ctx": "n_positions"}

# llama.cpp's name for a byte-level BPE pre-tokenizer (tokenizer.ggml.pre), by the regex that splits
# the text before BPE (src/llama-vocab.cpp implements each name with these regexes).
GPT2_PRE = "gpt-2"  # a plain ByteLevel pre-tokenizer: GPT-2's own regex
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",  # Llama 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",  # Qwen2, Qwen2.5
}


def bpe_pre_tokenizer(backend: dict) -> str | None:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE tokenizer (its ``tokenizer.json`` as a
    dict), or None if it is not one llama.cpp is known to split the same way."""
    model = backend.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return None
    pre = backend.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return GPT2_PRE
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel" \
            and not parts[1].get("use_regex", True):
        return PRE_TOKENIZERS.get(parts[0].get("pattern", {}).get("Regex"))
    return None


# The converter's process: the tree first on the path (its gguf-py and conversion package), then ftcore's
# patches and checks (_converter_process.py), which import nothing else before the converter's modules.
BOOT = ("import sys; sys.path[:0] = [sys.argv[1] + '/gguf-py', sys.argv[1]]; "
        "from ftcore_plugins.exporters._converter_process import main; sys.exit(main(sys.argv[2:]))")


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    return env


def convert(tree: Path, jobs: list[tuple[Path, Path, str]], name: str | None = None, eot: int | None = None,
            pre_tokenizer: str | None = None, untie: bool = False) -> tuple[list[str | None], subprocess.CompletedProcess]:
    """``convert_hf_to_gguf.py MODEL --outfile TARGET --outtype OUTTYPE`` for each ``(model, target, outtype)``
    job, all in one Python process of its own (its imports, several seconds, once), offline, with the tree's
    own gguf-py and ftcore's patches (_converter_process.py). ``eot`` becomes ``tokenizer.ggml.eot_token_id``;
    ``pre_tokenizer`` names the BPE pre-tokenizer (else the converter's own, by its hash, or ftcore's, by its
    regex); ``untie`` writes a tied output layer out. Returns why each job failed (None where its file was
    written), and the process (its stderr holds the converter's log)."""
    script = tree / SCRIPT
    groups: list[str] = []
    for model, target, outtype in jobs:
        groups += ["--", str(model), "--outfile", str(target), "--outtype", outtype,
                   *(["--model-name", name] if name else [])]
    options = json.dumps({"eot": eot, "pre_tokenizer": pre_tokenizer, "untie": untie})
    with tempfile.TemporaryDirectory(prefix="ftcore-gguf-") as tmp:
        results = Path(tmp) / "results.json"
        process = subprocess.run([sys.executable, "-c", BOOT, str(tree), "convert", options, str(results), str(script),
                                  *groups], capture_output=True, text=True, env=_environment(), stdin=subprocess.DEVNULL)
        answers = json.loads(results.read_text(encoding="utf-8")) if results.exists() else []
    if len(answers) < len(jobs):  # the process ended before them: its last words
        lines = [line for line in (process.stderr + process.stdout).splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit status {process.returncode}"
        answers += [why] * (len(jobs) - len(answers))
    return [why if why is not None or target.exists() else "it wrote no file"
            for why, (_, target, _) in zip(answers, jobs)], process


def check(tree: Path, jobs: list[dict], pre_tokenizer: str | None = None, timeout: float = 1800) -> list[str | None]:
    """For each job (a folder with a model's config.json and tokenizer files, no weights; see
    ``_converter_process.check``), why llama.cpp's converter in ``tree`` cannot write that model, or None:
    everything the converter does short of reading a weight's values (the architecture, every tensor's name
    and shape from the model transformers builds on the meta device, every metadata key, the tokenizer), with
    llama.cpp loading the file it writes, data left out. One process for all the jobs: it imports torch,
    transformers and the converter (several seconds), then takes a few seconds a job for a 128k-token
    vocabulary."""
    with tempfile.TemporaryDirectory(prefix="ftcore-gguf-check-") as tmp:
        listed, answers = Path(tmp) / "jobs.json", Path(tmp) / "answers.json"
        listed.write_text(json.dumps(jobs), encoding="utf-8")
        try:
            result = subprocess.run([sys.executable, "-c", BOOT, str(tree), "check", pre_tokenizer or "", str(listed),
                                     str(answers)], capture_output=True, text=True, env=_environment(),
                                    stdin=subprocess.DEVNULL, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [f"its check did not finish in {timeout:.0f} s"] * len(jobs)
        if result.returncode != 0 or not answers.exists():
            lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
            why = lines[-1].strip() if lines else f"exit status {result.returncode}"
            return [f"its check failed: {why}"] * len(jobs)
        return json.loads(answers.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=FETCH, description="Get llama.cpp's convert_hf_to_gguf.py for ftcore's GGUF export (once, with the "
        "network): it ships in llama-cpp-python's source distribution.")
    parser.add_argument("--version", help="llama-cpp-python version (default: the installed one, else the latest)")
    parser.add_argument("--sdist", type=Path, help="a llama-cpp-python source distribution you already have "
                        "(.tar.gz): no download")
    parser.add_argument("--where", action="store_true", help="print where the converter is found, and exit")
    args = parser.parse_args(argv)
    if args.where:
        tree = find_converter()
        print(tree if tree else f"not found; run: {FETCH}")
        return 0 if tree else 1
    tree = fetch(args.version, args.sdist)
    templates = len(list((tree / TEMPLATES).glob("*.jinja")))
    print(f"llama.cpp's converter is in {tree} ({len(registered(tree))} architectures, {templates} chat templates)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
