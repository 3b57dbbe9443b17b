"""A study in parts, for GPU nodes reached in short job slots.

    parts_layout.py  the parts file (`parts.yaml` beside the params file): which runs each part holds
    parts.py         stage `parts`: plan, targets, pack and build a study's parts
"""
