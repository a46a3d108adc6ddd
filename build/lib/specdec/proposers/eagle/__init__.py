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

With a pointer (``copy_width`` > 0 at training, the default), ``logits_t`` is mixed
with a pointer into the committed context, the copy heads' copy attention
(:mod:`specdec.proposers.copy_attention`): its query is [feature_t ; embed(x_(t+1))], the
keys and values come from the target's highest feature and the committed tokens,
and drafts come from the mixture over the draft vocabulary plus the context's tokens.

``feature_layers`` name the target's hidden states as transformers' ``hidden_states``
does: index i (1 <= i < L) is decoder layer i-1's output, L (or -1) the final,
normed state the LM head reads (``state.hidden``). The default is EAGLE-3's
low, middle and high features ``[2, L // 2, L]``; ``[-1]`` is EAGLE-1's last layer
alone. Intermediate layers' outputs come from the verification pass itself, through
forward hooks (the target's layer tap, ``target.tap``): no extra target pass.

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

:mod:`specdec.proposers.eagle.drafter` (the drafter module and the target's features),
:mod:`specdec.proposers.eagle.artifact` (a trained drafter on disk) and
:mod:`specdec.proposers.eagle.proposer` (chains, dynamic trees and the ``eagle`` proposer).

Artifact layout (``python -m specdec.train drafter=eagle``)::

    eagle.json        architecture (feature layers, the copied layer), target, metrics
    draft_vocab.json  the draft vocabulary, ranked (proposers/draft_model.py)
    adapter/          PEFT: LoRA of the draft layer; the fusion, norms and pointer in full
"""
