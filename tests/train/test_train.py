"""The train package: batched generation and its cache, prompts, the shared loop
(resumption), and a full Medusa run on the tiny model."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import specdec.train.generation as generation
from specdec.decoders import Pipeline
from specdec.decoders.cli.config import to_dataclass
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.evaluation.workloads import DEFAULT_PROMPTS
from specdec.decoders.models.session import ModelSession
from specdec.proposers.medusa.artifact import load_artifact
from specdec.train import checkpoints
from specdec.train import prompts as builtin
from specdec.train.data import DataConfig, read_prompt_file, self_distilled, split_heldout
from specdec.train.job import drafter_module, run
from specdec.train.loop import FitConfig, RunLogger, fit
from specdec.train.medusa import (
    IGNORE,
    Config,
    build_heads,
    evaluate,
    head_inputs,
    training_rows,
    vocab_index,
)
from tests.conftest import REPO_ROOT, random_prompts

TINY_RECIPE = [
    "model=tiny-random",
    "model.dtype=float64",
    "logger=disabled",
    "train.data.magpie_prompts=4",
    "train.data.templated_prompts=44",
    "train.data.passages=4",
    "train.data.max_query_tokens=8",
    "train.data.max_new_tokens=40",
    "train.data.batch_size=16",
    "train.data.heldout=0.2",
    "drafter.lora_rank=4",
    "drafter.copy_width=0",  # plain heads; tests/proposers/test_copy_attention.py and test_medusa.py train copy heads
    "drafter.epochs=6",
    "drafter.batch_size=64",
    "drafter.lr=0.01",
    "drafter.eval_batch_size=128",
    "drafter.tree_nodes=6",
]


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(Path(REPO_ROOT) / "conf"), version_base="1.3"):
        return compose("train", overrides=overrides)


def train_tiny_medusa(artifacts_dir: Path, extra: tuple[str, ...] = ()) -> Path:
    """Train Medusa heads for the tiny model into ``artifacts_dir`` (a few seconds)."""
    return run(compose_train(TINY_RECIPE + [f"artifacts_dir={artifacts_dir}", *extra]))


SETTINGS = generation.GenerationSettings(20, SamplingConfig(), batch_size=4, keep_hidden=True)


def test_batched_generation_equals_standard_greedy_decoding(tiny_pipeline):
    """Left padding, the batch's shared cache and finished rows leaving the batch change
    nothing: every row is what standard decoding produces, cut at the first EOS, and
    its hidden rows are the target's own states."""
    model = tiny_pipeline.model
    prompts = [tuple(p[:30]) for p in random_prompts(6, seed=3)]
    full = [tiny_pipeline.generate(list(p), 20).tokens for p in prompts]
    eos = Counter(t for tokens in full for t in tokens[2:12]).most_common(1)[0][0]  # ends rows mid-batch
    outputs = generation.generate_batch(model, prompts, SETTINGS, frozenset({eos}), 258, torch.Generator())
    assert sum(eos in tokens for tokens in full) >= 2
    session = ModelSession(model)
    for prompt, tokens, out in zip(prompts, full, outputs):
        assert out.output == (tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
        session.reset()
        session.forward(list(prompt) + out.output[:-1])
        expected_hidden = session.hidden[len(prompt) - 1 :]  # (len(output), hidden)
        assert out.hidden.shape == expected_hidden.shape
        torch.testing.assert_close(
            out.hidden.double(), expected_hidden, atol=2e-2, rtol=2e-3
        )  # float16 storage


def test_generation_store_resumes_where_it_stopped(tiny_pipeline, tmp_path, monkeypatch):
    model = tiny_pipeline.model
    requests = [generation.Request(f"r/{i}", tuple(p[:12])) for i, p in enumerate(random_prompts(10, seed=5))]
    generated: list[int] = []
    real = generation.generate_batch

    def counting(model, prompts, *args):
        generated.append(len(prompts))
        return real(model, prompts, *args)

    monkeypatch.setattr(generation, "generate_batch", counting)
    first = generation.generate_all(
        model, requests[:6], generation.GenerationStore(tmp_path), SETTINGS, frozenset({257}), 258, "first"
    )
    assert sum(generated) == 6
    store = generation.GenerationStore(tmp_path)  # a new process: reads the finished parts
    changed = generation.Request("r/0", requests[0].prompt + (1,))  # same id, new prompt: regenerate
    second = generation.generate_all(
        model, requests + [changed], store, SETTINGS, frozenset({257}), 258, "second"
    )
    assert sum(generated) == 6 + 4 + 1
    for request in requests[1:6]:
        assert second[request.id].output == first[request.id].output
        torch.testing.assert_close(second[request.id].hidden, first[request.id].hidden)


def test_runs_sharing_a_generation_folder_keep_each_others_parts(tmp_path):
    first, second = generation.GenerationStore(tmp_path), generation.GenerationStore(tmp_path)
    first.add(["a"], [generation.Generation([1], [2, 3], torch.zeros(2, 4, dtype=torch.float16))])
    second.add(["b"], [generation.Generation([1], [4], torch.ones(1, 4, dtype=torch.float16))])
    reloaded = generation.GenerationStore(tmp_path)
    assert reloaded.get(generation.Request("a", (1,)), with_hidden=True).output == [2, 3]
    assert reloaded.get(generation.Request("b", (1,)), with_hidden=True).hidden.sum() == 4


def test_templated_prompts_are_stable_varied_and_not_the_benchmarks():
    specs = [builtin.templated_prompt(0, i, passages=8) for i in range(220)]
    assert specs == [builtin.templated_prompt(0, i, passages=8) for i in range(220)]
    assert {s.category for s in specs} == set(builtin.CATEGORIES)
    texts = {builtin.fill_passages(s, [f"passage {i}" for i in range(8)]) for s in specs}
    assert len(texts) > 180
    benchmark = {
        json.loads(line)["turns"][0] for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()
    }
    assert not texts & benchmark


def test_magpie_prefix_is_the_start_of_a_user_turn(tiny_pipeline):
    assert builtin.pre_query_prefix(tiny_pipeline.tokenizer) == "<bos>user: "


def test_prompt_file_formats_and_errors(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "Hi there"}\n\n{"question_id": 3, "category": "qa", "turns": ["Why?", "And?"]}\n'
    )
    assert read_prompt_file(path) == ["Hi there", "Why?"]
    path.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2"):
        read_prompt_file(path)
    with pytest.raises(FileNotFoundError, match="train.data.path"):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_interrupted_training_resumes_to_the_same_result(tmp_path):
    """Ctrl-C ends the step, then saves a checkpoint; rerunning continues with the same
    batches and optimizer state, ending exactly where an uninterrupted run ends."""
    torch.manual_seed(0)
    rows = {"x": torch.randn(50, 3, dtype=torch.float64), "y": torch.randn(50, dtype=torch.float64)}
    cfg = FitConfig(epochs=3, batch_size=8, lr=0.05, checkpoint_every=4)
    logger = RunLogger(compose_train(["logger=disabled"]).logger, {}, "test")

    def make_module():
        torch.manual_seed(1)
        return torch.nn.Linear(3, 1).double()

    def loss_fn(batch, interrupt_at=None, calls=[0]):  # noqa: B006 - a call counter
        calls[0] += 1
        if calls[0] == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends
        return ((module(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean(), {}

    module = make_module()
    fit(module, rows, loss_fn, cfg, tmp_path / "a", "f", logger)
    expected = [p.detach().clone() for p in module.parameters()]

    module = make_module()
    calls = [0]
    with pytest.raises(KeyboardInterrupt):
        fit(
            module, rows, lambda b: loss_fn(b, interrupt_at=11, calls=calls), cfg, tmp_path / "b", "f", logger
        )
    own = checkpoints.own_folder(tmp_path / "b", "f")  # the folder of this run's settings
    assert [d.name for d in own.iterdir()] == ["step-00000011"]  # the step it was in, completed
    module = make_module()
    fit(module, rows, loss_fn, cfg, tmp_path / "b", "f", logger)
    for got, want in zip(module.parameters(), expected):
        torch.testing.assert_close(got, want)


def test_training_lowers_the_loss_and_beats_chance(tmp_path, tiny_model, tiny_config, monkeypatch):
    artifact = train_tiny_medusa(tmp_path)
    meta = json.loads((artifact / "medusa.json").read_text())
    assert (artifact / "heads.safetensors").exists()
    assert (artifact / "adapter" / "adapter_model.safetensors").exists()
    assert not (artifact / "checkpoint").exists()
    assert meta["target"] == "tiny-random-v320-h64-l2-s0" and meta["num_heads"] == 4

    # Trained heads against fresh ones, on the held-out sequences (read back from the cache).
    model, tokenizer = tiny_model
    pipeline = Pipeline(model, tokenizer, model_config=tiny_config, artifacts_dir=tmp_path)
    data_cfg = to_dataclass(DataConfig, compose_train(TINY_RECIPE).train.data, "train.data")
    sequences = self_distilled(pipeline, data_cfg, tmp_path / pipeline.context.target_key / "data")
    _, heldout = split_heldout(sequences, data_cfg.heldout)
    drafter_cfg = Config(num_heads=4, lora_rank=4, copy_width=0)
    embeddings = model.get_input_embeddings()
    trained = load_artifact(artifact, model.get_output_embeddings(), embeddings).heads
    assert trained.sequential  # the default
    fresh, _ = build_heads(model.get_output_embeddings(), drafter_cfg, trained.draft_vocab, embeddings)
    rows = training_rows(heldout, 4)
    targets = vocab_index(rows["labels"][:, 0], trained.draft_vocab, 320)

    def head0_loss(heads):
        with torch.no_grad():
            logits = heads(rows["hidden"].to(heads.dtype), head_inputs(rows))[:, 0]
        return float(torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE))

    assert head0_loss(trained) < 0.5 * head0_loss(fresh)
    chance = 1 / 320
    accuracy = evaluate(trained, heldout, drafter_cfg)
    assert accuracy["top1"][0] > 20 * chance and accuracy["top1"][1] > 10 * chance
    assert accuracy["top1"][0] > evaluate(fresh, heldout, drafter_cfg)["top1"][0]
    assert accuracy["chain_tau"] > 1.2
    assert meta["metrics"]["top1"] == pytest.approx(accuracy["top1"], abs=0.02)  # float32 in training

    # Measuring the artifact on other prompts (Spec-Bench format) adds per-category metrics.
    questions = tmp_path / "questions.jsonl"
    rows = [
        {"question_id": i, "category": c, "turns": [f"Tell me about {c} {i}."]}
        for i, c in enumerate("ab" * 3)
    ]
    questions.write_text("\n".join(json.dumps(r) for r in rows))
    train_tiny_medusa(tmp_path, ("train.eval.only=true", f"train.eval.path={questions}"))
    measured = json.loads((artifact / "medusa.json").read_text())
    assert set(measured["eval_metrics"]) == {"eval", "eval/a", "eval/b"}
    assert measured["eval_metrics"]["eval/a"]["positions"] > 0
    assert measured["tree"] == meta["tree"] and measured["metrics"]["top1"] == meta["metrics"]["top1"]

    # With no artifact of the user's, the shipped copy is measured; it is package data, so it
    # stays as shipped and the measurement goes to the run's folder. With neither, the error
    # names the command that trains one.
    from specdec.decoders.engine import context as context_module

    shipped_root = tmp_path / "shipped"
    shutil.copytree(artifact, shipped_root / meta["target"] / "medusa")
    shipped_meta = (shipped_root / meta["target"] / "medusa" / "medusa.json").read_text()
    monkeypatch.setattr(context_module, "SHIPPED_ARTIFACTS", shipped_root)
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    elsewhere = [f"artifacts_dir={tmp_path / 'none'}", f"train.data_dir={artifact.parent / 'data'}"]
    measure_again = [*TINY_RECIPE, *elsewhere, "train.eval.only=true", f"train.eval.path={questions}"]
    assert run(compose_train(measure_again)) == shipped_root / meta["target"] / "medusa"
    assert (shipped_root / meta["target"] / "medusa" / "medusa.json").read_text() == shipped_meta
    recorded = json.loads((tmp_path / "run" / "medusa_measured.json").read_text())
    assert recorded["eval_metrics"] == measured["eval_metrics"]
    monkeypatch.setattr(context_module, "SHIPPED_ARTIFACTS", tmp_path / "none-shipped")
    with pytest.raises(
        FileNotFoundError,
        match="no medusa artifact at .*train one first with `python -m specdec.train drafter=medusa",
    ):
        run(compose_train(measure_again))


def test_unknown_drafter_lists_the_known_ones():
    with pytest.raises(KeyError, match="drafters: .*medusa"):
        drafter_module("nope")
