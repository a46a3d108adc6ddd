"""Requests decoded a round at a time and stepped in turn (``bench.interleave=rounds``):
the same outputs as decoding each alone, the scheduling rule, and each request timed
on its own calls only."""

from __future__ import annotations

import time

import pytest

from specdec.decoders.engine import decoding as decoding_module
from specdec.decoders.engine.sampling import SamplingConfig
from specdec.decoders.evaluation.metrics import Record
from specdec.decoders.evaluation.scheduling import in_step
from tests.conftest import random_prompts

PIPELINES = [
    (None, None),
    ("ngram", None),  # greedy at T=0, rejection sampling at T > 0
    ({"name": "suffix"}, "tree"),
    ({"name": "medusa", "tree": "dynamic"}, "tree"),
    ({"name": "merge", "members": [{"name": "suffix"}, {"name": "medusa", "tree": "dynamic"}]}, "tree"),
    ({"name": "early_exit", "exit_layer": 1}, None),
]


class _Stepping:
    """A stepping over the real Pipeline API, as the benchmark's (record = tokens)."""

    def __init__(self, pipeline, prompt, max_new):
        self.pipeline, self.decoding = pipeline, pipeline.start(prompt, max_new)

    done = property(lambda self: self.decoding.done)
    progress = property(lambda self: self.decoding.progress)

    def step(self):
        self.decoding.step()

    def record(self):
        return self.pipeline.result(self.decoding)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_requests_stepped_in_turn_give_what_each_gives_alone(drafting_pays, trained_pipeline, temperature):
    """Six pipelines (standard decoding among them) on one target, their rounds
    interleaved: every output and every counter equals that pipeline's run alone, at
    T=0 and, with the same seed, at T=1. Each pipeline's KV cache and proposer state
    are its own."""
    sampling = SamplingConfig(temperature=temperature, seed=3)
    # two sets of the same pipelines, each seeing the same requests in the same order
    # (what proposers carry across requests, the suffix memory and calibrations, matches)
    alone_set = [trained_pipeline.with_components(p, v, sampling) for p, v in PIPELINES]
    stepped_set = [trained_pipeline.with_components(p, v, sampling) for p, v in PIPELINES]
    accepted = 0
    for prompt in random_prompts(4, seed=11):
        alone = [pipeline.generate(prompt, 20) for pipeline in alone_set]
        together = in_step([lambda p=p, prompt=prompt: _Stepping(p, prompt, 20) for p in stepped_set])
        for one, other, pipeline in zip(alone, together, stepped_set):
            assert other.tokens == one.tokens, pipeline.name
            assert other.stats.emitted_per_round == one.stats.emitted_per_round, pipeline.name
            assert other.stats.accepted == one.stats.accepted, pipeline.name
            accepted += other.stats.accepted
    assert accepted > 0, "no draft token was accepted: the interleaving was never tested with drafts"


class _Fake:
    """A request of ``total`` tokens, ``per_round`` of them a round."""

    def __init__(self, name, per_round, total, log):
        self.name, self.per_round, self.total, self.log, self.made = name, per_round, total, log, 0

    done = property(lambda self: self.made >= self.total)
    progress = property(lambda self: min(self.made / self.total, 1.0))

    def step(self):
        self.log.append(self.name)
        self.made += self.per_round

    def record(self):
        return self.name


def test_in_step_runs_the_request_furthest_behind():
    log: list[str] = []
    records = in_step(
        [
            lambda: _Fake("standard", 1, 6, log),
            lambda: _Fake("spec", 3, 6, log),
            lambda: _Fake("mid", 2, 6, log),
        ]
    )
    assert records == ["standard", "spec", "mid"]  # in the order given, whatever ran first
    assert log.count("standard") == 6 and log.count("spec") == 2 and log.count("mid") == 3
    # never does a request run while another is further behind
    made = {"standard": 0, "spec": 0, "mid": 0}
    step = {"standard": 1, "spec": 3, "mid": 2}
    for name in log:
        low = min(made[n] for n in made if made[n] < 6)
        assert made[name] == low, (name, made)
        made[name] += step[name]


@pytest.mark.parametrize("spec_per_round", [2, 3, 4])
def test_twins_take_each_place_about_equally_often(spec_per_round):
    """Two equally paced requests (standard decoding and its A/A twin) beside a faster one:
    each runs right after the faster one's rounds about half the time, and each prefills
    first on about half the prompts. A fixed tie order had the twin follow the speculative
    pipelines in 567 of 579 rounds and standard decoding never."""
    follows = {"standard": 0, "twin": 0}
    first = {"standard": 0, "twin": 0}
    for seed in range(40):
        log: list[str] = []
        starts: list[str] = []

        def fake(name, per_round, log=log, starts=starts):
            def start():
                starts.append(name)
                return _Fake(name, per_round, 64, log)

            return start

        in_step([fake("standard", 1), fake("spec", spec_per_round), fake("twin", 1)], seed)
        for before, after in zip(log, log[1:]):
            if before == "spec" and after in follows:
                follows[after] += 1
        first[min(follows, key=starts.index)] += 1
    total = sum(follows.values())
    assert total > 300
    assert 0.45 < follows["standard"] / total < 0.55, follows
    assert 10 <= first["standard"] <= 30, first


def test_a_stepped_request_is_timed_on_its_own_calls(monkeypatch, tiny_pipeline):
    """A request whose rounds alternate with a neighbour's that takes 100 s a round: its
    wall time holds none of the neighbour's 100 s."""
    offset = [0.0]
    clock = time.perf_counter
    monkeypatch.setattr(decoding_module.time, "perf_counter", lambda: clock() + offset[0])

    class Slow(_Fake):
        def step(self):
            super().step()
            offset[0] += 100.0  # the clock jumps while the neighbour runs

    log: list[str] = []
    standard, slow = in_step(
        [lambda: _Stepping(tiny_pipeline, random_prompts(1)[0], 8), lambda: Slow("slow", 1, 8, log)]
    )
    assert log == ["slow"] * 8
    assert 0 < standard.stats.wall_time < 100.0
    assert standard.stats.new_tokens == 8


def test_a_finished_request_refuses_another_round(tiny_pipeline):
    decoding = tiny_pipeline.start(random_prompts(1)[0], 1)
    assert decoding.done and decoding.progress == 1.0
    with pytest.raises(RuntimeError, match="finished"):
        decoding.step()
    unfinished = tiny_pipeline.start(random_prompts(1)[0], 4)
    with pytest.raises(RuntimeError, match="not finished"):
        unfinished.output()


def test_record_type_is_what_the_benchmark_keeps(tiny_pipeline):
    """The benchmark's stepping gives the same Record fields as its run()."""
    from specdec.decoders.evaluation.contenders import pipeline_contender

    contender = pipeline_contender(tiny_pipeline)
    prompt = random_prompts(1)[0]
    alone = contender.run(prompt, 6)
    (stepped,) = in_step([lambda: contender.start(prompt, 6)])
    assert isinstance(stepped, Record) and stepped.tokens == alone.tokens
    assert stepped.target_passes == alone.target_passes and stepped.prefill_time > 0
