"""SWIFT update-undo: exact inverses of an optimizer step (SGD, Adam, AdamW, LAMB).

:mod:`.update_undo` (``UpdateUndo``) records and inverts steps using one :mod:`.rule` per optimizer
family (:mod:`.sgd`, :mod:`.adam`, :mod:`.lamb` for :mod:`.lamb_optimizer`); :mod:`.errors` tells a
configuration refused at setup from an undo that failed.
"""
