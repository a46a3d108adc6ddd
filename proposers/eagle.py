"""EAGLE: a one-layer draft decoder that works at the target's feature level.

Medusa-style heads each read one hidden state; an EAGLE drafter (Li et al. 2024,
EAGLE-2 2024, EAGLE-3 2025) runs autoregressively over features instead. Its
input at position t fuses a feature of position t with the embedding of token
t + 1; one decoder layer (with its own KV cache over the request) turns that into
the predicted feature of position t + 1, and the target's own LM head, over the
draft vocabulary, turns that into token t + 2::

    feature_t = W_fuse [f_t^low ; f_t^mid ; f_t^high]         committed positions: the target's layers
              = y_(t-1)                                        drafted positions: the draft's own output
    x_t       = W_in [feature_t ; embed(x_(t+1))]              both trained in full
    y_t       = norm(DecoderLayer(x_<=t))                      a copy of a target layer, LoRA-adapted
    logits_t  = lm_head_draft(y_t)                              the target's rows, frozen

``feature_layers`` name the target's hidden states as transformers' ``hidden_states``
does: index i (1 <= i < L) is decoder layer i-1's output, L (or -1) the final,
normed state the LM head reads (``state.hidden``). The default is EAGLE-3's
low, middle and high features ``[2, L // 2, L]``; ``[-1]`` is EAGLE-1's last layer
alone. Intermediate layers' outputs come from the verification pass itself, through
forward hooks (:class:`LayerTap`): no extra target pass.

The draft's KV cache holds the committed positions, each fed with the target's
features; after a round the drafted entries are dropped and the positions the
target committed are fed (one draft pass over the accepted tokens, whose inputs
are now the target's features rather than the draft's guesses), which gives the
root distribution of the next draft.

Shapes: a chain of ``k`` tokens (sampled from the draft's processed distribution
when sampling, which rejection sampling needs as draft_probs; cut to the length
that pays with ``adaptive``), or an EAGLE-2 dynamic tree (``tree: true``,
decoders/sizing/dynamic_tree.py: confidence-ranked growth, reranking and each round's
size from T(n) and measured acceptance), deterministic at every temperature (the
tree verifier's point-mass rule).

Artifact layout (``python -m train drafter=eagle``)::

    eagle.json        architecture (feature layers, the copied layer), target, metrics
    draft_vocab.json  the draft vocabulary, ranked (proposers/draft_model.py)
    adapter/          PEFT: LoRA of the draft layer, the fusion and norms in full
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decoders.engine.context import artifact_source
from decoders.engine.draft import Draft, Round
from decoders.engine.proposer import Proposer, draft_token
from decoders.engine.registry import register_proposer
from decoders.engine.sampling import check_finite
from decoders.models.kernels import route_narrow_linears, routes_narrow_linears
from decoders.models.session import ModelSession
from decoders.sizing.acceptance import confidence_bucket
from decoders.sizing.draft_length import DraftLengthPolicy
from decoders.sizing.dynamic_tree import DynamicTree
from proposers.draft_model import DraftVocabulary

CONFIG_FILE = "eagle.json"
ADAPTER_DIR = "adapter"
# PEFT: LoRA on the draft layer's projections; the new modules and norms in full
LORA_TARGETS = r"decoder\.layers\.0\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
FULL_MODULES = ["fuse", "combine", "input_layernorm", "post_attention_layernorm", "norm"]


def resolve_layers(feature_layers: list[int] | None, num_layers: int) -> list[int]:
    """Feature layers as hidden-state indices 1..L (see the module docstring), sorted,
    without repeats; None = EAGLE-3's low, middle and high features."""
    if feature_layers is None:
        feature_layers = [2, num_layers // 2, num_layers]
    resolved = sorted({min(max(i if i > 0 else num_layers + 1 + i, 1), num_layers) for i in feature_layers})
    if not feature_layers or any(i == 0 or abs(i) > num_layers for i in feature_layers):
        raise ValueError(
            f"feature layers {feature_layers} must be hidden-state indices 1..{num_layers} (or -1 for the last)"
        )
    return resolved


class LayerTap:
    """The outputs of chosen decoder layers in the target's passes (forward hooks).

    One tap per target model, shared by every proposer on it. The hooks keep a
    reference to each watched layer's output, filed under the pass's final hidden
    states (the decoder's output) for the last ``KEPT`` passes used: a session that
    serves a pass from its cache (the audit's repeated prefills) still gets the
    features of the pass that made its ``hidden``. Passes cost nothing more. (The
    entries hold their final hidden states, so no later tensor shares their memory.)"""

    KEPT = 8

    _taps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, model: nn.Module) -> None:
        decoder = model.get_decoder()
        self.layers = decoder.layers
        self._hooks: dict[int, Any] = {}
        self._current: dict[int, torch.Tensor] = {}  # this pass so far: layer -> (batch, q, hidden)
        self._passes: list[
            tuple[torch.Tensor, dict[int, torch.Tensor]]
        ] = []  # (final hidden, outputs), newest last
        decoder.register_forward_hook(self._file_pass)

    @classmethod
    def of(cls, model: nn.Module) -> LayerTap:
        if model not in cls._taps:
            cls._taps[model] = cls(model)
        return cls._taps[model]

    def watch(self, layers: list[int]) -> None:
        for layer in layers:
            if layer not in self._hooks:
                self._hooks[layer] = self.layers[layer].register_forward_hook(self._keeper(layer))

    def _keeper(self, layer: int):
        def keep(module, inputs, output) -> None:
            self._current[layer] = output[0] if isinstance(output, tuple) else output

        return keep

    def _file_pass(self, module, inputs, output) -> None:
        final = output[0] if isinstance(output, tuple) else output.last_hidden_state
        self._passes = [*self._passes[-(self.KEPT - 1) :], (final, self._current)]
        self._current = {}

    def outputs(self, final_hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """layer -> (q, hidden) outputs of the pass whose final hidden states (its first
        sequence's, as a session keeps them) are ``final_hidden``."""
        for i in range(len(self._passes) - 1, -1, -1):
            final, outputs = self._passes[i]
            if final.data_ptr() == final_hidden.data_ptr():
                self._passes.append(self._passes.pop(i))  # most recently used last
                return {layer: values[0] for layer, values in outputs.items()}
        raise RuntimeError("the target's latest pass did not run through its decoder: no layer features")


class EagleDrafter(nn.Module):
    """The feature fusion, one decoder layer and the draft vocabulary's LM head.

    Built over a target: the layer starts as a copy of target layer ``init_layer`` and
    the final norm as the target's; ``fuse`` starts by passing the highest feature
    through and ``combine`` by passing the feature through, so an untrained drafter
    is the copied layer applied on the target's last feature. The target's input
    embeddings are read, not copied; the LM head is the target's rows for the draft
    vocabulary (frozen)."""

    def __init__(
        self, target: nn.Module, feature_layers: list[int], init_layer: int, vocabulary: DraftVocabulary
    ) -> None:
        super().__init__()
        from transformers import AutoModel

        target_decoder = target.get_decoder()
        num_layers = len(target_decoder.layers)
        self.feature_layers = resolve_layers(feature_layers, num_layers)
        self.init_layer = init_layer if init_layer >= 0 else num_layers + init_layer
        if not 0 <= self.init_layer < num_layers:
            raise ValueError(f"drafter.init_layer={init_layer}: the target has {num_layers} layers")
        config = copy.deepcopy(target.config.get_text_config())
        config.num_hidden_layers = 1
        config.vocab_size, config.pad_token_id = 1, None  # inputs come as embeddings: no table of its own
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:1]
        config._attn_implementation = "sdpa"  # 4-D masks (trees, training-time test)
        weight = target.get_output_embeddings().weight
        self.decoder = AutoModel.from_config(config).to(weight.device, weight.dtype)
        layer = self.decoder.layers[0]
        layer.load_state_dict(target_decoder.layers[self.init_layer].state_dict())
        layer.self_attn.layer_idx = 0
        self.decoder.norm.load_state_dict(target_decoder.norm.state_dict())
        self.config = self.decoder.config
        hidden = weight.shape[1]
        width = len(self.feature_layers)
        self.fuse = nn.Linear(width * hidden, hidden, bias=False).to(weight)
        self.combine = nn.Linear(2 * hidden, hidden, bias=False).to(weight)
        with torch.no_grad():
            eye = torch.eye(hidden, dtype=weight.dtype, device=weight.device)
            self.fuse.weight.zero_()
            self.fuse.weight[:, (width - 1) * hidden :] = eye  # the highest feature through
            self.combine.weight.zero_()
            self.combine.weight[:, :hidden] = eye  # the feature through, the token's embedding off
        self.vocabulary = vocabulary
        self.lm_head = vocabulary.head(target.get_output_embeddings())  # (n, hidden) frozen rows
        self._embeddings = (target.get_input_embeddings(),)  # the target's, not a submodule
        self.decoder.requires_grad_(False)

    # ModelSession reads the drafter as a model
    def get_decoder(self) -> nn.Module:
        return self.decoder

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(...) token ids -> (..., hidden) the target's input embeddings, in the drafter's dtype."""
        return self._embeddings[0](tokens.to(self._embeddings[0].weight.device)).to(self.device, self.dtype)

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """features (..., hidden) (fused or the draft's own y), tokens (...) the next tokens
        -> (..., hidden) the decoder layer's inputs x."""
        return self.combine(torch.cat([features.to(self.dtype), self.embed(tokens)], dim=-1))


def target_features(
    layers: list[int], num_layers: int, final_hidden: torch.Tensor, tap: LayerTap | None, rows=None
) -> torch.Tensor:
    """(c, len(layers) * hidden) the target's features of the latest pass at ``rows``
    (None = all): intermediate layers from ``tap``, index L from ``final_hidden`` (q, hidden)."""
    parts = []
    outputs = tap.outputs(final_hidden) if tap is not None and any(i < num_layers for i in layers) else {}
    for index in layers:
        values = final_hidden if index == num_layers else outputs[index - 1]
        if len(values) != len(final_hidden):
            raise RuntimeError("the layer tap's outputs are not from the target's latest pass")
        parts.append((values if rows is None else values[rows]).to(final_hidden.device))
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------- artifact I/O


@dataclass
class EagleArtifact:
    drafter: EagleDrafter
    meta: dict


def save_artifact(peft_drafter: nn.Module, directory: Path, meta: dict, token_counts: torch.Tensor) -> None:
    """Write adapter/ (LoRA + the modules trained in full), draft_vocab.json and eagle.json."""
    from proposers.draft_model import save_draft_vocab

    directory.mkdir(parents=True, exist_ok=True)
    peft_drafter.save_pretrained(str(directory / ADAPTER_DIR))
    save_draft_vocab(directory, token_counts)
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2))


