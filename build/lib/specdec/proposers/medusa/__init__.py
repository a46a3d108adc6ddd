"""Medusa heads: K small heads on the target's last hidden state guess the next K tokens.

:mod:`specdec.proposers.medusa.heads` (the heads and their drafting projection),
:mod:`specdec.proposers.medusa.artifact` (trained heads on disk), and
:mod:`specdec.proposers.medusa.proposer` (draft trees and the ``medusa`` proposer).
``python -m specdec.train drafter=medusa`` (:mod:`specdec.train.medusa`) trains them.
"""
