"""The README as a tested manual: every command of its ```bash blocks (and docs/cli.md's) runs
as written, with the model swapped for ``tiny-random`` and the sizes cut.

Each command is one case, named ``FILE:LINE`` after the line it starts on. It runs through
bash, as a user would type it, in a directory of its own holding the files its placeholders
name (a schema, a grammar, workloads, bench runs to replay, the tiny model's drafters under
``artifacts/`` as the shipped ones are the default model's), with the environment of
tests/conftest.py (caches, T(n) and W&B isolated). The only changes to what the document
says: the cuts appended to each ``python -m specdec...`` command (:func:`cuts_for`; Hydra
takes the last value given) and the placeholders that cannot be files (:data:`PLACEHOLDERS`).
A case fails when its command exits nonzero or prints an ``error:`` line. Commands that cannot
run here are skipped with their reason (:data:`NOT_HERE`); the costly ones, those that need the
default model, and the commands of the docs the README's command sections link
(:data:`LINKED_DOCS`) run in the slow tier (:data:`SLOW`).

``python`` on the commands' PATH hands ``python -m specdec...`` to a fork server that imported
torch, transformers and W&B once (tests/command_server.py): each command still runs as
``python -m`` would, in a fresh fork, and starts in under a second instead of 5-10 s.

The ```python blocks run too, in this process, with ``smollm2-135m`` swapped for ``tiny-random``.
Every case owns its directory, so the module runs under pytest-xdist as it does alone (the
session fixtures, the fork server, the tiny drafters and the bench run to replay, are made
once per worker).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import command_server
from tests.conftest import REPO_ROOT, once_per_run
from tests.doc_commands import Command, blocks, commands_of

ROOT = Path(REPO_ROOT)
DOCS = ("README.md", "docs/cli.md")
#: the docs the README's command sections point to for their runs: their commands (those not
#: already in the README) run in the slow tier
LINKED_DOCS = (
    "docs/structured.md",
    "docs/bench.md",
    "docs/batching.md",
    "docs/replay.md",
    "docs/suffix.md",
    "docs/merge.md",
)
TIMEOUT_S = 600


# ------------------------------------------------------------------ reading the documents

COMMANDS = [command for doc in DOCS for command in commands_of(doc)]
LINKED = [
    command
    for doc in LINKED_DOCS
    for command in commands_of(doc)
    if command.text not in {c.text for c in COMMANDS}
]


# ------------------------------------------------------------------ what runs, and how

#: placeholders that cannot be files in the case's directory, and what stands in for them
#: ({model_dir}: the tiny model saved as a Hugging Face folder)
PLACEHOLDERS = {
    "/path/to/any/causal-lm": "{model_dir}",
    "/path/to/model.gguf": "{gguf_file}",
    "multirun/<date_time>": "multirun/2026-12-03_10-00-00",
}

#: commands that cannot run here, by a word they hold, and why
NOT_HERE = {
    "make": "a make target: installs, then runs the bench, the suite (which runs this file) or the GPU "
    "check; make bench's own command runs, cut, as the bench run the replay commands read",
    "pytest": "runs the test suite (which runs this file)",
    "wandb": "uploads to a W&B server, which tests never reach",
    "hydra/launcher=submitit_slurm": "needs a SLURM cluster",
    "specdec.train.ship": "writes into the project's proposers/shipped/, from three trained smollm2-135m drafters",
}

#: commands run in the slow tier only (-m slow), by a word they hold, and why
SLOW = {
    "hydra/launcher=joblib": "three jobs in worker processes that each import torch afresh (about a minute)",
    "hydra/launcher=submitit_local": "four jobs, each a fresh Python process (minutes); its early_exit "
    "jobs exit at layer 8: the default model",
    "experiment=full_set": "needs the default model: its trained early exit is layer 8 (shipped), the tiny model has 2",
}
#: of those, the ones run with the default model and its shipped drafters (sizes still cut)
DEFAULT_MODEL = {"experiment=full_set", "hydra/launcher=submitit_local"}

# Appended to each command: the tiny model (where it names none), short answers, one prompt of
# one category, a few seconds of training. Hydra takes the last value a key is given.
GENERATE_CUTS = ["max_new_tokens=4"]
BENCH_CUTS = ["workload.limit=1", "bench.max_new_tokens=4", "bench.warmup=0"]
CATEGORY = {  # a workload's category kept (workload=spec_bench reads question.jsonl: one prompt)
    "default": "[qa]",
    "structured": "[classification]",
    "agentic": "[sql_query/first,sql_query/later]",
}
AUDIT_CUTS = ["audit.prompts=2", "audit.max_new_tokens=4", "audit.sampling_prompts=1", "audit.samples=60"]
TRAIN_CUTS = [
    "train.data.magpie_prompts=2",
    "train.data.templated_prompts=12",
    "train.data.passages=2",
    "train.data.max_query_tokens=8",
    "train.data.max_new_tokens=16",
    "train.data.batch_size=16",
    "train.data.heldout=0.25",
]
DRAFTER_CUTS = {
    "medusa": ["drafter.lora_rank=4", "drafter.epochs=1", "drafter.tree_nodes=6"],
    "eagle": ["drafter.lora_rank=4", "drafter.epochs=1", "drafter.copy_width=16"],
    "draft_model": [
        "drafter.num_layers=1",
        "drafter.draft_vocab_size=0",
        "drafter.epochs=1",
        "drafter.vocab_sizes=[32]",
    ],
    "early_exit": ["drafter.exit_layer=1", "drafter.epochs=1", "drafter.adapter_rank=8"],
}


def option(words: list[str], key: str) -> str | None:
    """The last value ``words`` give ``key`` (``key=VALUE``)."""
    values = [w.split("=", 1)[1] for w in words if w.startswith(f"{key}=")]
    return values[-1] if values else None


def marked(command: Command, table) -> str | None:
    """The entry of ``table`` (a word -> reason mapping, or a set) naming ``command``."""
    hits = [word for word in table if word in command.words or word == command.module]
    return (table[hits[0]] if isinstance(table, dict) else hits[0]) if hits else None


def on_default_model(command: Command) -> bool:
    return marked(command, DEFAULT_MODEL) is not None


def cuts_for(command: Command) -> list[str]:
    """What is appended to ``command``: the tiny model and the sizes cut."""
    module, words = command.module, command.words
    tiny = [] if option(words, "model") or on_default_model(command) else ["model=tiny-random"]
    if module == "specdec.decoders.generate":
        return tiny + GENERATE_CUTS
    if module == "specdec.decoders.bench":
        experiment = option(words, "experiment")
        workload = option(words, "workload") or ("structured" if experiment == "structured" else "default")
        categories = [f"workload.categories={CATEGORY[workload]}"] if workload in CATEGORY else []
        return tiny + BENCH_CUTS + categories
    if module == "specdec.decoders.audit":
        return tiny + AUDIT_CUTS
    if module == "specdec.train":
        evaluating = ["train.eval.limit=2"] if any(w.startswith("train.eval.") for w in words) else []
        return tiny + TRAIN_CUTS + DRAFTER_CUTS[option(words, "drafter") or "medusa"] + evaluating
    return []  # replay and report read a bench run; other programs run as written


def trains(command: Command) -> bool:
    return command.module == "specdec.train" and option(command.words, "train.eval.only") != "true"


def case(command: Command):
    if reason := marked(command, NOT_HERE):
        return pytest.param(command, id=command.id, marks=pytest.mark.skip(reason=f"{command.id}: {reason}"))
    slow = marked(command, SLOW) or command.doc in LINKED_DOCS
    return pytest.param(command, id=command.id, marks=[pytest.mark.slow] if slow else [])


@pytest.fixture(scope="session")
def python_on_path() -> Iterator[dict[str, str]]:
    """The environment the commands run in: this process's, with the fork server's ``python``
    first on PATH (tests/command_server.py; unless SPECDEC_README_FORK=0)."""
    with command_server.python_on_path() as env:
        yield env


def run_in(directory: Path, text: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``text`` run by bash in ``directory``."""
    return subprocess.run(
        ["bash", "-c", text],
        cwd=directory,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# ------------------------------------------------------------------ what the commands find

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8}},
    "required": ["answer"],
    "additionalProperties": False,
}
GRAMMAR = 'start: expr\nexpr: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]{1,3}/\n'
QUESTION = {"question_id": 1, "category": "qa", "turns": ["What is 2 + 2?", "And 3 + 3?"]}
# one question of each Spec-Bench category (MT-bench's "writing" counts as mt_bench)
DEV_QUESTIONS = [
    {**QUESTION, "question_id": number, "category": category}
    for number, category in enumerate(
        ("writing", "translation", "summarization", "qa", "math_reasoning", "rag")
    )
]
PROMPTS = [
    "Name three colours.",
    "Count to five.",
    "Say hello.",
    "Spell cat.",
    "Add 2 and 3.",
    "Name a fruit.",
]


