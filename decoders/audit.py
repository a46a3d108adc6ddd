"""Command line: audit a pipeline's fidelity to standard decoding.

    python -m specdec.decoders.audit proposer=ngram verifier=greedy
    python -m specdec.decoders.audit proposer=ngram verifier=rejection sampling.temperature=1.0
    python -m specdec.decoders.audit model=tiny-random model.vocab_size=16 model.dtype=float64 \
        proposer=draft_model verifier=rejection sampling.temperature=1.0

Two checks; the verdict is printed and the figures written to ``audit.output``:

* **greedy**: the pipeline's verifier at temperature 0 must reproduce standard
  greedy decoding token for token. Each prompt where it does not is a
  *divergence*: prompt id, position, both tokens and the target's logit gap
  between them there (standard's token minus the pipeline's, from a plain target
  pass over the common prefix). A divergence whose gap is within
  ``audit.tie_tolerance`` is a floating-point tie and does not fail the audit.
  ``bit_identical`` is the share of prompts where, beyond the tokens, every
  target logit row the pipeline decided from equals standard decoding's at the
  same position bit for bit (what exact mode, ``model.exact``, guarantees).
* **sampling** (only when sampling.temperature > 0): the first
  ``audit.sampled_tokens`` generated tokens must have standard decoding's
  distribution. With a vocabulary of at most ``audit.max_enumerable_vocab``
  tokens, standard decoding's distribution is computed exactly by enumerating
  prefixes and the pipeline's samples (one per seed) get a chi-square
  goodness-of-fit test. Otherwise the pipeline's and standard decoding's samples
  (disjoint seeds) get a two-sample chi-square test. Both tests follow the chain
  rule: position i's test covers the next token after every sampled prefix of
  length i, each over the most frequent tokens with the rare ones binned
  together; from the second token on, the token's marginal distribution is
  tested too. Conditional tests, and independent prompts, add up. The reported
  p-value is Bonferroni's over these tests (smallest p-value times their number).

A lossy verifier (``lossless = False``) is refused unless
``audit.require_lossless=false``, in which case the audit measures its loss.
``audit.output`` is rewritten after the greedy test and after each prompt of
the sampling test (with ``complete: false``), so an interrupted audit keeps what
it finished. The exit status is 1 when a lossless audit fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specdec.decoders.engine.registry import import_plugins_from_argv

import_plugins_from_argv()  # before Hydra composes, so plugin proposers are valid choices

from specdec.decoders.cli.config import CONF_DIR  # noqa: E402
from specdec.decoders.cli.errors import check_command_line, cli_errors  # noqa: E402
from specdec.decoders.evaluation.audit import run_audit  # noqa: E402
from specdec.decoders.evaluation.files import check_writable, held_output, write_json  # noqa: E402
from specdec.decoders.evaluation.tracking import log_audit  # noqa: E402


@hydra.main(config_path=CONF_DIR, config_name="audit", version_base="1.3")
@cli_errors
def main(cfg: DictConfig) -> None:
    output = Path(cfg.audit.output)
    check_writable(output, "audit.output")  # before anything slow
    written: list[dict] = []

    def keep(partial: dict) -> None:
        write_json(output, partial)
        written[:] = [partial]

    with held_output(output, "audit.output"):  # another audit given this file meanwhile is refused
        try:
            payload = run_audit(cfg, checkpoint=keep)
        except KeyboardInterrupt:
            kept = (
                f"the partial record (complete: false) is in {output}" if written else "nothing had finished"
            )
            print(f"\n[audit] interrupted: {kept}", file=sys.stderr)
            raise
        write_json(output, payload)
    for d in payload["divergences"]:
        print(
            f"  divergence: prompt {d['prompt']} position {d['position']}: standard {d['standard_token']} "
            f"vs pipeline {d['pipeline_token']}, logit gap {d['logit_gap']}",
            file=sys.stderr,
        )
    print(f"[audit] {payload['pipeline']}: {payload['verdict']}")
    print(f"[audit] wrote {output}", file=sys.stderr)
    log_audit(cfg, payload)
    if not payload["passed"] and cfg.audit.require_lossless:
        sys.exit(1)


if __name__ == "__main__":
    check_command_line("audit")  # Hydra's errors in one line too
    main()
