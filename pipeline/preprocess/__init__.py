"""Preprocessing on Ray Data: read, template, augment, tokenize, expand images, measure cost."""
