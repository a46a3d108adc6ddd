"""Model access: loading (:mod:`loading`), the target/draft session with its KV
cache and tree forward (:mod:`session`), CPU kernel routing and exact mode
(:mod:`kernels`, :mod:`exact_attention`, :mod:`invariance`), layer-by-layer runs
(:mod:`layered`), the pass-cost curve T(n) (:mod:`cost`) and machine facts
(:mod:`machine`)."""
