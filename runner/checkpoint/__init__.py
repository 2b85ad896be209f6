"""Checkpoints: `layout` (names, discovery, verification; torch-free) and `io` (saving and
loading; torch). Import the half you need: importing this package imports neither."""