def load_artifact(directory: Path, target: nn.Module) -> EagleArtifact:
    """Rebuild the drafter over ``target``, apply the adapter and merge it (plain modules
    draft fastest), in the target's dtype."""
    from peft import PeftModel

    meta = json.loads((directory / CONFIG_FILE).read_text())
    weight = target.get_output_embeddings().weight
    vocab_size, hidden_size = weight.shape
    num_layers = len(target.get_decoder().layers)
    if (meta["vocab_size"], meta["hidden_size"], meta["num_target_layers"]) != (
        vocab_size,
        hidden_size,
        num_layers,
    ):
        raise ValueError(
            f"the EAGLE drafter in {directory} was trained for a target with vocab {meta['vocab_size']}, hidden "
            f"size {meta['hidden_size']} and {meta['num_target_layers']} layers, but this target has "
            f"{vocab_size}, {hidden_size} and {num_layers}; retrain it with `python -m train drafter=eagle`."
        )
    vocabulary = DraftVocabulary.load(directory, meta["draft_vocab_size"])
    drafter = EagleDrafter(target, meta["feature_layers"], meta["init_layer"], vocabulary)
    drafter = PeftModel.from_pretrained(drafter, str(directory / ADAPTER_DIR)).merge_and_unload()
    drafter.to(weight.dtype).eval().requires_grad_(False)
    return EagleArtifact(drafter, meta)


