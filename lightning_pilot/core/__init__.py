"""Trainer-free logic: plain values and tensors in, rows and decisions out.

Nothing in this package imports Lightning, so every piece of arithmetic and every check can be
tested without a Trainer.
"""
