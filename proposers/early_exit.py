"""Early-exit self-drafting: the target's own first E layers draft, all L verify.

Each round drafts k tokens autoregressively through layers ``[0, E)`` and the
*exit*: the target's final norm and LM head, optionally preceded by a trained
residual adapter and with a LoRA on the head (see :class:`ExitHead`).

KV reuse (LayerSkip's "exit query cache"), on by default: the shallow layers
are the target's own, so the KV entries they write while drafting are exactly
what the target would write for those tokens, and the residual stream leaving
layer E-1 (the *exit hidden state*) is exactly what layer E would receive.
With N tokens cached and pending token x0, drafting d1..dk leaves layers
``[0, E)`` holding x0, d1..d(k-1) and saves their exit hidden states. The
verification pass (:meth:`EarlyExitProposer.verify_forward`) then

    1. runs layers [0, E) on dk only (the one token they have not seen),
    2. runs layers [E, L) on the whole block x0, d1..dk from the saved exit
       hidden states,

so every layer ends up holding the block, as after an ordinary target pass,
and the session's ``keep`` rolls all layers back alike. The verify pass skips
E layers for k of its k + 1 tokens; its logits equal a full pass's up to
floating-point summation order.

With ``adaptive`` (default) each round's length, 0 included, is chosen before
any shallow layer runs, by :class:`specdec.decoders.sizing.draft_length.DraftLengthPolicy`
from the acceptance measured per depth, T(n), and a drafted token's cost: T(1)
times the share of a pass's weights it reads (layers [0, E) and the LM head; 0.42
at exit 8 of SmolLM2-135M, whose head weighs as much as 7 layers). Where no draft
pays, the pipeline is standard decoding but for a one-token probe every 16 rounds.

Reuse is exact only while the shallow path *is* the target's: a trained exit
that adapts shallow layers (LoRA active only while drafting) writes different
KV entries, so reuse is switched off for it. Without reuse the draft's shallow
KV entries are cut off after drafting and the target verifies with an
ordinary full pass.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.decoders.engine.context import artifact_source
from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.files import readable_artifact
from specdec.decoders.engine.proposer import Preset, Proposer, constrained_rows, draft_token
from specdec.decoders.engine.registry import register_proposer
from specdec.decoders.engine.sampling import check_finite
from specdec.decoders.models.architecture import decoder_of
from specdec.decoders.models.layered import LayeredDecoder, check_layered_equivalence
from specdec.decoders.models.session import ModelSession

EXIT_WEIGHTS = "exit.safetensors"
EXIT_CONFIG = "exit_config.json"


class ExitHead(torch.nn.Module):
    """Exit hidden state (residual stream after layer E-1) -> draft logits.

        h  ->  h + up(silu(down(rms(h))))     residual adapter (adapter_rank > 0)
           ->  final norm                      the target's own, frozen
           ->  lm_head(x) + B(A(x)) * scale    the target's head + LoRA (head_lora_rank > 0)

    ``up`` and ``B`` start at zero, so an untrained ExitHead is exactly the
    target's final norm + LM head. ``shallow_layers`` optionally holds adapted
    copies of some of layers [0, E) (index -> module), used only while drafting.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        exit_layer: int,
        adapter_rank: int = 0,
        head_lora_rank: int = 0,
        head_lora_alpha: float = 16.0,
    ) -> None:
        super().__init__()
        decoder = decoder_of(target)
        hidden_size = target.config.hidden_size
        self.exit_layer = exit_layer
        self.adapter_rank = adapter_rank
        self.head_lora_rank = head_lora_rank
        self.head_lora_alpha = head_lora_alpha
        # The target's modules, shared (not copied) and never trained here.
        self.frozen = {"norm": decoder.norm, "lm_head": target.get_output_embeddings()}
        parameter = next(target.parameters())
        factory = {"dtype": parameter.dtype, "device": parameter.device}
        self.adapter_down = (
            torch.nn.Linear(hidden_size, adapter_rank, bias=False, **factory) if adapter_rank else None
        )
        self.adapter_up = (
            torch.nn.Linear(adapter_rank, hidden_size, bias=False, **factory) if adapter_rank else None
        )
        if self.adapter_up is not None:
            torch.nn.init.zeros_(self.adapter_up.weight)
        vocab = target.config.vocab_size
        self.head_lora_a = (
            torch.nn.Linear(hidden_size, head_lora_rank, bias=False, **factory) if head_lora_rank else None
        )
        self.head_lora_b = (
            torch.nn.Linear(head_lora_rank, vocab, bias=False, **factory) if head_lora_rank else None
        )
        if self.head_lora_b is not None:
            torch.nn.init.zeros_(self.head_lora_b.weight)
        self.shallow_layers = torch.nn.ModuleDict()

    @property
    def adapts_shallow_layers(self) -> bool:
        return len(self.shallow_layers) > 0

    def forward(self, exit_hidden: torch.Tensor) -> torch.Tensor:
        """exit_hidden: (..., hidden) -> (..., vocab) draft logits."""
        hidden = exit_hidden
        if self.adapter_down is not None:
            normed = torch.nn.functional.rms_norm(hidden, hidden.shape[-1:])
            hidden = hidden + self.adapter_up(torch.nn.functional.silu(self.adapter_down(normed)))
        hidden = self.frozen["norm"](hidden)
        logits = self.frozen["lm_head"](hidden)
        if self.head_lora_a is not None:
            logits = logits + self.head_lora_b(self.head_lora_a(hidden)) * (
                self.head_lora_alpha / self.head_lora_rank
            )
        return logits

    def adapt_shallow_layer(self, target: torch.nn.Module, index: int) -> torch.nn.Module:
        """A trainable copy of the target's layer ``index`` (< exit_layer), used while drafting."""
        if not 0 <= index < self.exit_layer:
            raise ValueError(f"only layers below the exit layer {self.exit_layer} draft; got layer {index}")
        layer = copy.deepcopy(decoder_of(target).layers[index])
        self.shallow_layers[str(index)] = layer
        return layer

    def layer_modules(self, target: torch.nn.Module) -> list[torch.nn.Module]:
        """The drafting path's layer list: the target's, with adapted copies swapped in."""
        layers = list(decoder_of(target).layers)
        for index, layer in self.shallow_layers.items():
            layers[int(index)] = layer
        return layers

    def save(self, directory: Path) -> None:
        """Write the trained parts (not the target's frozen norm and head)."""
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().contiguous() for k, v in self.state_dict().items()}, directory / EXIT_WEIGHTS
        )
        config = {
            "exit_layer": self.exit_layer,
            "adapter_rank": self.adapter_rank,
            "head_lora_rank": self.head_lora_rank,
            "head_lora_alpha": self.head_lora_alpha,
            "shallow_layers": sorted(int(i) for i in self.shallow_layers),
        }
        (directory / EXIT_CONFIG).write_text(json.dumps(config, indent=1))

    @classmethod
    def load(cls, target: torch.nn.Module, directory: Path) -> ExitHead:
        config = json.loads((directory / EXIT_CONFIG).read_text())
        shallow = config.pop("shallow_layers")
        head = cls(target, **config)
        for index in shallow:
            head.adapt_shallow_layer(target, index)
        head.load_state_dict(
            load_file(directory / EXIT_WEIGHTS, device=str(next(target.parameters()).device))
        )
        return head.to(next(target.parameters()).dtype).eval().requires_grad_(False)