# ---------------------------------------------------------------- proposer


@register_proposer("eagle")
class EagleProposer(Proposer):
    @dataclass
    class Config:
        # Artifact directory; null = <artifacts_dir>/<target>/eagle.
        path: str | None = None
        k: int = 4  # chain: most tokens per draft; tree: its depth
        tree: bool = False  # EAGLE-2 dynamic tree (decoders/sizing/dynamic_tree.py) instead of a chain
        tree_width: int = 4  # trees: children per expanded node, nodes expanded per level
        # trees: nodes kept, an int, "auto" (each round's best size from T(n) and the
        # acceptance measured per depth and confidence) or null (all candidates)
        tree_budget: Any = "auto"
        # chains: cut each draft to the length that pays, from acceptance measured per
        # first-token confidence and the target's T(n) (decoders/sizing/draft_length.py)
        adaptive: bool = True

    @property
    def sampled(self) -> bool:
        return not self.config.tree  # chains carry q; trees are deterministic (point masses)

    def __init__(self, config: Config, context) -> None:
        super().__init__(config, context)
        if config.k < 1:
            raise ValueError(f"proposer.k must be >= 1, got {config.k}")
        directory = Path(config.path) if config.path else context.artifact_path("eagle")
        if not (directory / CONFIG_FILE).exists():
            raise FileNotFoundError(
                f"no EAGLE drafter for target {context.target_key!r} at {directory}. Train it with "
                f"`{context.train_command('eagle', config.path)}`."
            )
        artifact = load_artifact(directory, context.target)
        self.drafter = artifact.drafter
        if routes_narrow_linears(context.target):  # drafting passes are narrow passes too
            route_narrow_linears(self.drafter)
        self.meta = artifact.meta
        self.artifact = artifact_source(directory)
        self.num_target_layers = len(context.target.get_decoder().layers)
        self.layers = self.drafter.feature_layers
        self.tap = LayerTap.of(context.target)
        self.tap.watch([i - 1 for i in self.layers if i < self.num_target_layers])
        self.session = ModelSession(self.drafter)
        self.token_ids = self.drafter.vocabulary.token_ids.to(self.drafter.device)  # (n,) row -> token id
        self.dynamic = (
            DynamicTree(config.tree_width, config.k, config.tree_budget, context.cost_curve)
            if config.tree
            else None
        )
        self.policy = (
            DraftLengthPolicy(config.k, context.cost_curve) if config.adaptive and not config.tree else None
        )
        self._fed = 0  # committed positions in the draft's cache (fed with the target's features)

    def begin(self, state) -> None:
        self.session.reset()
        self._fed = 0

    @torch.inference_mode()
    def propose(self, state) -> Draft:
        root_logits, root_state = self._sync(state)
        if self.dynamic is not None:
            return self._draft_tree(root_logits, root_state)
        return self._draft_chain(root_logits, root_state, state)

    def _sync(self, state) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop last round's drafted entries, feed the positions the target committed
        since (their features and the tokens after them); -> the root logits (n,) and
        the draft's state (hidden,) at the last committed position."""
        committed = len(state.tokens) - 1  # positions before the pending token
        rows = state.committed_rows
        count = len(state.hidden) if rows is None else len(rows)
        start = committed - count
        if start != self._fed:
            raise RuntimeError(
                f"the EAGLE draft cache holds {self._fed} positions and the last pass committed {count}, but "
                f"the request has {committed}: call begin() at each request and propose() every round"
            )
        self.session.truncate(self._fed)
        features = target_features(
            self.layers, self.num_target_layers, state.hidden, self.tap, rows
        )  # (c, F)
        following = state.tokens[start + 1 : committed + 1]
        inputs = self.drafter.inputs(
            self.drafter.fuse(features.to(self.drafter.dtype)),
            torch.tensor(following, device=self.drafter.device),
        )  # (c, hidden)
        logits = self.session.forward(following, inputs_embeds=inputs, last_only=True)[-1]  # (n,)
        self._fed = committed
        return logits, self.session.hidden[-1]

    def _step(self, states: torch.Tensor, tokens: list[int], parents=None, tree_start=None) -> torch.Tensor:
        """Feed drafted ``tokens`` after their parents' states (f, hidden) -> (f, n) logits."""
        inputs = self.drafter.inputs(states, torch.tensor(tokens, device=self.drafter.device))
        return self.session.forward(tokens, parents, tree_start=tree_start, inputs_embeds=inputs)

    def _draft_chain(self, logits: torch.Tensor, previous: torch.Tensor, state) -> Draft:
        length = self.config.k
        if self.policy is not None:  # the cut depends on q only: sampling stays lossless
            key = confidence_bucket(float(torch.softmax(logits.float(), -1).max()))
            length = self.policy.choose(key, self.config.k)
            if length == 0:
                return Draft.empty()
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(length):
            check_finite(logits, "EAGLE drafter")
            index, probs, _ = draft_token(logits, state, False)
            tokens.append(int(self.token_ids[index]))
            if probs is not None:
                rows.append(self.drafter.vocabulary.full_row(probs))
            if i + 1 < length:
                logits = self._step(previous[None], tokens[-1:])[-1]
                previous = self.session.hidden[-1]
        return Draft.chain(tokens, torch.stack(rows) if rows else None)

    def _draft_tree(self, root_logits: torch.Tensor, root_state: torch.Tensor) -> Draft:
        """A dynamic tree: each level's frontier is fed as one more level of a tree in
        the draft's cache, after its parents' states."""
        tree_start = len(self.session)
        offset_of: dict[int, int] = {-1: -1}  # candidate node -> offset of its fed entry
        state_of: dict[int, torch.Tensor] = {-1: root_state}  # node -> the draft's state there
        fed_parents: list[int] = []

        def expand(frontier: list[int], rows: list[int], parents: list[int], depth: int) -> torch.Tensor:
            for node in frontier:
                offset_of[node] = len(fed_parents)
                fed_parents.append(offset_of[parents[node]])
            states = torch.stack([state_of[parents[node]] for node in frontier])  # (f, hidden)
            tokens = self._ids([rows[node] for node in frontier])
            logits = self._step(states, tokens, fed_parents, tree_start)  # (f, n)
            for i, node in enumerate(frontier):
                state_of[node] = self.session.hidden[i]
            return logits

        draft = self.dynamic.build(root_logits, expand, "EAGLE drafter")
        return Draft(self._ids(draft.tokens), draft.parents, values=draft.values)

    def _ids(self, rows: list[int]) -> list[int]:
        """Rows of the draft vocabulary -> token ids."""
        return self.token_ids[torch.tensor(rows, dtype=torch.long, device=self.token_ids.device)].tolist()

    def observe(self, state, round: Round) -> None:
        sizer = self.dynamic if self.dynamic is not None else self.policy
        if sizer is not None:
            sizer.observe(round)

    def describe(self) -> dict:
        facts = {
            "artifact": self.artifact,
            "feature_layers": self.layers,
            "draft_vocab_size": len(self.token_ids),
            "k": self.config.k,
            "heldout_top1": self.meta.get("metrics", {}).get("top1"),
        }
        if self.dynamic is not None:
            facts.update(self.dynamic.describe())
        elif self.policy is not None:
            facts["draft_length_rates"] = self.policy.as_dict()
        return facts
