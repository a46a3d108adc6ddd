"""Measuring pipelines: the benchmark (:mod:`benchmark`), Hugging Face peers
(:mod:`peers`), metrics, workloads, the fidelity audit (:mod:`audit`, its
statistics in :mod:`audit_statistics`), plots, W&B tracking and the sweep report."""