def exit_artifact_dir(context, exit_layer: int) -> Path:
    """Where the trained exit for ``exit_layer`` of the context's target lives."""
    return context.artifact_path("early_exit", f"layer-{exit_layer}")


@register_proposer("early_exit")
class EarlyExitProposer(Proposer):
    shared = frozenset({"exit_head", "_pass_seconds"})  # the exit head, T(n) in passes
    per_request = frozenset({"layered", "_round"})  # the request's layer-by-layer runner, its round
    artifact = "early_exit"  # optional: without it the exit is the target's own norm and head
    trainer = "specdec.train.early_exit"
    # the shipped trained exit of the default target (30 layers): cannot pay there (0.98x)
    presets = (Preset("early_exit_trained", {"exit_layer": 8, "trained": True, "min_confidence": 0.5}),)

    @dataclass
    class Config:
        k: int = 4  # tokens drafted per round
        exit_layer: int | None = None  # draft with layers [0, exit_layer); null = half the target's depth
        kv_reuse: bool = True  # keep the draft's shallow KV; verify only the deep layers on the block
        trained: bool = False  # use the trained exit for this exit layer (artifacts dir)
        adapter_path: str | None = None  # a trained exit's directory (implies trained)
        min_confidence: float = 0.0  # end the draft at a token the exit gives less probability (0 = off)
        # choose each round's length (0 = no draft, no shallow pass) from the acceptance measured
        # per depth against T(n) and the shallow layers' cost per drafted token
        adaptive: bool = True

    def __init__(self, config: Config, context) -> None:
        target = context.target.model  # the exit reads the target's layers, norm and head
        num_layers = target.config.num_hidden_layers
        exit_layer = config.exit_layer if config.exit_layer is not None else max(num_layers // 2, 1)
        # Record the resolved layer: results and the hf_early_exit peer read it from the config.
        super().__init__(replace(config, exit_layer=exit_layer), context)
        if config.k < 1:
            raise ValueError(f"proposer.k must be >= 1, got {config.k}")
        if not 1 <= exit_layer <= num_layers:
            raise ValueError(
                f"proposer.exit_layer must be in [1, {num_layers}] for this {num_layers}-layer target, got {exit_layer}"
            )
        self.exit_layer = exit_layer
        check_layered_equivalence(target, exit_layer)
        self.artifact_source: dict | None = None  # the trained exit's source, set by _load_exit
        self.exit_head = self._load_exit()
        self.kv_reuse = config.kv_reuse and not self.exit_head.adapts_shallow_layers
        if config.kv_reuse and not self.kv_reuse:
            warnings.warn(
                "proposer.kv_reuse is off: this trained exit adapts shallow layers "
                f"{sorted(int(i) for i in self.exit_head.shallow_layers)}, so their draft KV entries "
                "are not the target's.",
                stacklevel=2,
            )
        self.layered: LayeredDecoder | None = None
        self._round: _DraftRound | None = None
        self.policy = context.sizing.chain(config.k) if config.adaptive else None
        self._draft_share = self._weights_share(target, exit_layer)  # SmolLM2-135M, exit 8: 0.42
        self._cut = False
        self._pass_seconds = context.sizing.pass_seconds(1)  # T(1), read when the curve changes

    @property
    def sampled(self) -> bool:
        return True  # chains are drawn from the exit's processed distribution

    @property
    def drafts_in_target(self) -> bool:
        return True  # the shallow layers run in the target's session; verify_forward reuses them

    def _load_exit(self) -> ExitHead:
        target = self.context.target.model
        if not (self.config.trained or self.config.adapter_path):
            return ExitHead(target, self.exit_layer)
        if self.config.adapter_path:
            directory = Path(self.config.adapter_path)
        else:
            directory = exit_artifact_dir(self.context, self.exit_layer)
        if not (directory / EXIT_WEIGHTS).exists():
            raise FileNotFoundError(
                f"no trained early exit for layer {self.exit_layer} of target {self.context.target_key!r} "
                f"at {directory}. Train one with `python -m specdec.train drafter=early_exit "
                f"model={self.context.model_config.name} drafter.exit_layer={self.exit_layer}`, "
                "or set proposer.trained=false to draft with the target's own norm and head."
            )
        train = f"python -m specdec.train drafter=early_exit drafter.exit_layer={self.exit_layer}"
        with readable_artifact(directory, train):
            head = ExitHead.load(target, directory)
        self.artifact_source = artifact_source(directory)
        if head.exit_layer != self.exit_layer:
            raise ValueError(
                f"the exit at {directory} was trained for exit layer {head.exit_layer}, not "
                f"proposer.exit_layer={self.exit_layer}; set one to match the other."
            )
        return head

    def begin(self, state) -> None:
        modules = self.exit_head.layer_modules(self.context.target.model)
        self.layered = LayeredDecoder(state.session, modules)
        self._round = None

    @torch.inference_mode()
    def propose(self, state) -> Draft:
        length = self.config.k
        self._cut = False  # whether the exit's confidence ended the draft before ``length``
        if self.policy is not None:  # chosen from earlier rounds only: sampling stays lossless
            length = self.policy.choose(None, length, self._seconds_per_token())
            if length == 0:
                return Draft.empty()  # not even the shallow layers run
        session = state.session
        layered = self._layered(session)
        block_start = len(session)
        inputs = [state.tokens[-1]]  # tokens fed to the shallow layers: pending, d1 .. d(k-1)
        exit_rows: list[torch.Tensor] = []
        draft_tokens: list[int] = []
        draft_rows: list[torch.Tensor] = []
        for i in range(length):
            exit_rows.append(layered.run(layered.embed(inputs[-1:]), 0, self.exit_layer))  # (1, hidden)
            logits = self.exit_head(exit_rows[-1][0])  # (vocab,)
            check_finite(logits, "early exit's draft pass")
            allowed = constrained_rows(state, draft_tokens)  # None without a constraint
            if allowed is not None and not bool(allowed.any()):
                break
            token, probs, confidence = draft_token(logits, state, self.config.min_confidence > 0, allowed)
            if confidence < self.config.min_confidence:
                self._cut = True
                break
            draft_tokens.append(token)
            if probs is not None:
                draft_rows.append(probs)
            if i + 1 < length:
                inputs.append(token)
        if self.kv_reuse:
            self._round = _DraftRound(block_start, inputs, torch.cat(exit_rows))
        else:
            layered.crop(0, self.exit_layer, block_start)
        draft_probs = torch.stack(draft_rows) if draft_rows else None  # (k, vocab)
        return Draft.chain(draft_tokens, draft_probs)

    def _seconds_per_token(self) -> float:
        """What drafting one token costs: T(1) times the share of a one-token pass's weights
        it reads (layers [0, exit_layer) and the exit's LM head)."""
        return self._pass_seconds()[0] * self._draft_share

    @staticmethod
    def _weights_share(target: torch.nn.Module, exit_layer: int) -> float:
        layers = decoder_of(target).layers
        head = target.get_output_embeddings().weight.numel()
        size = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        return (sum(size[:exit_layer]) + head) / (sum(size) + head)

    def observe(self, state, round: Round) -> None:
        if self.policy is not None:  # a confidence cut: its depth was tried (and paid for), for nothing
            self.policy.observe(round, tried=len(round.draft) + 1 if self._cut else None)

    @torch.inference_mode()
    def verify_forward(
        self, target: ModelSession, tokens: list[int], parents: list[int] | None
    ) -> torch.Tensor:
        """The target's pass over ``tokens`` = [pending] + draft, reusing this round's
        shallow work when the block is a chain starting where the draft started.

        The verifier may have cut the draft (to the token budget), so the block
        is matched against the drafted inputs: the shallow layers keep the
        common prefix, are cropped past it and run on the rest.
        Returns (len(tokens), vocab) logits.
        """
        draft_round, self._round = self._round, None
        layered = self._layered(target)
        block_start = len(target)
        usable = (
            draft_round is not None
            and parents is None
            and draft_round.block_start == block_start
            and layered.cached_length(0) == block_start + len(draft_round.inputs)
        )
        if not usable:
            layered.crop(0, self.exit_layer, block_start)
            return target.forward(tokens, parents)
        common = 0
        while (
            common < min(len(tokens), len(draft_round.inputs))
            and tokens[common] == draft_round.inputs[common]
        ):
            common += 1
        layered.crop(0, self.exit_layer, block_start + common)
        exit_hidden = draft_round.exit_hidden[:common]  # (common, hidden)
        if common < len(tokens):
            fresh = layered.run(layered.embed(tokens[common:]), 0, self.exit_layer)  # (q - common, hidden)
            exit_hidden = torch.cat([exit_hidden, fresh])
        final_hidden = layered.run(exit_hidden, self.exit_layer, layered.num_layers)  # (q, hidden)
        return layered.finish(tokens, final_hidden)

    def _layered(self, session: ModelSession) -> LayeredDecoder:
        if self.layered is None or self.layered.session is not session:
            self.layered = LayeredDecoder(session, self.exit_head.layer_modules(self.context.target.model))
        return self.layered

    def describe(self) -> dict:
        return {
            **({"draft_length_rates": self.policy.as_dict()} if self.policy is not None else {}),
            "exit_layer": self.exit_layer,
            "num_layers": self.context.target.num_layers,
            "kv_reuse": self.kv_reuse,
            "trained": bool(self.config.trained or self.config.adapter_path),
            "artifact": self.artifact_source,
            "adapted_shallow_layers": sorted(int(i) for i in self.exit_head.shallow_layers),
        }


@dataclass
class _DraftRound:
    """What drafting left for the verification pass to reuse.

    block_start: session length when drafting began (the pending token's position).
    inputs: tokens the shallow layers ran on, pending token first (their KV is cached).
    exit_hidden: (len(inputs), hidden) residual stream leaving layer E-1 for each input.
    """

    block_start: int
    inputs: list[int]
    exit_hidden: torch.Tensor
