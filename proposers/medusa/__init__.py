"""Medusa heads: K small heads on the target's last hidden state guess the next K tokens.

:mod:`specdec.proposers.medusa.heads` (the heads and their drafting projection),
:mod:`specdec.proposers.medusa.artifact` (trained heads on disk),
:mod:`specdec.proposers.medusa.proposer` (draft trees and the ``medusa`` proposer), and
:mod:`specdec.proposers.medusa.copy_heads` (the ``copy_heads`` proposer: its defaults over the copy heads).
``python -m specdec.train drafter=medusa`` (:mod:`specdec.train.medusa`) trains them.
"""
