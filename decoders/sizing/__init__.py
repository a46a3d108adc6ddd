"""How big a draft should be, from the target's pass cost T(n) and measured
acceptance: chain length (:mod:`draft_length`), static tree budget
(:mod:`tree_budget`) and dynamic trees (:mod:`dynamic_tree`)."""
