"""How big a draft should be, from the target's pass cost T(n) and measured acceptance.

One statistics type (:mod:`acceptance`: tried and accepted nodes per situation key,
one prior convention per use), one best-size search (:mod:`search`: expected tokens
per second against a non-decreasing T(n), with a noise guard), and the sizers that
apply them (:class:`search.Sizer`): chain length (:mod:`draft_length`), static tree
budget (:mod:`tree_budget`) and dynamic trees (:mod:`dynamic_tree`)."""
