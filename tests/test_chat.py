"""`ftcore chat`: a run's model in a real terminal (tmux), streaming what `ftcore generate` answers."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from conftest import TINY_HEADER, chat_rows, run_cli, text_rows, write_jsonl

FIRST = "Which word is an animal? old fox tree"
SECOND = "Which word is an animal? cow blue runs"


def answers(run, tmp_path, rows, *args):
    """What `ftcore generate` answers, greedily, to each row."""
    prompts = write_jsonl(tmp_path / f"prompts-{uuid.uuid4().hex[:6]}.jsonl", rows)
    out = tmp_path / f"answers-{uuid.uuid4().hex[:6]}.jsonl"
    result = run_cli("generate", str(run), "--input", str(prompts), "--output", str(out), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["answer"] for line in out.read_text().splitlines()]


class Terminal:
    """A shell in a tmux session on a server of its own (so it has this test's environment)."""

    def __init__(self):
        self.socket = f"ftcore-test-{uuid.uuid4().hex[:8]}"
        self.tmux("new-session", "-d", "-s", "t", "-x", "220", "-y", "60", "bash --norc --noprofile")

    def tmux(self, *args):
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True,
                              timeout=60).stdout

    def send(self, *keys):
        self.tmux("send-keys", "-t", "t", *keys)

    def type(self, line):
        self.send("-l", line)
        self.send("Enter")

    def screen(self):
        return self.tmux("capture-pane", "-p", "-t", "t", "-S", "-1000")

    def wait(self, pattern, after=0, timeout=3600):
        """The screen once ``pattern`` matches after its first ``after`` characters (generous timeout:
        it only catches a hang)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if re.search(pattern, screen[after:], re.M):
                return screen
            time.sleep(0.5)
        raise AssertionError(f"{pattern!r} never appeared; the screen:\n{self.screen()}")

    def say(self, text):
        """Type a message; the lines printed before the next prompt."""
        start = len(self.screen().rstrip())
        self.type(text)
        screen = self.wait(r"^you>\s*$", after=start)
        lines = screen[start:].rstrip().splitlines()
        assert lines[0].endswith(text), lines
        return lines[1:-1]

    def close(self):
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=60)


@pytest.fixture
def terminal():
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install -y tmux)")
    term = Terminal()
    yield term
    term.close()


def chat_command(run, *args):
    return " ".join([sys.executable, "-m", "ftcore", "chat", str(run), *args]) + "; echo EXIT=$?"


# -- in a real terminal ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_chat_streams_the_greedy_answers_and_keeps_the_conversation(quickstart_run, tmp_path, terminal):
    first, second = answers(quickstart_run, tmp_path, [
        {"prompt": FIRST},
        {"messages": [{"role": "user", "content": FIRST}, {"role": "assistant", "content": "the fox"},
                      {"role": "user", "content": SECOND}]},
    ])
    assert first == "the fox"
    terminal.type(chat_command(quickstart_run))
    header = terminal.wait(r"^you>\s*$")
    assert "ftcore chat" in header and "template 'chatml'" in header and "greedy max_new_tokens=256" in header
    assert terminal.say(FIRST) == [first]
    assert terminal.say(SECOND) == [second]  # the second turn is rendered after the first one

    assert any("/system TEXT" in line for line in terminal.say("/help"))
    assert terminal.say("/set temp=1") == \
        ["unknown setting 'temp=1'; settings: temperature=..., top_p=..., max_new_tokens=..., seed=..."]
    assert terminal.say("/set top_p=2") == ["top_p must be in (0, 1], got 2.0"]
    assert terminal.say("/set max_new_tokens=1") == ["(greedy max_new_tokens=1)"]
    assert terminal.say("/reset") == ["(conversation cleared)"]
    short = terminal.say(FIRST)
    assert len(short) == 1 and first.startswith(short[0]) and short[0] != first  # one token of "the fox"

    terminal.send("C-c")
    screen = terminal.wait(r"^EXIT=\d+$")
    assert re.search(r"^EXIT=(0|130)$", screen, re.M), screen
    assert "Traceback" not in screen and "KeyboardInterrupt" not in screen


@pytest.mark.slow
def test_compare_base_shows_both_answers(quickstart_run, tmp_path, terminal):
    # Short answers: the untrained model never stops, and a wrapped line would not compare.
    [base] = answers(quickstart_run, tmp_path, [{"prompt": FIRST}], "--stage", "base", "--max-new-tokens", "8")
    [tuned] = answers(quickstart_run, tmp_path, [{"prompt": FIRST}], "--max-new-tokens", "8")
    assert base != tuned
    terminal.type(chat_command(quickstart_run, "--compare", "base", "--max-new-tokens", "8"))
    header = terminal.wait(r"^you>\s*$")
    assert "base and sft" in header
    assert terminal.say(FIRST) == ["base:", base, "sft:", tuned]
    terminal.send("C-d")
    screen = terminal.wait(r"^EXIT=\d+$")
    assert re.search(r"^EXIT=0$", screen, re.M) and "Traceback" not in screen


@pytest.mark.slow
def test_chat_reads_a_script_from_stdin(quickstart_run):
    """Without a terminal too: each line a message or a command, the end of input ends the chat."""
    script = f"{FIRST}\n/system Answer briefly.\n/nope\n/exit\n"
    result = subprocess.run([sys.executable, "-m", "ftcore", "chat", str(quickstart_run), "--export", "merged"],
                            input=script, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "export merged" in out and "(system prompt set; conversation cleared)" in out
    assert "unknown command /nope; /help lists them" in out
    assert "you> the fox\n" in out  # input() echoes no newline when stdin is not a terminal


NOISE = ("kernels", "Warning", "warn(", "Loading weights", "it/s]")


@pytest.mark.slow
def test_chat_starts_without_library_noise_caps_the_answer_and_quits_at_once(quickstart_run, terminal):
    """A LoRA run (peft imports bitsandbytes, whose CPU backend warns at import; transformers deprecations;
    loading bars): none of it on the screen. --max-new-tokens past the model's context (256) is capped,
    with a note. Ctrl-D ends the chat at once (the interpreter's teardown took about 3 s)."""
    terminal.type(chat_command(quickstart_run, "--max-new-tokens", "100000"))
    screen = terminal.wait(r"^you>\s*$")
    assert "(--max-new-tokens 100000 is beyond the model's context of 256 tokens: capped at 256)" in screen
    assert "greedy max_new_tokens=256" in screen
    assert not [word for word in NOISE if word in screen], screen
    assert terminal.say("/set max_new_tokens=300") == \
        ["(max_new_tokens 300 is beyond the model's context of 256 tokens: capped at 256)", "(greedy max_new_tokens=256)"]
    assert terminal.say(FIRST) == ["the fox"]
    start = time.monotonic()
    terminal.send("C-d")
    screen = terminal.wait(r"^EXIT=\d+$", timeout=60)
    elapsed = time.monotonic() - start
    assert re.search(r"^EXIT=0$", screen, re.M), screen
    assert elapsed < 1.5, f"Ctrl-D took {elapsed:.1f} s"


@pytest.mark.slow
def test_piped_chat_stays_quiet_and_answers_within_the_context(quickstart_run):
    """Without a terminal: stderr holds ftcore's own notes only; a conversation that fills the context is
    refused with a line saying so, and the chat goes on."""
    long = " ".join(["red fox stone"] * 150)  # well past 256 tokens
    script = f"{long}\n{FIRST}\n"
    result = subprocess.run([sys.executable, "-m", "ftcore", "chat", str(quickstart_run), "--max-new-tokens", "999"],
                            input=script, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [word for word in NOISE if word in result.stderr], result.stderr
    assert "(--max-new-tokens 999 is beyond the model's context of 256 tokens: capped at 256)" in result.stderr
    assert "the conversation fills the model's context (256 tokens): /reset to start again" in result.stdout
    assert "you> the fox\n" in result.stdout  # the refused turn was forgotten


# -- bad input: one line, exit 2 -------------------------------------------------------------------------------

def one_line_error(*args):
    result = run_cli("chat", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_run_dirs_and_options(tmp_path):
    assert one_line_error(str(tmp_path / "nope")) == f"error: {tmp_path / 'nope'}: no such run directory"
    assert one_line_error(str(tmp_path)) == \
        f"error: {tmp_path}: not an ftcore run directory (no readable manifest.json)"
    assert one_line_error(str(tmp_path), "--temperature", "-1") == \
        "error: --temperature must be >= 0 (0 is greedy), got -1.0"


@pytest.mark.slow
def test_bad_stage_compare_and_export(quickstart_run):
    run = quickstart_run
    assert one_line_error(str(run), "--stage", "dpo") == \
        f"error: {run}: no stage named 'dpo' (stages: base, pretrain, sft)"
    assert one_line_error(str(run), "--compare", "bsae") == \
        f"error: {run}: no stage named 'bsae' (stages: base, pretrain, sft)"
    assert one_line_error(str(run), "--export", "onnx") == \
        f"error: {run}: the plan has no export named 'onnx' (exports: merged, adapter)"


GGUF_PLAN = """
[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "text"
max_steps = 4
batch_size = 8
max_length = 64

[[export]]
use = "gguf"
types = ["f16"]
"""


@pytest.mark.slow
def test_gguf_export_needs_llama_cpp_or_answers_like_transformers(tmp_path):
    pytest.importorskip("gguf")
    write_jsonl(tmp_path / "text.jsonl", text_rows(64))
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    write_jsonl(tmp_path / "chat_eval.jsonl", chat_rows(16, seed=1))
    (tmp_path / "plan.toml").write_text(TINY_HEADER + GGUF_PLAN, encoding="utf-8")
    result = run_cli("run", str(tmp_path / "plan.toml"))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    if importlib.util.find_spec("llama_cpp") is None:
        assert one_line_error(str(run), "--export", "gguf") == \
            "error: --export gguf: serving a GGUF file needs llama-cpp-python, which is not installed: " \
            "pip install llama-cpp-python"
        return
    rows = [{"prompt": r["messages"][0]["content"]} for r in chat_rows(4, seed=2)]
    assert answers(run, tmp_path, rows, "--export", "gguf", "--max-new-tokens", "6") == \
        answers(run, tmp_path, rows, "--max-new-tokens", "6")
