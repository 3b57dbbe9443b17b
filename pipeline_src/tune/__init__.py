"""Stage `tune`: a cell's peak learning rate, chosen on validation before its runs.

    lr_trials.py    one short trial run per rate of the cell's grid (the train stage's Trainer)

A package of its own so that the training stage's code is whole folders (train/, model/, ...):
DVC lists a folder as one dependency where a stage runs every file in it.
"""
