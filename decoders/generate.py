"""Command line: generate one answer, streamed, then print the run's stats.

python -m specdec.decoders.generate prompt="What is speculative decoding?" proposer=ngram verifier=greedy
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from specdec.decoders.engine.registry import import_plugins_from_argv

import_plugins_from_argv()  # before Hydra composes, so plugin proposers are valid choices

from specdec.decoders.cli.config import (  # noqa: E402
    CONF_DIR,
    check_proposer_options,
    component,
    constraint_config,
    load_plugins,
    model_config,
    sampling_config,
)
from specdec.decoders.cli.errors import check_command_line, cli_errors  # noqa: E402
from specdec.decoders.engine.constraint_source import grammar_source  # noqa: E402
from specdec.decoders.engine.pipeline import Pipeline  # noqa: E402
from specdec.decoders.engine.request import check_stop_strings  # noqa: E402


def format_stats(stats) -> str:
    lines = [
        f"new tokens          {stats.new_tokens}",
        f"tokens/s            {stats.tokens_per_s:.2f}",
        f"target passes       {stats.target_passes} (+ prefill)",
        f"mean accepted (tau) {stats.mean_accepted_tokens:.2f}",
    ]
    if stats.acceptance_rate is not None:
        lines.append(f"acceptance rate     {stats.acceptance_rate:.3f} ({stats.accepted}/{stats.proposed})")
    lines.append(
        f"time (s)            prefill {stats.prefill_time:.3f}  draft {stats.draft_time:.3f} "
        f"(observe {stats.observe_time:.3f})  "
        f"verify {stats.verify_time:.3f}  total {stats.wall_time:.3f}"
    )
    return "\n".join(lines)


def stop_strings(setting) -> list[str]:
    """``stop=assist`` is one stop string (a bare string was split into its characters);
    ``stop=[a,b]`` a list of them; an empty one is refused (before the model loads)."""
    if setting is None:
        return []
    strings = [setting] if isinstance(setting, str) else [str(item) for item in setting]
    check_stop_strings(strings)
    return strings


def constraint_verdict(stats, max_new_tokens: int, stops: bool) -> str:
    """Whether the output is a whole sentence of the grammar, and if not, what ended it."""
    if stats.constraint_complete:
        return "complete"
    if stats.new_tokens >= max_new_tokens:
        return "INCOMPLETE (max_new_tokens ran out first)"
    # the grammar lets the end token through only where nothing else can follow: a dead end
    dead_end = "the grammar allows no text after this output"
    return f"INCOMPLETE ({'a stop string, or ' + dead_end if stops else dead_end})"


def interrupted(name: str, decoding) -> None:
    """Ctrl-C (or SIGTERM): the text streamed so far stays; say so, with the stats of the
    tokens decoded (the round cut short is not in them)."""
    stats = decoding.stats
    stats.new_tokens = len(decoding.tokens)
    print(f"\n\n[{name}]", file=sys.stderr)
    print(format_stats(stats), file=sys.stderr)
    print(
        f"[generate] interrupted after {stats.new_tokens} of {decoding.stop.max_new_tokens} tokens: "
        "the text and stats above are what was decoded",
        file=sys.stderr,
    )


@hydra.main(config_path=CONF_DIR, config_name="generate", version_base="1.3")
@cli_errors
def main(cfg: DictConfig) -> None:
    load_plugins(cfg)
    check_proposer_options(cfg)  # before the model loads
    constraint = constraint_config(cfg)
    if constraint is not None:
        grammar_source(constraint)  # a schema, regex or grammar that does not compile: before the model loads
    pipeline = Pipeline.load(
        model_config(cfg),
        component(cfg, "proposer"),
        component(cfg, "verifier"),
        sampling_config(cfg),
        artifacts_dir=cfg.artifacts_dir,
        max_new_tokens=cfg.max_new_tokens,
        stop_strings=stop_strings(cfg.stop),
        chat_template=cfg.chat_template,
        round_gate=cfg.round_gate,
    )
    if constraint is not None:
        constraint = pipeline.constraint(constraint)
    streamer = pipeline.text_streamer(lambda text: print(text, end="", flush=True))
    decoding = pipeline.start(cfg.prompt, on_tokens=streamer, constraint=constraint)
    try:  # stepped here, not in pipeline.generate: Ctrl-C still has the decoding to report on
        while not decoding.done:
            decoding.step()
    except KeyboardInterrupt:
        interrupted(pipeline.name, decoding)
        raise
    result = pipeline.result(decoding)
    print(f"\n\n[{pipeline.name}]", file=sys.stderr)
    print(format_stats(result.stats), file=sys.stderr)
    if constraint is not None:
        verdict = constraint_verdict(result.stats, cfg.max_new_tokens, bool(stop_strings(cfg.stop)))
        print(f"constraint          {constraint.description}: {verdict}", file=sys.stderr)


if __name__ == "__main__":
    check_command_line("generate")  # Hydra's errors in one line too
    main()
