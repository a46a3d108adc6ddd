"""The target: a model and everything about how its passes run.

A :class:`Target` owns one loaded model and is the only thing that changes how
that model computes:

* the kernel route of its linears (:class:`specdec.decoders.models.kernels.LinearRoute`:
  the narrow route, exact mode's products) and its attention (packed GQA, exact
  attention), installed by :meth:`configure` and removed by :meth:`close`;
* its cost, T(n): the cached or measured curve (:meth:`cost_curve`) and the live
  times of the passes the decode loop makes (:meth:`pass_times`, one per pass mode);
* the layer taps drafters read the target's intermediate layers through
  (:meth:`tap`), whose forward hooks it installs and removes;
* packed passes over several requests' sessions (:meth:`packed_forward`, a batch's
  round: :mod:`specdec.decoders.models.batch`);
* what a tree or packed pass tells the model of its rows' positions (``positions``,
  :class:`specdec.decoders.models.architecture.PassPositions`: ALiBi's key biases, Llama 4's
  query temperature), set on the module for the length of one pass and undone after it.

Nothing else changes the module (the audit reads the rows a session keeps from the session,
:meth:`ModelSession.recording_kept_rows`, not through hooks), and nothing stays on the
``nn.Module`` itself or in module globals: a routed linear
changes class (to its route's subclass of ``nn.Linear``, parameters untouched), and
the attention functions are registered with transformers' attention interface under
names of this target's own, with this target's memo of the last pass's mask layout.

What proposers may use is this object's public surface: the model's shape
(``config``, ``vocab_size``, ``device``, ``dtype``), its parts a drafter shares
(:meth:`input_embeddings`, :meth:`output_embeddings`, :meth:`layers`, :meth:`norm`),
:meth:`session` to run passes, :meth:`tap` for layer outputs, :meth:`route` to give a
drafter's own linears the target's route, and the cost (:meth:`cost_curve`).
``model`` is the module itself, for code that runs it as transformers does (the
peers' ``generate``, training).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from pathlib import Path

import torch

from specdec.decoders.models.architecture import PassPositions, decoder_of
from specdec.decoders.models.batch import BatchLayout, check_batchable, packed_attention, packed_forward
from specdec.decoders.models.compiled import CompileStats, uncompile
from specdec.decoders.models.cost import CostCurve, cached_cost_curve
from specdec.decoders.models.exact_attention import MAX_ROWS as EXACT_MAX_ROWS
from specdec.decoders.models.exact_attention import (
    TailLayouts,
    exact_attention,
    exact_attention_many,
    visible_layout,
)
from specdec.decoders.models.fused_layers import Fusion, fuse_layers, unfuse_layers
from specdec.decoders.models.kernels import (
    DEFAULT_MAX_ROWS,
    PACKED_FROM,
    LinearRoute,
    linear_route,
    packed_route_available,
    route_linears,
    unroute_linears,
)
from specdec.decoders.models.packed_attention import TiledMasks, packed_gqa_attention
from specdec.decoders.models.pass_times import PassTimes
from specdec.decoders.models.quantize import Int8Linear
from specdec.decoders.models.session import ModelSession
from specdec.decoders.models.taps import LayerTap

_SERIAL = itertools.count()  # names this process's targets' attention registrations apart


class Target:
    """A model and its passes. ``narrow``: the narrow matmul route for passes of a few
    tokens; ``exact``: every pass batch-invariant (:mod:`specdec.decoders.models.kernels`)."""

    def __init__(
        self, model: torch.nn.Module, narrow: bool = False, exact: bool = False, fused: bool = False
    ) -> None:
        if isinstance(model, Target):
            raise TypeError("Target(model): give the nn.Module, not a Target")
        self.model = model
        config = getattr(model, "config", None)
        self.base_attention = getattr(config, "_attn_implementation", None)
        serial = next(_SERIAL)
        self._attention_names = {
            "exact": f"specdec_exact_{serial}",
            "packed": f"specdec_sdpa_{serial}",
            "batch": f"specdec_batch_{serial}",
        }
        self._batch_layout = BatchLayout()  # the packed attention's view of the pass running
        self._registered: list[str] = []
        self._tap: LayerTap | None = None
        # tree and packed passes' positions (ALiBi's key biases, Llama 4's query temperature),
        # set on the module only for the length of a pass
        self.positions = PassPositions(model)
        self._pass_times: dict[tuple[bool, int], PassTimes] = {}  # by exact mode and requests per pass
        self._curves: dict[tuple, CostCurve] = {}  # by (key, exact mode)
        # the routes installed so far, by mode (the target's and its drafters' linears alike),
        # sharing the packed weight copies and the exact products' measured widths: switching
        # modes back and forth (the bench's exact-off twins) re-packs and re-measures nothing
        self._routes: dict[tuple[bool, bool], LinearRoute] = {}
        self._packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._widths: dict = {}
        self.fusion = Fusion()  # the fused layers' stacked weights
        self.compile_stats = CompileStats()  # what compiling its decoder cost (model.compile=true)
        self.narrow = self.exact = self.fused = False
        self.configure(narrow, exact, fused)
        # the registrations live as long as the module that runs them (it may outlive this object);
        # then transformers' registry is left clean
        weakref.finalize(model, _unregister, list(self._attention_names.values()))

    # ------------------------------------------------------------------ passes

    def configure(self, narrow: bool, exact: bool, fused: bool | None = None) -> None:
        """Route the linears and attention: the narrow route, exact mode, both or neither;
        ``fused``: Llama-shaped layers run fused (:mod:`specdec.decoders.models.fused_layers`;
        None: as they are). Can be called again to switch (the benchmark's exact-off twins)."""
        if narrow or exact or linear_route(self.model) is not None:
            self.route(self.model, narrow=narrow, exact=exact)
        if fused is not None:
            if fused:
                fuse_layers(self.model, self.fusion)
            else:
                unfuse_layers(self.model)
            self.fused = fused
        self.narrow, self.exact = narrow, exact
        if exact:
            layouts = TailLayouts(), TailLayouts(build=visible_layout)
            function = functools.partial(exact_attention, layouts=layouts[0], visible=layouts[1])
            function.many = functools.partial(exact_attention_many, visible=layouts[1])  # packed passes'
            self._attend("exact", function)
        elif narrow:
            self._attend("packed", functools.partial(packed_gqa_attention, tiled_masks=TiledMasks()))
        elif self.attention != self.base_attention and self.base_attention is not None:
            self.model.set_attn_implementation(self.base_attention)

    @contextlib.contextmanager
    def as_built(self):
        """Inside: the model as transformers builds it (no routes, fused layers or attention of
        this target's), for code that must run it so (a peer compiling transformers' own passes)."""
        narrow, exact, fused = self.narrow, self.exact, self.fused
        self.configure(False, False, fused=False)
        unroute_linears(self.model)
        try:
            yield
        finally:
            self.configure(narrow, exact, fused=fused)

    def route(self, module: torch.nn.Module, narrow: bool | None = None, exact: bool | None = None) -> int:
        """Give ``module``'s linears (the target's, or a drafter's that runs narrow passes
        beside it) the route of this target's passes, or the one named; returns how many."""
        narrow = self.narrow if narrow is None else narrow
        exact = self.exact if exact is None else exact
        slot = (narrow, exact)
        if slot not in self._routes:
            packed_from = PACKED_FROM if narrow and not exact and packed_route_available() else 1 << 30
            self._routes[slot] = LinearRoute(
                DEFAULT_MAX_ROWS, narrow, exact, packed_from, packed=self._packed, widths=self._widths
            )
        return route_linears(module, self._routes[slot])

    def _attend(self, kind: str, function) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        if self.base_attention != "sdpa" and kind == "packed":  # packed GQA rewrites SDPA only
            if self.attention != self.base_attention and self.base_attention is not None:
                self.model.set_attn_implementation(self.base_attention)
            return
        if self.base_attention is None:
            return
        name = self._attention_names[kind]
        AttentionInterface.register(name, function)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
        if name not in self._registered:
            self._registered.append(name)
        self.model.set_attn_implementation(name)

    @property
    def attention(self) -> str | None:
        """The attention implementation the model's passes take now."""
        return getattr(getattr(self.model, "config", None), "_attn_implementation", None)

    @property
    def exact_attention(self) -> bool:
        """Whether attention runs exact mode's batch-invariant kernel (it may refuse a model
        whose attention it cannot route; see :mod:`specdec.decoders.models.invariance`)."""
        return self.attention == self._attention_names["exact"]

    @property
    def widest_exact_pass(self) -> int | None:
        """In exact mode, the most tokens one pass may hold and keep every row exact: wider
        passes (the prefill) take the plain linears and SDPA, the same pass for standard and
        speculative decoding, so a verification pass must stay within this. None otherwise."""
        return min(EXACT_MAX_ROWS, DEFAULT_MAX_ROWS) if self.exact else None

    def session(self) -> ModelSession:
        """A fresh session (one request's KV cache) over this target."""
        return ModelSession(self.model, target=self)

    def packed_forward(
        self,
        sessions: list[ModelSession],
        blocks: list[list[int]],
        parents: list[list[int] | None],
        last_only: bool = False,
        inputs_embeds: list[torch.Tensor] | None = None,
        tree_starts: list[int | None] | None = None,
    ) -> list[torch.Tensor]:
        """One pass over several requests: each block (a chain, or a tree by ``parents`` as in
        :meth:`ModelSession.forward`, grown since ``tree_starts``) appended to its own session;
        each block's logits (``last_only``: its last token's); ``inputs_embeds`` as in
        :func:`~specdec.decoders.models.batch.packed_forward`.
        Attention runs per request with the function a request alone would run."""
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        for session in sessions:
            check_batchable(session)
        config = self.model.config
        alone = config._attn_implementation
        inner = _attention_function(self.model, alone)
        name = self._attention_names["batch"]
        if name not in self._registered:
            AttentionInterface.register(name, functools.partial(packed_attention, layout=self._batch_layout))
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
            self._registered.append(name)
        configs = _attention_configs(self.model)
        for each in configs:  # for this pass only (set_attn_implementation would re-check the model)
            each._attn_implementation = name
        try:
            return packed_forward(
                self.decoder(),
                sessions,
                blocks,
                parents,
                self._batch_layout,
                inner,
                last_only,
                inputs_embeds,
                tree_starts,
            )
        finally:
            for each in configs:
                each._attn_implementation = alone

    def close(self) -> None:
        """Remove everything this target installed on its model: routes, attention, hooks."""
        unroute_linears(self.model)
        unfuse_layers(self.model)
        if self.compile_stats.loaded:
            uncompile(self)
        if self.base_attention is not None and self.attention != self.base_attention:
            self.model.set_attn_implementation(self.base_attention)
        if self._tap is not None:
            self._tap.remove()
            self._tap = None
        _unregister(self._registered)
        self._registered = []
        self.narrow = self.exact = self.fused = False

    # ------------------------------------------------------------------ shape and parts

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return self.output_embeddings().weight.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    def input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def output_embeddings(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def decoder(self) -> torch.nn.Module:
        return decoder_of(self.model)

    def layers(self) -> torch.nn.ModuleList:
        """The decoder's layers, in order."""
        return self.decoder().layers

    def norm(self) -> torch.nn.Module | None:
        """The decoder's final norm (None where it has none)."""
        return getattr(self.decoder(), "norm", None)

    # ------------------------------------------------------------------ taps

    def tap(self, layers: list[int]) -> LayerTap:
        """The outputs of decoder layers ``layers`` (0-based) in this target's passes: one
        tap per target, shared by every drafter on it, its hooks removed by :meth:`close`."""
        if self._tap is None:
            self._tap = LayerTap(self.decoder())
        self._tap.watch(layers)
        return self._tap

    # ------------------------------------------------------------------ cost

    def cost_curve(self, key: str, cache_dir: Path) -> CostCurve:
        """T(n) in the current pass mode: the shared cache's curve (measured there on first
        use), kept for this target's life (a measurement too disturbed to cache included)."""
        slot = (key, self.exact)
        if slot not in self._curves:
            self._curves[slot] = cached_cost_curve(
                self.model, key + self.variant, cache_dir, exact=self.exact
            )
        return self._curves[slot]

    @property
    def variant(self) -> str:
        """What sets this target's passes apart from its model's as loaded, for the names of
        its measurements: ``-int8`` (model.quantize), ``-compiled`` (model.compile)."""
        quantized = any(isinstance(m, Int8Linear) for m in self.model.modules())
        return ("-int8" if quantized else "") + ("-compiled" if self.compile_stats.loaded else "")

    def pass_times(self, base: CostCurve | None = None, requests: int = 0) -> PassTimes | None:
        """The live times of this target's passes in the current pass mode, shared by every
        pipeline over it (the baseline included). Started from ``base`` on first use; without
        ``base``, None until some pipeline follows its live cost. ``requests``: the times of
        packed passes over that many requests (:meth:`packed_forward`), kept apart from a
        request's own passes (0): a packed pass of n rows costs more than one request's pass
        of n rows (attention runs per request), and what a batch taught must not size the
        single requests decoded after it."""
        slot = (self.exact, requests)
        if slot not in self._pass_times and base is not None:
            self._pass_times[slot] = PassTimes(base)
        return self._pass_times.get(slot)


def _attention_function(model: torch.nn.Module, name: str | None):
    """The attention function ``model``'s passes run under implementation ``name``."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in (None, "eager"):  # the modelling module's own
        attention = next(m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling"))
        return sys.modules[type(attention).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _attention_configs(model: torch.nn.Module) -> list:
    """The configs whose ``_attn_implementation`` the model's attention layers read."""
    configs = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs[id(config)] = config
    return list(configs.values())


def _unregister(names: list[str]) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for name in names:
        AttentionInterface._global_mapping.pop(name, None)
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)


def as_target(model: torch.nn.Module | Target) -> Target:
    """``model`` if it is a Target, else a Target over it that leaves its passes as they are.
    A module whose passes a Target already routes is refused: two owners would undo each
    other's routes (give that Target, e.g. ``pipeline.target``, not ``pipeline.model``)."""
    if isinstance(model, Target):
        return model
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    if linear_route(model) is not None or attention.startswith("specdec_"):
        raise ValueError(
            "this model's passes already belong to a Target (routed linears or attention): pass that "
            "Target (pipeline.target, or load_model's first value), not its module"
        )
    return Target(model)