def readme_python_blocks() -> list[tuple[int, str]]:
    return [(start, "\n".join(lines)) for start, lines in blocks((ROOT / "README.md").read_text(), "python")]


def plugin_source() -> str:
    """The README's custom proposer (the block that starts ``# my_proposers.py``)."""
    (source,) = [code for _, code in readme_python_blocks() if code.startswith("# my_proposers.py")]
    return source


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory) -> Path:
    """The tiny model written as a GGUF file: what ``model.gguf_file`` loads."""
    from specdec.decoders.models.loading import tiny_random_model
    from tests.decoders.models.test_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_random_model())


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model saved as a Hugging Face folder: what ``model=hf`` loads."""
    from specdec.decoders.models.loading import byte_tokenizer, tiny_random_model

    directory = tmp_path_factory.mktemp("causal-lm")
    tiny_random_model().save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory, python_on_path) -> Path:
    """The tiny model's drafters (copy heads, EAGLE, a trained exit), trained with the cuts the
    README's recipes get here: what the shipped drafters are to the default model."""

    def train(directory: Path) -> None:
        for drafter in ("medusa", "eagle", "early_exit"):
            line = f"python -m specdec.train drafter={drafter} model=tiny-random logger=disabled"
            done = run_in(
                directory, f"{line} {shlex.join(TRAIN_CUTS + DRAFTER_CUTS[drafter])}", python_on_path
            )
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    return once_per_run(tmp_path_factory, "readme-artifacts", train) / "artifacts"


