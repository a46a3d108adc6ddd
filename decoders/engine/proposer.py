"""The Proposer contract: who guesses the next tokens.

One method is required; everything else has a default and falls in one of five groups,
each small enough to read on its own:

    DRAFT (required)      propose(state) -> Draft        tokens as a tree (a chain is a tree),
                                                          optionally with q, the draft distribution
    FOLLOW A REQUEST      begin(state)                   a request starts (reset its own state)
      (optional)          observe(state, round)          the round's outcome: its draft, the path
                                                          accepted in its numbering, the seconds
                          skip(state)                    a round the gate keeps plain
                          finish(state)                  the request is done (memory learns here)
                          forget()                       drop earlier requests (after warm-up)
    DECLARE               Config                         its options; defaults = its best measured
      (class attributes)  artifact, trainer              the drafter it reads, who trains it
                          presets                        named variants bench lists refer to
                          shared, per_request            its state in a batch (for_request)
    SAY WHAT IT DOES      sampled, drafts_trees          draws q / drafts trees (default verifier)
      (properties)        drafts_in_target,              runs the target's own layers in the
                          reads_target_layers,           request's session / reads inner layers;
                          batch_refusal                  why it cannot batch (None: it can)
    SHARE WORK            drafting(state)                propose as steps, so a batch runs its
      (optional)                                          requests' model calls together
                          verify_forward(session, ...)   reuse drafting work in the target pass
                          describe()                     facts for results files

``state`` is the :class:`~specdec.decoders.engine.state.DecodeState` of the request: its
tokens and the target's final hidden states of the last pass. The target itself is
``context.target`` (:class:`specdec.decoders.models.target.Target`): a proposer that needs
its intermediate layers asks it for a tap (``context.target.tap(layers)``, EAGLE); one that
drafts with the target's own layers says so (``drafts_in_target``) and is given the session.
How big its drafts are it asks ``context.sizing`` (a sizer it takes from the pipeline's
policy). A proposer decides its draft's shape from its own config, never from the verifier.
The smallest complete proposer is docs/architecture.md's example (tested as written).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from specdec.decoders.engine.draft import Draft, Round
from specdec.decoders.engine.sampling import processed_probs, sample

if TYPE_CHECKING:
    from specdec.decoders.engine.context import PipelineContext
    from specdec.decoders.engine.drafting import DraftSteps
    from specdec.decoders.engine.state import DecodeState
    from specdec.decoders.models.session import ModelSession


class NeedsTokenizer(ValueError):
    """A proposer that works on text was built for a model without a tokenizer."""


@dataclass(frozen=True)
class Preset:
    """A named variant of a proposer: the options it sets over the proposer's defaults and
    the verifier it runs with (None: the pipeline's default for its drafts). A bench list
    names it by ``label`` (``bench.pipelines=[copy_heads_chain]``); labels start with
    their proposer's registered name."""

    label: str
    options: dict[str, Any] = field(default_factory=dict)
    verifier: str | None = None


class Proposer:
    name: ClassVar[str]
    artifact: ClassVar[str | None] = None
    trainer: ClassVar[str | None] = None
    presets: ClassVar[tuple[Preset, ...]] = ()

    @dataclass
    class Config:
        pass

    def __init__(self, config: Proposer.Config, context: PipelineContext) -> None:
        self.config = config
        self.context = context

    @property
    def sampled(self) -> bool:
        """True if this proposer, as configured, draws its tokens from the draft_probs
        it returns when sampling; False if it chooses them deterministically
        (draft_probs None). A property of the instance: the same class can do either
        (a draft model's chains sample, its trees do not)."""
        return False

    @property
    def drafts_trees(self) -> bool:
        """True if this proposer, as configured, drafts trees (several continuations):
        a pipeline built without a verifier then verifies them with ``tree``."""
        return False

    @property
    def drafts_in_target(self) -> bool:
        """True if drafting runs the target's own layers in the request's session and
        leaves KV entries there (early exit): the engine then hands it the session
        (``state.session``), and its :meth:`verify_forward` must leave the session
        as an ordinary pass would. False for every proposer with a model of its own."""
        return False

    @property
    def reads_target_layers(self) -> bool:
        """True if drafting reads the target's inner layers as its passes run (early
        exit's shallow layers, EAGLE's features), so it needs the target's real passes:
        a replay over recorded outputs (:mod:`specdec.decoders.evaluation.replay`) skips it.
        Final hidden states (``state.hidden``) are not inner layers."""
        return self.drafts_in_target

    @property
    def batch_refusal(self) -> str | None:
        """Why this proposer cannot draft for a batch of requests decoded together (None: it
        can): a batch's pass runs several requests at once, so a proposer that reads the
        target's inner layers as its pass runs would see them all."""
        if self.reads_target_layers:
            return (
                f"proposer {self.name!r} reads the target's inner layers as its pass runs, and a "
                "batch's pass runs several requests at once: decode its requests one at a time"
            )
        return None

    #: Attributes every request of a batch shares, by name: declared, never guessed. Each
    #: class adds its own (its drafter's weights, a memory of earlier requests, a tap on the
    #: target); :meth:`for_request` gives every other attribute to each request on its own.
    shared: ClassVar[frozenset[str]] = frozenset({"config", "context"})
    #: Attributes that hold one request's state and that :meth:`begin` sets anew: a fork
    #: starts without them (None) rather than with a copy of another request's.
    per_request: ClassVar[frozenset[str]] = frozenset()

    def for_request(self) -> Proposer:
        """This proposer for one more request decoded at the same time (a batch). Attributes
        in ``shared`` (of this class and its bases) are shared; every other one is the
        request's own: forked where it knows how (``for_request``: a session, a sizer, whose
        measured acceptance stays shared), member proposers forked one by one, plain data
        (numbers, strings, containers of them) copied. Anything else is refused, naming the
        attribute, so that no state is shared by accident: declare it in ``shared`` or give
        it a ``for_request``."""
        other = copy.copy(self)
        declared = [getattr(cls, "shared", ()) for cls in type(self).__mro__]
        shared = set().union(*declared)
        begun = set().union(*(getattr(cls, "per_request", ()) for cls in type(self).__mro__))
        own: dict[int, Any] = {}  # aliases stay aliases: a member named again is its fork
        for value in vars(self).values():
            if _proposers(value):
                forks = [member.for_request() for member in value]
                own.update({id(member): fork for member, fork in zip(value, forks)})
                own[id(value)] = forks
        for name, value in vars(self).items():
            if name in shared:
                continue
            if name in begun:
                setattr(other, name, None)
                continue
            if id(value) not in own:
                own[id(value)] = self._own_copy(name, value)
            setattr(other, name, own[id(value)])
        return other

    def _own_copy(self, name: str, value: Any) -> Any:
        fork = getattr(value, "for_request", None)
        if callable(fork) and not isinstance(value, type):
            return fork()
        if _plain(value):
            return copy.deepcopy(value)
        raise TypeError(
            f"proposer {getattr(self, 'name', type(self).__name__)!r}: attribute {name!r} "
            f"({type(value).__name__}) is neither shared nor the request's own by declaration; "
            f"add it to {type(self).__name__}.shared if every request of a batch uses it, to "
            "per_request if begin() sets it anew, or give its type a for_request()"
        )

    def begin(self, state: DecodeState) -> None:
        """Reset per-request state."""

    def propose(self, state: DecodeState) -> Draft:
        raise NotImplementedError

    def drafting(self, state: DecodeState) -> DraftSteps:
        """This round's proposal as steps: a generator that yields each model call drafting
        needs (a :class:`~specdec.decoders.engine.drafting.Work`), is sent its result, and
        returns the draft. A batch advances its requests' steps together and runs their
        calls with one key as one call. The default has no call to share: it returns
        :meth:`propose`'s draft. A proposer that overrides it proposes with
        ``run_alone(self.drafting(state))``, and reads its drafting time from
        ``state.clock`` (a batch's share of joint calls, not their whole seconds)."""
        return self.propose(state)
        yield  # a generator with no step

    @property
    def batches_drafting(self) -> bool:
        """True if :meth:`drafting` has model calls a batch can share (it is overridden)."""
        return type(self).drafting is not Proposer.drafting

    def skip(self, state: DecodeState) -> None:
        """Called instead of :meth:`propose` in a round that will not be drafted (the round
        gate found drafting does not pay); no :meth:`observe` follows. A proposer that keeps
        state in step with the target's passes (the hidden states of the positions committed,
        ``state.committed_hidden``) takes in the last pass here; one that reads only
        ``state.tokens`` catches up at its next propose and needs nothing."""

    def observe(self, state: DecodeState, round: Round) -> None:
        """Called after each round the request goes on from, with its outcome. A proposer
        needs no timer of its own: ``round.draft_seconds`` is the engine's measure."""

    def finish(self, state: DecodeState) -> None:
        """The request is done; ``state.tokens`` holds its prompt and whole output.
        A proposer with memory across requests (``suffix``) learns from it here."""

    def forget(self) -> None:
        """Drop what earlier requests left in memory, back to the state after construction.
        The benchmark calls it after warm-up, so measured requests start alike."""

    def verify_forward(
        self, target: ModelSession, tokens: list[int], parents: list[int] | None
    ) -> torch.Tensor:
        """The target's verification pass over ``tokens`` = [pending] + draft tokens,
        (len(tokens), vocab) logits; ``parents`` as in :meth:`ModelSession.forward`.

        The default is one ordinary target pass. A proposer that already computed
        part of this pass while drafting (early exit: the target's own shallow
        layers) overrides it to reuse that work; it must return the same logits
        (up to floating-point order) and leave ``target`` exactly as
        ``target.forward`` would (all layers' KV entries, ``cached``, ``hidden``).
        """
        return target.forward(tokens, parents)

    def describe(self) -> dict:
        """Facts about the proposer worth recording with results."""
        return {}


def _proposers(value: Any) -> bool:
    """A list of member proposers (merge's)."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, Proposer) for v in value)


def _plain(value: Any) -> bool:
    """Data a request can own a copy of: numbers, strings, None and containers of them."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def constrained_rows(
    state: DecodeState, path: list[int], token_ids: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Under the request's constraint, the (drafter vocab,) bool mask of the tokens its grammar
    allows after the output plus ``path`` (the tokens drafted so far), for a drafter to draw
    from its constrained, renormalised distribution (:func:`draft_token`'s ``allowed``), so
    that its q is the distribution the kept token was drawn from; None without a constraint.
    ``token_ids``: the drafter's row -> token id, for a drafter over part of the vocabulary."""
    if state.grammar is None:
        return None
    allowed = state.grammar.allowed_after(tuple(path))  # (vocab,)
    return allowed if token_ids is None else allowed[token_ids.to(allowed.device)]


def draft_token(
    logits: torch.Tensor, state: DecodeState, with_confidence: bool, allowed: torch.Tensor | None = None
) -> tuple[int, torch.Tensor | None, float]:
    """One autoregressive draft step from the drafter's ``logits`` (vocab,):
    (token index, its processed distribution q when sampling else None, confidence).

    Greedy: the argmax; sampling: a draw from q after the request's
    temperature / top-k / top-p. Confidence is the drafter's top probability
    (1.0 unless ``with_confidence``), for ending a draft where the drafter
    itself is unsure (``min_confidence``: a wrong token ends every later one).
    It is the top probability, not the drawn token's: a stop that depended on
    which token was drawn would leave the drafted tokens distributed as q
    restricted to the confident ones, and acceptance with min(1, p/q) would then
    no longer give p. A stop that depends only on q keeps sampling lossless.

    ``allowed`` (vocab,) bool: draw only among these tokens (a constraint's,
    :func:`constrained_rows`); the caller stops drafting where none is allowed.
    """
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if state.sampling.greedy:
        token = int(logits.argmax())
        confidence = float(torch.softmax(logits.float(), -1).max()) if with_confidence else 1.0
        return token, None, confidence
    probs = processed_probs(logits, state.sampling)  # (vocab,) float32
    token = int(sample(probs, state.generator))
    return token, probs, float(probs.max()) if with_confidence else 1.0
