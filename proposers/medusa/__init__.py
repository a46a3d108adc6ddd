"""Medusa heads: K small heads on the target's last hidden state guess the next K tokens.

:mod:`proposers.medusa.heads` (the heads and their drafting projection),
:mod:`proposers.medusa.artifact` (trained heads on disk), and
:mod:`proposers.medusa.proposer` (draft trees and the ``medusa`` proposer).
``python -m train drafter=medusa`` (:mod:`train.medusa`) trains them.
"""
