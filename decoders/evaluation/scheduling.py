"""How the bench runs its contenders: warm-up, then prompt by prompt, each prompt's
contenders in step a round at a time (:func:`in_step`), the order rotating from prompt to
prompt, results written after every prompt.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec.decoders.engine.constraint import Constraint
from specdec.decoders.engine.constraint_source import ConstraintConfig
from specdec.decoders.engine.pipeline import Pipeline
from specdec.decoders.evaluation.bench_config import BenchConfig
from specdec.decoders.evaluation.contenders import Contender, Stepping
from specdec.decoders.evaluation.files import write_json
from specdec.decoders.evaluation.metrics import (
    Record,
)
from specdec.decoders.evaluation.validity import output_valid
from specdec.decoders.evaluation.workloads import Prompt


def in_step(steppings: list[Callable[[], Stepping]], seed: int = 0) -> list[Record]:
    """Start every request (their prefills in an order drawn from ``seed``), then run
    rounds: each time of the request furthest behind (share of its max_new_tokens
    generated), until all are done. Their records, in the order given.

    Requests tied at the same progress go in an order drawn at random (``seed``). A fixed
    tie order gave two equally paced requests fixed places: in the quickstart, standard
    decoding's rounds always followed its A/A twin's and the twin's followed the speculative
    pipelines' rounds (567 of 579 rounds), so whatever following another pipeline's pass
    costs (its weights and buffers in the caches instead of one's own) fell on one of them
    only. A tie order that alternates is no cure: a pipeline drafting 3 tokens a round meets
    the twins every 4th level, always in the same direction."""
    draw = random.Random(seed)
    order = list(range(len(steppings)))
    draw.shuffle(order)
    running: list[Stepping] = [None] * len(steppings)  # type: ignore[list-item]
    for index in order:
        running[index] = steppings[index]()
    while waiting := [s for s in running if not s.done]:
        low = min(s.progress for s in waiting)
        draw.choice([s for s in waiting if s.progress == low]).step()
    return [stepping.record() for stepping in running]


def run_prompt(
    contenders: list[Contender],
    prompt_ids: list[int],
    max_new_tokens: int,
    rounds: bool,
    seed: int = 0,
    constraint: Constraint | None = None,
) -> dict:
    """Every contender on one prompt (under ``constraint`` if given), in this order:
    {name: Record}. With ``rounds`` those that can be stepped run in step (:func:`in_step`,
    ``seed`` passed on), at the place of the first of them."""
    together = [c for c in contenders if c.start is not None] if rounds else []
    records: dict[str, Record] = {}
    for contender in contenders:
        if contender not in together:
            records[contender.name] = contender.run(prompt_ids, max_new_tokens, constraint)
        elif contender is together[0]:
            starts = [lambda c=c: c.start(prompt_ids, max_new_tokens, constraint) for c in together]
            records.update(zip((c.name for c in together), in_step(starts, seed)))
    return records


def turn_ids(pipeline: Pipeline, prompt: Prompt, turn: int, first_answer: str | None) -> list[int]:
    """Token ids of one turn; the second turn carries the model's first answer.

    Built only once turn 0 has run, since ``first_answer`` is what standard
    decoding answered to it.
    """
    if turn == 0:
        return pipeline.encode(prompt.turns[0])
    if first_answer is None:
        raise RuntimeError(f"turn {turn} of prompt {prompt.id} needs standard decoding's first answer")
    messages = [
        {"role": "user", "content": prompt.turns[0]},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": prompt.turns[turn]},
    ]
    return pipeline.encode(messages)


def progress_labels(names: list[str], width: int = 16) -> dict[str, str]:
    """Short progress-bar labels, one per name: a long name keeps its start and its end
    (``draft_model (ungated)`` -> ``draft_mo…ngated)``), and a name whose short label
    another already took keeps its whole self, so no two contenders share a label."""
    labels: dict[str, str] = {}
    for name in names:
        head = width // 2
        label = name if len(name) <= width else f"{name[:head]}…{name[len(name) - (width - head - 1) :]}"
        labels[name] = name if label in labels.values() else label
    return labels


def warm_up(
    contenders: list[Contender],
    pipelines: list[Pipeline],
    prompt_ids: list[int],
    bench: BenchConfig,
    constraint: Constraint | None,
) -> None:
    """Every contender runs ``prompt_ids`` ``bench.warmup`` times, discarded; then no proposer
    keeps that prompt in its memory, and no round gate its cold first passes in its averages."""
    for contender in tqdm(contenders, desc="warm-up", leave=False):
        for _ in range(max(bench.warmup, 0)):
            contender.run(prompt_ids, min(bench.max_new_tokens, 32), constraint)
    for pipeline in pipelines:
        if pipeline.proposer is not None:
            pipeline.proposer.forget()
        if pipeline.gate is not None:
            pipeline.gate.forget()


def measure(
    prompts: list[Prompt],
    contenders: list[Contender],
    base: Pipeline,
    bench: BenchConfig,
    constraints: list,
    results: Callable[[dict[str, list[Record]], int], dict],
) -> dict:
    """Every prompt on every contender; after each prompt, ``results(records, prompts done)``
    is written to ``bench.output``, so an interrupted run keeps the prompts it finished."""
    records: dict[str, list[Record]] = {c.name: [] for c in contenders}
    first_answers: dict[str, str] = {}
    payload: dict[str, Any] = {}
    output = Path(bench.output)
    progress = tqdm(prompts, desc="prompts")
    try:
        for number, prompt in enumerate(progress):
            measure_prompt(
                number, prompt, contenders, base, bench, constraints[number], records, first_answers
            )
            payload = results(records, number + 1)
            payload["complete"] = number + 1 == len(prompts)  # false: an interrupted run's prompts so far
            payload["prompts_planned"] = len(prompts)
            write_json(output, payload)
            shown = [e for e in payload["pipelines"] if e["kind"] != "standard"]
            labels = progress_labels([e["name"] for e in shown])
            progress.set_postfix({labels[e["name"]]: f"{e['speedup']:.2f}x" for e in shown})
    except KeyboardInterrupt:
        done = payload.get("prompts", 0)
        kept = (
            f"results of the {done} finished prompt(s) are in {output}" if done else "no prompt had finished"
        )
        print(f"\n[bench] interrupted: {kept}", file=sys.stderr)
        raise
    return payload


def measure_prompt(
    number: int,
    prompt: Prompt,
    contenders: list[Contender],
    base: Pipeline,
    bench: BenchConfig,
    constrained: tuple[ConstraintConfig, Constraint] | None,
    records: dict[str, list[Record]],
    first_answers: dict[str, str],
) -> None:
    """Prompt ``number``'s turns and repeats on every contender, its records appended. The
    contenders' order rotates with the prompt and the repeat; the second turn carries
    standard decoding's first answer."""
    spec, constraint = constrained or (None, None)
    tokenizer = base.tokenizer
    for turn in range(len(prompt.turns)):
        prompt_ids = turn_ids(base, prompt, turn, first_answers.get(prompt.id))
        for repeat in range(bench.repeats):
            shift = (number + repeat) % len(contenders)
            order = contenders[shift:] + contenders[:shift]
            seed = (number * len(prompt.turns) + turn) * bench.repeats + repeat  # tie order
            rounds = bench.interleave == "rounds"
            measured = run_prompt(order, prompt_ids, bench.max_new_tokens, rounds, seed, constraint)
            for contender in order:
                record = measured[contender.name]
                text = tokenizer.decode(record.tokens, skip_special_tokens=True) if tokenizer else None
                valid = None if spec is None else output_valid(text or "", record.tokens, spec, constraint)
                records[contender.name].append(
                    replace(record, prompt_id=prompt.id, category=prompt.category, turn=turn,
                            repeat=repeat, text=text, valid=valid)
                )  # fmt: skip
                if contender.name == "standard" and turn == 0 and repeat == 0 and text is not None:
                    first_answers[prompt.id] = text