@pytest.fixture(scope="session")
def bench_run(tmp_path_factory, tiny_artifacts, python_on_path) -> Path:
    """The quickstart's bench run (``make bench``'s command, from the Makefile, cut): what the
    replay and report commands read."""

    def run(directory: Path) -> None:
        shutil.copytree(tiny_artifacts, directory / "artifacts")
        (recipe,) = re.findall(r"^bench:.*\n\t\$\(PY\) (-m .*)$", (ROOT / "Makefile").read_text(), re.M)
        quickstart = Command("Makefile", 0, f"python {recipe}")
        line = f"{quickstart.text} {shlex.join(cuts_for(quickstart))} bench.plots=false hydra.run.dir=run"
        done = run_in(directory, line, python_on_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    return once_per_run(tmp_path_factory, "readme-bench-run", run) / "run"


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default model dequantized into the suite's cache once, before the commands that load
    it: processes doing it at once collide (all but one fail to rename their copy into place)."""
    import fcntl

    from specdec.decoders.models.loading import cache_dir, smollm2_directory

    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "default-model.lock", "w") as lock:  # one xdist worker at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        return smollm2_directory()


def prepare(directory: Path, command: Command, request) -> None:
    """The files ``command``'s placeholders name, in its directory."""
    (directory / "schema.json").write_text(json.dumps(SCHEMA))
    (directory / "expr.lark").write_text(GRAMMAR)
    (directory / "question.jsonl").write_text(json.dumps(QUESTION) + "\n")
    (directory / "my_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (directory / "my_proposers.py").write_text(plugin_source())
    # what the echo command before it in its block writes
    (directory / "bf16.json").write_text('{"seconds": {"1": 0.039, "8": 0.043, "16": 0.051}}\n')
    shared = directory.parent / "shared" / "data"  # ../shared/data/spec_bench_dev.jsonl beside the checkout
    shared.mkdir(parents=True)
    (shared / "spec_bench_dev.jsonl").write_text("".join(json.dumps(q) + "\n" for q in DEV_QUESTIONS))
    if on_default_model(command):
        request.getfixturevalue("default_model")
    elif not trains(command):
        shutil.copytree(request.getfixturevalue("tiny_artifacts"), directory / "artifacts")
    if command.module in ("specdec.decoders.replay", "specdec.decoders.report"):
        run = request.getfixturevalue("bench_run")
        for name in re.findall(r"outputs/bench/([\w-]+)", command.text):
            shutil.copytree(run, directory / "outputs" / "bench" / name)
        shutil.copytree(run, directory / "multirun" / "2026-12-03_10-00-00" / "0")


def as_run(command: Command, request) -> str:
    """``command`` with its placeholders replaced and its cuts appended."""
    text = command.text
    for placeholder, stand_in in PLACEHOLDERS.items():
        if placeholder in text:
            if "{model_dir}" in stand_in:
                stand_in = stand_in.format(model_dir=request.getfixturevalue("model_dir"))
            if "{gguf_file}" in stand_in:
                stand_in = stand_in.format(gguf_file=request.getfixturevalue("gguf_file"))
            text = text.replace(placeholder, stand_in)
    cuts = cuts_for(command)
    return f"{text} {shlex.join(cuts)}" if cuts else text


ERROR_LINE = re.compile(r"^(?:[\w./-]+: )?error:.*$", re.M)


@pytest.mark.parametrize("command", [case(c) for c in COMMANDS + LINKED])
def test_the_command_runs_as_written(command: Command, tmp_path, request, python_on_path):
    directory = tmp_path / "work"
    directory.mkdir()
    prepare(directory, command, request)
    text = as_run(command, request)
    done = run_in(directory, text, python_on_path)
    output = done.stdout + done.stderr
    errors = ERROR_LINE.findall(output)
    if done.returncode != 0 or errors:
        pytest.fail(
            f"{command.id} no longer runs as written:\n  {command.text}\nran as:\n  {text}\n"
            f"exit status {done.returncode}; last lines:\n" + "\n".join(output.strip().splitlines()[-15:]),
            pytrace=False,
        )


def test_the_documents_hold_their_commands():
    """The parser finds the commands: a changed fence would silently test nothing."""
    assert len([c for c in COMMANDS if c.doc == "README.md"]) >= 50
    assert len([c for c in COMMANDS if c.module and c.module.startswith("specdec.")]) >= 40


# ------------------------------------------------------------------ the Python blocks

PYTHON_SWAPS = {'model="smollm2-135m"': 'model="tiny-random"', "max_new_tokens=64": "max_new_tokens=4"}


def swapped(code: str) -> str:
    for written, swap in PYTHON_SWAPS.items():
        code = code.replace(written, swap)
    return code


@pytest.fixture()
def plugin_module():
    """The README's custom proposer, imported as ``my_proposers``; unregistered afterwards."""
    from specdec.decoders.engine.registry import proposer_registry

    module = types.ModuleType("my_proposers")
    sys.modules[module.__name__] = module  # a dataclass looks its module up there
    exec(compile(plugin_source(), "README.md (my_proposers.py)", "exec"), module.__dict__)
    yield module
    proposer_registry._classes.pop("repeat_last", None)
    del sys.modules[module.__name__]


def test_the_python_api_blocks_run(tmp_path, monkeypatch):
    """The Python API block, then the structured-generation block in its namespace."""
    monkeypatch.chdir(tmp_path)
    python = readme_python_blocks()
    (api_line, api), *_ = [(s, c) for s, c in python if "Pipeline.load(" in c]
    namespace: dict = {}
    exec(compile(swapped(api), f"README.md:{api_line}", "exec"), namespace)
    assert namespace["batch"].results and namespace["sampled"] is not None
    (line, structured), *_ = [(s, c) for s, c in python if 'constraint={"json_schema"' in c]
    namespace["schema"] = SCHEMA
    exec(compile(swapped(structured), f"README.md:{line}", "exec"), namespace)
    assert isinstance(namespace["result"].stats.constraint_complete, bool)


def test_the_custom_proposer_block_runs(plugin_module, tmp_path, monkeypatch):
    """``import my_proposers; Pipeline.load(proposer={"name": "repeat_last", "k": 3})``."""
    from specdec.decoders import Pipeline

    monkeypatch.chdir(tmp_path)
    pipe = Pipeline.load(model="tiny-random", proposer={"name": "repeat_last", "k": 3})
    result = pipe.generate("Hello hello hello", max_new_tokens=6)
    assert result.stats.proposed > 0
