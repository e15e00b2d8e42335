"""Evaluation: perplexity over fixed text windows, with deltas against a baseline."""
